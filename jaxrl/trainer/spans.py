"""Phase timings from the devices' completion, without blocking the host after each phase.

    spans = Spans()
    out = run_pass(...)                          # dispatched: returns before the devices finish
    spans.track("ref", start, out, group="ref")  # a thread stamps when `out` is ready
    ...
    spans.seconds()       # {"ref": s, ...}: each phase from its start to its results' readiness
    spans.intervals()     # {"ref": (start, end), ...} on `time.perf_counter`'s clock
    spans.busy("rollout", t0, t1)  # seconds of [t0, t1] the group was busy, waiting for none
    spans.ended("ref")    # when the phase's outputs were ready, waiting for it only

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
from concurrent import futures
from typing import Any

import jax


class Spans:
    """The phases of one step (module doc)."""

    def __init__(self):
        self._phases: list[tuple[str, str, float, threading.Thread, list[float]]] = []

    def track(self, name: str, start: float, outputs: Any, *, group: str = "train") -> None:
        """Phase `name`, dispatched at `start` (`time.perf_counter()`) on device group
        `group`, is over when `outputs` (a tree of arrays, or a `Future`: work on a thread
        of its own) are ready."""
        end: list[float] = []

        def wait() -> None:
            if isinstance(outputs, futures.Future):
                futures.wait([outputs])  # failed: the step's own use of it raises
            else:  # deleted or failed outputs: the step's own use of them raises
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

    def ended(self, name: str) -> float:
        """When phase `name`'s outputs were ready (its last tracking's); waits for them only."""
        ends = []
        for phase, _, _, thread, end in self._phases:
            if phase == name:
                thread.join()
                ends.append(end[0])
        return max(ends)

    def busy(self, group: str, start: float, end: float) -> float:
        """Seconds of [start, end] in which device group `group` ran a tracked phase (module
        doc: each from its dispatch or the group's previous phase's end); a phase whose
        outputs are not ready yet runs to `end`. Waits for nothing."""
        total, busy_until = 0.0, start
        for _, where, began, _, ended in self._phases:
            if where != group:
                continue
            stop = ended[0] if ended else end
            began = max(began, busy_until)
            total += max(0.0, min(stop, end) - max(began, start))
            busy_until = max(busy_until, stop)
        return total

    def seconds(self) -> dict[str, float]:
        """Each phase's length (module doc); waits for every tracked phase."""
        return {name: end - start for name, (start, end) in self.intervals().items()}
