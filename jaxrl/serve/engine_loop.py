"""The engine's own thread: requests from any thread over one `Scheduler`.

    loop = EngineLoop(engine, chunk=8, max_pending=256)
    job = loop.submit(prompt_ids, sampling, copies=2, notify=callback)   # any thread
    # callback(list[Update]) after each decode chunk that moved the job, on the engine's
    # thread; callback(error) once if it fails (a bad request, or the engine raised)
    loop.abort(job)                    # a client gone: its slots are freed at the next chunk
    loop.close()

A job past its `deadline` (seconds from submission) is aborted by the thread itself and told
`JobTimeout`, whether or not its client still listens. Anything the thread raises while
starting or stepping fails the jobs concerned, never the thread.

The scheduler is not thread-safe, so one thread owns it: it takes the submissions and aborts
queued since its last pass, steps the scheduler a chunk (continuous batching: every running
request of every client decodes in the same `engine.decode` call) and reports to each job
the tokens its copies sampled since the last report. With nothing to do it waits for the next
submission. A chunk that raises fails every job in flight with that error and aborts them; the
loop goes on serving the next requests.

Keys: a request with a `seed` samples with `key(seed)` (its copy j with `fold_in(key, j)`, as
`Scheduler.submit` does), so the same request with the same seed gets the same tokens
whatever else is running; without one, job i takes `fold_in(key(base_seed), i)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxrl.rollout.engine import RolloutEngine
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.scheduler import Handle, Scheduler

log = logging.getLogger("jaxrl.serve")


class QueueFull(Exception):
    """More requests pending than `max_pending`."""


class BadRequest(ValueError):
    """The engine's own checks refused a request (its ids, its sampling settings)."""


class JobTimeout(TimeoutError):
    """A job not done by its deadline (aborted)."""


@dataclasses.dataclass(frozen=True)
class Update:
    """What one copy (choice) of a job sampled since the last report.

    Attributes:
        choice: The copy's index.
        tokens: The new token ids.
        log_probs: Their log-probs (the processed distribution).
        finish_reason: "stop", "length" or "abort" when the copy ended in this chunk.
        versions: The weights version that sampled each token (None: unversioned).
    """

    choice: int
    tokens: list[int]
    log_probs: list[float]
    finish_reason: str | None
    versions: list[int | None] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class Job:
    """A request's copies on the engine (fields are the engine thread's)."""

    prompt: np.ndarray
    sampling: SamplingParams
    copies: int
    notify: Callable[[Any], None]
    deadline: float = float("inf")  # time.monotonic() past which it is aborted
    key: jax.Array | None = None  # None: the seed's, or the loop's next
    first_copy: int = 0
    handles: list[Handle] = dataclasses.field(default_factory=list)
    # tokens reported per copy (None: its end reported)
    sent: list[int | None] = dataclasses.field(default_factory=list)
    done: bool = False


