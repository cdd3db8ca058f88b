"""XLA:CPU's client thread pool, sized before JAX creates its CPU backend.

XLA:CPU (jaxlib 0.10) runs a program over D local devices as D tasks on one thread pool of
T = max(cores, D) threads (`PJRT_NPROC` overrides cores), one program over several devices
at a time. Dispatching such a program also takes a pool thread per device, and that thread
blocks while its device already has its limit of programs in flight (32). When the host
runs that far ahead of the devices (an update loop of small programs on fake devices does),
up to D threads wait for room while the running program needs D threads to meet in its
collective's rendezvous; with T = D one of its tasks never starts, and XLA aborts the
process 40 s later ("Expected 8 threads to join the rendezvous, but only 7 of them
arrived"). With T >= 2 D both fit:

    T = max(cores, 2 D)      where D = the fake CPU devices asked for (D > 1)

`ensure_cpu_threads` raises `PJRT_NPROC` to 2 D when the machine has fewer cores (a 2-core
machine with 8 fake devices: 16 threads, mostly idle). jaxrl calls it on import; it acts
only if it runs before JAX's CPU backend is created (the first use of a device), and sees
the device count in the environment (`XLA_FLAGS`' `--xla_force_host_platform_device_count`
or `JAX_NUM_CPU_DEVICES`), not one set later through `jax.config`.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def fake_cpu_devices(environ: MutableMapping[str, str]) -> int:
    """The CPU devices the environment asks JAX for (the last flag wins; 1 if none)."""
    found = _FLAG.findall(environ.get("XLA_FLAGS", ""))
    if found:
        return int(found[-1])
    raw = environ.get("JAX_NUM_CPU_DEVICES", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def ensure_cpu_threads(environ: MutableMapping[str, str] = os.environ) -> int | None:
    """Raise `PJRT_NPROC` to 2 x the fake CPU devices where the cores are fewer (module
    doc); returns the value set, or None when nothing needed setting."""
    needed = 2 * fake_cpu_devices(environ)
    if needed <= 2 or _cores() >= needed:
        return None
    raw = environ.get("PJRT_NPROC", "").strip()
    if raw.isdigit() and int(raw) >= needed:
        return None
    environ["PJRT_NPROC"] = str(needed)
    return needed


def _cores() -> int:
    """The cores this process may run on (XLA's own count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
