"""The XLA programs a step builds, from `jax.monitoring`'s compile events.

    with counted(metrics):            # metrics["perf/compiles"], metrics["perf/compile_s"]
        ...                           # one step

A program is counted when it is lowered (`jaxpr_to_mlir_module`): every miss of a jitted
function's in-memory cache, whether XLA then compiles it or the persistent compilation cache
returns it. `perf/compile_s` adds the tracing, lowering and XLA compile seconds. Once a run's
shapes repeat (fixed prompt and response buckets), a step should build no program: a count
above 0 after the first steps is a recompile (a new bucket, or a shape or static argument that
changes every step).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

import jax.monitoring

_LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_SECONDS = (
    "/jax/core/compile/jaxpr_trace_duration",
    _LOWERING,
    "/jax/core/compile/backend_compile_duration",
)
_totals: collections.Counter = collections.Counter()
_lock = threading.Lock()
_registered = False


def _on_duration(event: str, seconds: float, **_) -> None:
    if event in _SECONDS:
        with _lock:
            _totals["seconds"] += seconds
            _totals["programs"] += event == _LOWERING


def _snapshot() -> tuple[int, float]:
    global _registered
    with _lock:
        if not _registered:  # once per process: jax.monitoring keeps its listeners for good
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _registered = True
        return _totals["programs"], _totals["seconds"]


@contextlib.contextmanager
def counted(metrics: dict[str, float]) -> Iterator[None]:
    """Sets `perf/compiles` (programs lowered) and `perf/compile_s` in `metrics` for the
    block (every thread's compiles in that time)."""
    programs, seconds = _snapshot()
    yield
    after_programs, after_seconds = _snapshot()
    metrics["perf/compiles"] = float(after_programs - programs)
    metrics["perf/compile_s"] = after_seconds - seconds
