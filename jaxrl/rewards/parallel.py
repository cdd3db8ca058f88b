"""Scoring in worker processes with a per-row timeout (verl 0.9.1's `prime` manager).

A thread cannot be stopped, so a scorer stuck in a regex backtrack or a symbolic comparison would
hold a thread-based manager forever. Here every row runs in one of `num_workers` worker
processes; a row that runs longer than `timeout_s` has its worker killed (SIGKILL) and replaced,
scores `error_score` (default 0) and is counted in `reward/timeouts` and `reward/errors`. A row
whose scorer raises, or whose worker dies, scores `error_score` and is counted in
`reward/errors`. The clock of a row starts when its worker receives it, so waiting in the queue
and starting a fresh worker do not count.

Workers start with the `spawn` method, never `fork` (the parent holds JAX's threads, and
forking those can deadlock) nor `forkserver`: before Python 3.14 the fork server listens on an
unauthenticated unix socket, and whatever connects to it runs a pickle as the trainer's user
(tests/agent/test_sandbox_redteam.py checks that a sandboxed program reaches no listener).
They are daemons that exit when the manager closes, is garbage-collected, or the parent
dies. `compute_score` must be picklable: a module-level function, or a `CustomRewardFn` (which
each worker loads from its file).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import pickle
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from jaxrl.rewards.managers import RewardInputs, RewardManager, RowResult, ScoreFn


def _worker_main(conn: Connection, compute_score: ScoreFn) -> None:
    """Worker loop: receive `(row, kwargs)`, send `(row, RowResult)`; None or EOF ends it."""
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        row, kwargs = msg
        try:
            result = RowResult(value=compute_score(**kwargs))
        except Exception as e:
            result = RowResult(error=f"{type(e).__name__}: {e}")
        try:
            conn.send((row, result))
        except Exception as e:  # e.g. an unpicklable result
            conn.send((row, RowResult(error=f"cannot send the result back: {e}")))


class _Worker:
    def __init__(self, ctx, compute_score: ScoreFn) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, compute_score), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.row: int | None = None  # the row it is scoring
        self.deadline = float("inf")

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(None)
        self.process.join(1)
        self.kill()


def _stop_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.stop()
    workers.clear()


class ScoringPool:
    """`num_workers` processes that each score one row at a time, with a per-row deadline."""

    def __init__(self, compute_score: ScoreFn, num_workers: int, timeout_s: float) -> None:
        try:
            pickle.dumps(compute_score)
        except Exception as e:
            raise ValueError(
                f"compute_score={compute_score!r} cannot be pickled for worker processes ({e}); "
                "use a module-level function or custom_reward_function.path/name"
            ) from e
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(
                f"need num_workers >= 1 and timeout_s > 0, got {num_workers}, {timeout_s}"
            )
        self._ctx = mp.get_context("spawn")
        self.compute_score = compute_score
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def map(self, calls: list[dict[str, Any]]) -> list[RowResult]:
        """Score `compute_score(**call)` for every call; results in order."""
        results: list[RowResult | None] = [None] * len(calls)
        queue = deque(range(len(calls)))
        while len(self._workers) < min(self.num_workers, len(calls)):
            self._workers.append(_Worker(self._ctx, self.compute_score))
        failed_starts = 0
        while queue or any(w.row is not None for w in self._workers):
            if failed_starts > 2 * self.num_workers:  # e.g. the scorer cannot load in a worker
                for row in queue:
                    results[row] = RowResult(error="worker processes fail to start")
                queue.clear()
            for w in self._workers:
                if w.ready and w.row is None and queue:
                    w.row = queue.popleft()
                    w.deadline = time.monotonic() + self.timeout_s
                    w.conn.send((w.row, calls[w.row]))
            next_deadline = min(w.deadline for w in self._workers)
            timeout = None if next_deadline == float("inf") else next_deadline - time.monotonic()
            ready = wait(
                [w.conn for w in self._workers], None if timeout is None else max(0, timeout)
            )
            for i, w in enumerate(self._workers):
                if w.conn in ready:
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):  # the worker died (crash, os._exit, OOM kill)
                        w.process.join(5)
                        if w.row is not None:
                            error = f"worker process died (exit code {w.process.exitcode})"
                            results[w.row] = RowResult(error=error)
                        failed_starts += not w.ready
                        self._replace(i)
                        continue
                    if msg == "ready":
                        w.ready = True
                        continue
                    row, result = msg
                    results[row] = result
                    w.row, w.deadline = None, float("inf")
                elif w.row is not None and time.monotonic() >= w.deadline:
                    error = f"compute_score timed out after {self.timeout_s}s (worker killed)"
                    results[w.row] = RowResult(error=error, timed_out=True)
                    self._replace(i)
        return [r if r is not None else RowResult(error="not scored") for r in results]

    def _replace(self, i: int) -> None:
        """Kill worker i and start a fresh one in its slot."""
        self._workers[i].kill()
        self._workers[i] = _Worker(self._ctx, self.compute_score)

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        _stop_all(self._workers)

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers (for tests and debugging)."""
        return [w.process.pid for w in self._workers if w.process.is_alive()]


class ParallelRewardManager(RewardManager):
    """`prime`: the `naive` manager's per-row calls, run in worker processes with a per-row
    timeout (verl's default: 300 s). Use it as a context manager, or call `close()`.

    Args:
        num_workers: Worker processes (verl uses 64; a few per CPU core is plenty).
        timeout_s: Per-row time limit in seconds.
    """

    name = "prime"

    def __init__(self, *args: Any, num_workers: int = 4, timeout_s: float = 300.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.pool = ScoringPool(self.compute_score, num_workers, timeout_s)

    def score_rows(self, inputs: RewardInputs, responses: list[str]) -> list[RowResult]:
        calls = [
            dict(
                data_source=inputs.data_sources[i],
                solution_str=response,
                ground_truth=inputs.ground_truths[i],
                extra_info=inputs.extra_info(i),
            )
            for i, response in enumerate(responses)
        ]
        return self.pool.map(calls)

    def close(self) -> None:
        super().close()
        self.pool.close()
