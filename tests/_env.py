"""The XLA configuration of a test session, and the environment of the subprocesses it starts.

XLA's compile time is most of the suite's wall time (hundreds of small programs, each run a
few times), so tests compile with LLVM's optimisation level 0
(`--xla_backend_optimization_level=0`): XLA's own passes (fusion, layout assignment, SPMD
partitioning) run as in production; only the machine code of the fused kernels is left
unoptimised. Measured on 2 cores: a trainer test's XLA compile time x0.6 (23.8 -> 15.0 s),
its wall time x0.7. A test whose running time is its
execution compiles its programs at level 2 itself (`OPTIMIZED`, passed to
`Lowered.compile`).

The caller's `XLA_FLAGS` come after these defaults, so they win: the suite's second XLA
configuration (docs/testing.md) is `XLA_FLAGS="--xla_backend_optimization_level=2 ..."`.

Subprocesses get the session's flags with their own device count and the session's
compilation cache (`JAX_COMPILATION_CACHE_DIR`): a program that the session or another
subprocess compiled already is read back instead of compiled again.
"""

from __future__ import annotations

import os

DEFAULT_XLA_FLAGS = "--xla_backend_optimization_level=0"
# The variable holding the session's flags without a device count (set by tests/conftest.py).
SESSION_FLAGS = "JAXRL_TEST_XLA_FLAGS"
# `Lowered.compile(OPTIMIZED)`: LLVM's usual level for a program whose execution dominates.
OPTIMIZED = {"xla_backend_optimization_level": 2}
_CACHE = (
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
)


def session_flags(caller_flags: str) -> str:
    """The session's XLA flags (no device count): the defaults, then the caller's."""
    return f"{DEFAULT_XLA_FLAGS} {caller_flags}".strip()


def xla_flags(devices: int | None) -> str:
    """The session's flags with `devices` fake CPU devices (None: JAX's default, one)."""
    flags = os.environ.get(SESSION_FLAGS, DEFAULT_XLA_FLAGS)
    if devices is not None:
        flags += f" --xla_force_host_platform_device_count={devices}"
    return flags


def compile_cache() -> dict[str, str]:
    """The session's compilation-cache variables (empty outside a test session)."""
    return {k: os.environ[k] for k in _CACHE if k in os.environ}


def subprocess_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """`os.environ` for a test's subprocess: the CPU platform, the session's XLA flags with
    `devices` fake devices (None: one) and its compilation cache, then `extra`."""
    return {**os.environ, "XLA_FLAGS": xla_flags(devices), "JAX_PLATFORMS": "cpu", **extra}
