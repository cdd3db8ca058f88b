"""A pytest plugin that keeps a test process's memory mappings under the kernel's limit.

Each executable XLA:CPU compiles maps its code and data as several regions of the process
(about 6 for a tiny program, hundreds for a training step: one test of tests/trainer adds
~1,000), and they stay mapped while anything caches the program: JAX's jit caches, and the
lru caches of jitted programs in jaxrl's modules and the tests'. One xdist worker runs about
half the suite's files, ~40,000 regions by the last ones; past Linux's `vm.max_map_count`
(65,530 by default) the next mmap fails, and XLA's compiler or loader crashes the worker
natively (segfaults and aborts inside `backend_compile_and_load`, `deserialize_executable`
or a dispatch, in whichever late test compiled then).

After each test file, when the process maps more than half the limit, every cached program
is dropped (`jax.clear_caches()` and the `cache_clear` of every lru cache in this
repository's modules): the next file compiles what it needs again. Below that nothing is
freed, so a run of a few files keeps every program it compiled.
"""

from __future__ import annotations

import functools
import gc
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]
_LRU_CACHE = type(functools.lru_cache()(lambda: None))
SHARE = 0.5  # of vm.max_map_count a process maps before its programs are dropped


def mapped_regions() -> int | None:
    """The process's memory mappings (None: not Linux)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def map_limit() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530


def drop_compiled_programs() -> None:
    """Drop every cached compiled program: JAX's caches and this repository's lru caches."""
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or not Path(path).resolve().is_relative_to(ROOT):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, _LRU_CACHE):
                value.cache_clear()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module", autouse=True)
def _bounded_mappings():
    yield
    regions = mapped_regions()
    if regions is not None and regions > SHARE * map_limit():
        drop_compiled_programs()
