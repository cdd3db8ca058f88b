"""XLA:CPU's pool threads for fake devices (`jaxrl.cpu_threads`)."""

import subprocess
import sys
import textwrap

import pytest
from _env import subprocess_env

from jaxrl import cpu_threads

FLAGS = "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8"


@pytest.mark.parametrize(
    "environ, cores, expect",
    [
        ({"XLA_FLAGS": FLAGS}, 2, "16"),
        ({"XLA_FLAGS": FLAGS, "PJRT_NPROC": "4"}, 2, "16"),  # too few for 8 devices: raised
        ({"XLA_FLAGS": FLAGS, "PJRT_NPROC": "32"}, 2, "32"),  # enough: the user's
        ({"XLA_FLAGS": FLAGS}, 16, None),  # the cores are enough
        ({"XLA_FLAGS": FLAGS + " --xla_force_host_platform_device_count=2"}, 2, "4"),  # last
        ({"XLA_FLAGS": FLAGS + " --xla_force_host_platform_device_count=2"}, 4, None),
        ({"JAX_NUM_CPU_DEVICES": "4"}, 2, "8"),
        ({}, 1, None),
    ],
)
def test_threads_for_the_devices_asked_for(monkeypatch, environ, cores, expect):
    monkeypatch.setattr(cpu_threads, "_cores", lambda: cores)
    environ = dict(environ)
    given = environ.get("PJRT_NPROC")
    cpu_threads.ensure_cpu_threads(environ)
    assert environ.get("PJRT_NPROC") == (expect or given)


def test_host_far_ahead_of_a_collective_on_8_fake_devices():
    """The deadlock the module doc describes: the host dispatches 200 small programs, each
    with an all-reduce over 8 fake CPU devices, without waiting. On a machine with fewer than
    16 cores and XLA's default pool (8 threads) this aborted the process after 40 s
    (measured: 7 of the 8 threads in the rendezvous); with jaxrl imported first it runs to
    the end."""
    script = textwrap.dedent(
        """
        import os
        import jaxrl
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        mesh = Mesh(np.array(jax.devices()), ("d",))
        x = jax.device_put(jnp.ones((8 * 128, 128)), NamedSharding(mesh, P("d")))
        f = jax.jit(lambda x: x + 1e-9 * jnp.sum(jnp.tanh(x @ x[:128].T)))
        for _ in range(200):
            x = f(x)
        print(float(x[0, 0]), os.environ.get("PJRT_NPROC"))
        """
    )
    env = subprocess_env(8)
    env.pop("PJRT_NPROC", None)  # the session's own (jaxrl set it in this process)
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    value, threads = out.stdout.split()
    assert float(value) > 1.0
    cores = cpu_threads._cores()
    assert threads == ("None" if cores >= 16 else "16")
