"""Resource limits: rlimits (inherited by every process the program starts), nice, pid_max.

RLIMIT_AS      memory_mb per process: an allocation past it raises MemoryError
RLIMIT_CPU     cpu_s per process (whole seconds): SIGXCPU, SIGKILL a second later
RLIMIT_FSIZE   file_size_mb: the largest file
RLIMIT_CORE    0
RLIMIT_NOFILE  256 open descriptors: each socket or pipe may hold kernel buffers no rlimit
               counts
RLIMIT_SIGPENDING 1024 queued signals, RLIMIT_MSGQUEUE 0
RLIMIT_NPROC   tasks of the sandbox's uid in its user namespace: the program's processes and
               threads (itself included) at most max_processes, plus the sandbox's own of
               that uid (the kernel does not enforce it for the host's root, which the
               program is not once its identity is mapped)
pid_max        the PID namespace's own (Linux >= 6.14): at most ~300 pids in it
"""

# try/except instead of contextlib.suppress: the sandbox's processes import as little as they
# can (an interpreter start is most of a call's cost).
# ruff: noqa: SIM105

from __future__ import annotations

import math
import os
import resource

MAX_OPEN_FILES = 256
MAX_PENDING_SIGNALS = 1024
NICE = 10  # the program runs niced: the sandbox's own processes and the trainer come first
PID_MAX_MIN = 301  # the kernel's floor for a namespace's pid_max (RESERVED_PIDS + 1)


def apply(config: dict[str, object], nproc: int | None) -> None:
    """The rlimits and nice of the runner (before its exec)."""
    cpu = max(1, math.ceil(config["cpu_s"]))
    _limit(resource.RLIMIT_AS, config["memory_mb"] * 2**20)
    _limit(resource.RLIMIT_CPU, cpu, cpu + 1)
    _limit(resource.RLIMIT_FSIZE, config["file_size_mb"] * 2**20)
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_NOFILE, MAX_OPEN_FILES)
    _limit(resource.RLIMIT_SIGPENDING, MAX_PENDING_SIGNALS)  # a budget shared by the uid's runs
    _limit(resource.RLIMIT_MSGQUEUE, 0)
    if nproc is not None:
        _limit(resource.RLIMIT_NPROC, nproc)
    try:
        os.nice(NICE)
    except OSError:
        pass


def _limit(kind: int, soft: int, hard: int | None = None) -> None:
    """Lower a limit to `soft`/`hard` (never above the current hard limit)."""
    _, current = resource.getrlimit(kind)
    hard = soft if hard is None else hard
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(kind, (soft, hard))


def set_pid_max(pid_max: int) -> bool:
    """Cap the PID namespace's pids (Linux >= 6.14 keeps pid_max per namespace).

    Only called inside a new user namespace: on an older kernel the sysctl is the host's and
    the write fails there (no capability over the initial namespace), never changing it.
    """
    if _kernel_version() < (6, 14):
        return False
    try:
        with open("/proc/sys/kernel/pid_max", "w") as f:
            f.write(str(pid_max))
    except OSError:
        return False
    return True


def _kernel_version() -> tuple[int, int]:
    """(major, minor) of the running kernel, e.g. (6, 18) for "6.18.44-fc"."""
    fields = os.uname().release.split(".")
    try:
        return int(fields[0]), int("".join(c for c in fields[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)