class EngineLoop:
    """One thread stepping a `Scheduler` over `engine` for requests of any thread (module doc).

    Args:
        engine: The engine, its weights loaded.
        chunk: Decode steps per pass (tokens a stream receives at a time).
        max_pending: Jobs queued or running at most; `submit` raises `QueueFull` past it.
        seed: The base key of requests without a seed.
    """

    def __init__(self, engine: RolloutEngine, *, chunk: int = 8, max_pending: int = 256,
                 seed: int = 0):  # fmt: skip
        self.scheduler = Scheduler(engine, chunk=chunk)
        self.max_pending, self.base_key = max_pending, jax.random.key(seed)
        self._lock, self._wake = threading.Lock(), threading.Event()
        self._submitted: list[Job] = []
        self._aborted: list[Job] = []
        self._jobs: list[Job] = []  # the thread's: submitted to the scheduler, not done
        self._pending = 0  # jobs submitted and not done (any thread, under the lock)
        self._count = 0
        self._closed = False
        self._free_slots = engine.slots  # the scheduler's, as of the thread's last pass
        self._thread = threading.Thread(target=self._run, name="jaxrl-serve-engine", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Jobs submitted and not ended."""
        return self._pending

    @property
    def free_slots(self) -> int:
        """The engine's free slots as of the thread's last pass (any thread may read it)."""
        return self._free_slots

    def submit(self, prompt: Sequence[int], sampling: SamplingParams, *, copies: int,
               notify: Callable[[Any], None], timeout: float = float("inf"),
               key: jax.Array | None = None, first_copy: int = 0) -> Job:  # fmt: skip
        """Queue a request of `copies` copies; `notify` gets its updates (module doc), and
        `JobTimeout` if it is not done within `timeout` seconds. `key`: its copies sample with
        `fold_in(key, first_copy + j)` (an episode's calls; None: the module doc's keys).
        Raises `QueueFull` with `max_pending` jobs pending."""
        deadline = time.monotonic() + timeout
        job = Job(np.asarray(prompt, np.int32), sampling, copies, notify, deadline, key,
                  first_copy)  # fmt: skip
        with self._lock:
            if self._closed:
                raise RuntimeError("EngineLoop.submit after close()")
            if self._pending >= self.max_pending:
                raise QueueFull(f"{self._pending} requests pending (max {self.max_pending})")
            self._pending += 1
            self._submitted.append(job)
        self._wake.set()
        return job

    def abort(self, job: Job) -> None:
        """End `job` now (queued or running): its slots are free after the thread's next pass."""
        with self._lock:
            self._aborted.append(job)
        self._wake.set()

    def close(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._closed = True
        self._wake.set()
        self._thread.join(timeout)

    # ---- the engine's thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                submitted, self._submitted = self._submitted, []
                aborted, self._aborted = self._aborted, []
                closed = self._closed
            if closed:
                self._fail(self._jobs + submitted, RuntimeError("the server is shutting down"))
                return
            try:
                self._pass(submitted, aborted)
            except Exception as error:  # a bug of this loop's: the jobs fail, the thread lives
                log.exception("the engine loop failed; failing the requests in flight")
                self._fail([*self._jobs, *submitted], error)
            self._free_slots = self.scheduler.free_slots

    def _pass(self, submitted: list[Job], aborted: list[Job]) -> None:
        """Start, abort and expire jobs, then decode a chunk (or wait for work)."""
        for job in submitted:
            self._start(job)
        for job in aborted:
            self._abort(job)
        now = time.monotonic()
        for job in [j for j in self._jobs if j.deadline < now]:
            self._abort(job, JobTimeout("not done by its deadline"))
        if not self.scheduler.busy:
            self._free_slots = self.scheduler.free_slots
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            return
        try:
            self.scheduler.step()
        except Exception as error:  # the engine failed: these jobs with it, not the server
            self._fail(list(self._jobs), error)
            return
        self._report()

    def _start(self, job: Job) -> None:
        sampling = job.sampling
        self._count += 1
        try:
            key = job.key
            if key is None:
                key = (jax.random.key(sampling.seed) if sampling.seed is not None
                       else jax.random.fold_in(self.base_key, self._count - 1))  # fmt: skip
            job.handles = self.scheduler.submit(job.prompt, sampling, key, copies=job.copies,
                                                first_copy=job.first_copy)  # fmt: skip
        except (ValueError, OverflowError, TypeError) as error:  # the engine's own checks
            self._end(job, BadRequest(str(error)))
            return
        except Exception as error:  # the engine failed on it
            self._end(job, error)
            return
        job.sent = [0] * job.copies
        self._jobs.append(job)

    def _abort(self, job: Job, error: BaseException | None = None) -> None:
        if job.done:
            return
        for handle in job.handles:
            if not handle.done:
                self.scheduler.abort(handle)
        self._end(job, error)

    def _report(self) -> None:
        for job in list(self._jobs):
            updates = []
            for choice, (handle, sent) in enumerate(zip(job.handles, job.sent, strict=True)):
                if sent is None:  # its end reported already
                    continue
                if len(handle.tokens) > sent or handle.done:
                    new = handle.tokens[sent:], handle.log_probs[sent:]
                    updates.append(Update(choice, *new, handle.finish_reason,
                                          handle.versions[sent:]))  # fmt: skip
                    job.sent[choice] = None if handle.done else len(handle.tokens)
            if all(h.done for h in job.handles):
                self._end(job, None)  # before its client hears of the end: pending is right
            if updates and not self._notify(job, updates):
                self._abort(job)  # nobody listens any more

    def _fail(self, jobs: Sequence[Job], error: BaseException) -> None:
        for job in jobs:
            for handle in job.handles:
                if not handle.done:
                    # a broken engine: the slot may be lost, the job still ends
                    with contextlib.suppress(Exception):
                        self.scheduler.abort(handle)
            self._end(job, error)

    def _end(self, job: Job, error: BaseException | None) -> None:
        if job.done:
            return
        job.done = True
        if job in self._jobs:
            self._jobs.remove(job)
        with self._lock:
            self._pending -= 1
        if error is not None:
            self._notify(job, error)

    @staticmethod
    def _notify(job: Job, item: Any) -> bool:
        """Tell the job's client; False when it cannot be told (its event loop is gone)."""
        try:
            job.notify(item)
        except Exception:
            log.warning("a request's client could not be notified; aborting it", exc_info=True)
            return False
        return True
