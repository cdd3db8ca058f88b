"""One process of a multi-process test: `python worker.py MODE` with JAXRL_* in its environment.

Modes:
    collectives  initialize, check the devices, run a jitted psum and `process_allgather`, and
                 print one JSON line `RESULT {...}`.
    loop         initialize, then run cross-process reductions forever, printing `READY` once.
    raise        as loop, but the last process raises an exception after `READY`.
    init         initialize and exit.
"""

import json
import sys

from jaxrl import distributed


def collectives() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    # Global x = [0, 1, ..., 7]; each process holds the 4 entries of its own devices.
    local = np.arange(jax.device_count(), dtype=np.float32).reshape(jax.process_count(), -1)
    x = jax.make_array_from_process_local_data(sharding, local[jax.process_index()])

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    def psum(x_shard):
        return jax.lax.psum(x_shard, "x")

    summed = multihost_utils.process_allgather(psum(x), tiled=True)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    gathered = multihost_utils.process_allgather(np.array([10 * jax.process_index() + 1]))
    info = distributed.process_info()
    row = dict(
        process_id=info.process_id,
        num_processes=info.num_processes,
        process_index=jax.process_index(),
        device_count=jax.device_count(),
        local_device_count=jax.local_device_count(),
        psum=np.asarray(summed).tolist(),
        total=float(total),
        allgather=np.asarray(gathered).tolist(),
        main=distributed.is_main_process(),
        prefix=distributed.process_log_prefix(),
    )
    print("RESULT " + json.dumps(row), flush=True)


def loop(fail: bool = False) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("x")), jnp.ones((jax.local_device_count(),))
    )
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    for step in range(10**9):
        value = float(total(x))  # blocks on the cross-process all-reduce
        if step == 20:
            print(f"READY {value}", flush=True)
        if fail and step == 40 and jax.process_index() == jax.process_count() - 1:
            raise RuntimeError("boom on purpose")


if __name__ == "__main__":
    distributed.initialize()
    modes = {"collectives": collectives, "loop": loop, "raise": lambda: loop(fail=True)}
    modes["init"] = lambda: None
    modes[sys.argv[1]]()
