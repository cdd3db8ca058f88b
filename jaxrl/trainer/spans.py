"""Phase timings from the devices' completion, without blocking the host after each phase.

    spans = Spans()
    out = run_pass(...)                          # dispatched: returns before the devices finish
    spans.track("ref", start, out, group="ref")  # a thread stamps when `out` is ready
    ...
    spans.seconds()       # {"ref": s, ...}: each phase from its start to its results' readiness
    spans.intervals()     # {"ref": (start, end), ...} on `time.perf_counter`'s clock

A step dispatches its passes one after another and waits only where the host needs a result,
so passes on different device groups (`mesh.placement`) run at once. A phase's span starts
when it was dispatched, or when the previous phase tracked on the same device group finished
if that is later (its devices were busy until then: they run one program at a time, in
order), and ends when its outputs are ready. A phase tracked under a name twice (several
teachers) spans from the first start to the last end.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import jax


class Spans:
    """The phases of one step (module doc)."""

    def __init__(self):
        self._phases: list[tuple[str, str, float, threading.Thread, list[float]]] = []

    def track(self, name: str, start: float, outputs: Any, *, group: str = "train") -> None:
        """Phase `name`, dispatched at `start` (`time.perf_counter()`) on device group
        `group`, is over when `outputs` (a tree of arrays) are ready."""
        end: list[float] = []

        def wait() -> None:
            # deleted or failed outputs: the step's own use of them raises
            with contextlib.suppress(Exception):
                jax.block_until_ready(outputs)
            end.append(time.perf_counter())

        thread = threading.Thread(target=wait, name=f"span-{name}", daemon=True)
        thread.start()
        self._phases.append((name, group, start, thread, end))

    def intervals(self) -> dict[str, tuple[float, float]]:
        """Each phase's (start, end) (module doc); waits for every tracked phase."""
        busy_until: dict[str, float] = {}
        out: dict[str, tuple[float, float]] = {}
        for name, group, start, thread, end in self._phases:
            thread.join()
            begin = min(max(start, busy_until.get(group, start)), end[0])
            busy_until[group] = end[0]
            if name in out:
                begin, _ = out[name]
            out[name] = (begin, end[0])
        return out

    def seconds(self) -> dict[str, float]:
        """Each phase's length (module doc); waits for every tracked phase."""
        return {name: end - start for name, (start, end) in self.intervals().items()}
