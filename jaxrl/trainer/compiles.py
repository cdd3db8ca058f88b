"""The XLA programs a step builds, from `jax.monitoring`'s compile events.

    start = compile_totals()
    ...                                        # one step, to its last metric
    metrics.update(compiles_since(start))      # perf/compiles, perf/compile_s

A program is counted when it is lowered (`jaxpr_to_mlir_module`): every miss of a jitted
function's in-memory cache, whether XLA then compiles it or the persistent compilation cache
returns it. `perf/compile_s` adds the tracing, lowering and XLA compile seconds. Once a run's
shapes repeat (fixed prompt and response buckets), a step should build no program: a count
above 0 after the first steps is a recompile (a new bucket, or a shape or static argument that
changes every step).
"""

from __future__ import annotations

import collections
import threading

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


def compile_totals() -> tuple[int, float]:
    """Programs lowered and compile seconds so far in this process (every thread)."""
    global _registered
    with _lock:
        if not _registered:  # once per process: jax.monitoring keeps its listeners for good
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _registered = True
        return _totals["programs"], _totals["seconds"]


def compiles_since(start: tuple[int, float]) -> dict[str, float]:
    """`perf/compiles` (programs lowered) and `perf/compile_s` since `compile_totals()`
    returned `start`."""
    programs, seconds = compile_totals()
    return {"perf/compiles": float(programs - start[0]), "perf/compile_s": seconds - start[1]}
