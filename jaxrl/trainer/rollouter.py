"""The rollouter of `async_training.mode=fully_async`: a thread that keeps the rollout engine's
slots full of groups (n responses to a prompt) and puts each finished group in a queue for
the trainer (verl's `FullyAsyncRollouter` and its message queue).

    rollouter = Rollouter(engine, feed, gate, sampling, seed, partial=True)
    rollouter.start()
    group = rollouter.queue.get(timeout=...)   # a `FinishedGroup` (the trainer's thread)
    with rollouter.paused(drain=False):        # between two decode chunks: push weights
        engine.load_weights(...)
        rollouter.pushed()                     # the gate's push; stale in-flight groups aborted
    rollouter.stop()

The thread's loop, under the engine lock (the trainer's thread takes it for a push or a
validation, between two decode chunks):

    admit   the feed's next prompts, a group each (`Scheduler.submit(copies=n)`), while the
            free slots hold one and the gate lets another start (`StalenessGate`)
    decode  every running group a chunk of tokens (`Scheduler.step`)
    finish  groups whose n responses have ended go to the queue, each with its tokens'
            weights versions (`Handle.versions`)

With `partial` (verl's `partial_rollout`), a push lands between two chunks: the running
groups continue on the new weights with the caches they have, their later tokens recording
the new version. Without it, `paused(drain=True)` first stops admitting and lets the running
groups end on the old weights. Group g (the feed's draw number) samples response j with
`fold_in(fold_in(key(seed), g), j)`. An exception in the thread is kept and raised to the
trainer by `check` (and by its next `get`).

With an agent loop (`agent=`, multi-turn tools) a group is n trajectories (`Episodes`): the
loop also appends the tool turns whose calls returned before admitting, a turn over goes to
its tools or ends its trajectory, and when every running trajectory waits on tools the
thread waits for the first call outside the lock. Trajectories keep their slots between
turns (a validation drains them first), an aborted group's calls are cancelled, and
trajectory j's turn t samples with `fold_in` of response j's key and t.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import jax
import numpy as np

from jaxrl.agent import AgentLoop, Trajectory, agent_requests, trajectory_rows
from jaxrl.rollout import SamplingParams, Scheduler
from jaxrl.rollout.engine import RolloutEngine
from jaxrl.rollout.scheduler import Handle
from jaxrl.trainer.prompt_feed import FedPrompt, PromptFeed
from jaxrl.trainer.staleness import StalenessGate

log = logging.getLogger("jaxrl.train")
_TOOLS_POLL_S = 0.05  # the thread's longest wait for a tool call, outside the lock


class RolloutError(RuntimeError):
    """The rollouter thread failed; the message names what it raised."""


@dataclasses.dataclass
class FinishedGroup:
    """A group the rollouter finished.

    Attributes:
        prompt: Its prompt.
        push: The gate's push index its first token sampled with.
        responses: int32 [n, R], right-padded with 0.
        response_mask: int32 [n, R].
        log_probs: float32 [n, R], the rollout's (0 on padding).
        versions: int64 [n, R], each token's weights version (-1 on padding).
        scored: Its scores, when dynamic sampling's judge kept it (`Generated.scores`).
        trajectories: With the agent loop, its n trajectories (the arrays above are theirs:
            every response token in `response_mask`, a version on the sampled ones only).
    """

    prompt: FedPrompt
    push: int
    responses: np.ndarray
    response_mask: np.ndarray
    log_probs: np.ndarray
    versions: np.ndarray
    scored: tuple[np.ndarray, dict[str, float], dict[str, list]] | None = None
    trajectories: list[Trajectory] | None = None


@dataclasses.dataclass
class _Running:
    prompt: FedPrompt
    push: int
    handles: list[Handle]  # batch generation's; the agent loop's are its episodes' `names`

    def names(self, n: int) -> list[tuple[int, int]]:
        """Its trajectories' ids in the agent loop's `Episodes`."""
        return [(self.prompt.draw, j) for j in range(n)]


class Rollouter:
    """The generation thread (module doc).

    Args:
        engine: This process's rollout engine (its weights are pushed by the trainer).
        feed: The prompts.
        gate: The staleness rules (shared with the trainer; read and written under the lock).
        sampling: The training rollout's settings (`n` responses per group).
        seed: The groups' sampling seed.
        partial: Pushes land on running groups (verl's `partial_rollout`).
        chunk: Decode steps per `Scheduler.step` (the agent loop's: its `decode_chunk`).
        agent: Groups of multi-turn trajectories through this agent loop (on `engine`)
            instead of single responses; the feed's dataset gives their messages.
        default_agent: The agent of rows without an `agent_name`.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        feed: PromptFeed,
        gate: StalenessGate,
        sampling: SamplingParams,
        seed: int,
        *,
        partial: bool,
        chunk: int = 16,
        agent: AgentLoop | None = None,
        default_agent: str = "tool_agent",
    ):
        if engine.slots < sampling.n:
            raise ValueError(
                f"async_training.mode=fully_async holds a group's {sampling.n} responses in the "
                f"engine's slots at once, and it has {engine.slots}: raise "
                f"actor_rollout_ref.rollout.max_num_seqs to at least rollout.n={sampling.n}"
            )
        self.engine, self.feed, self.gate, self.partial = engine, feed, gate, partial
        self.n, self.width = sampling.n, sampling.max_tokens
        self.sampling = dataclasses.replace(sampling, n=1)
        self.key = jax.random.key(seed)
        self.default_agent = default_agent
        # the agent loop's trajectories in flight (its scheduler the engine's), or None
        self.episodes = None if agent is None else agent.episodes(self.sampling)
        self.scheduler = Scheduler(engine, chunk=chunk) if agent is None else \
            self.episodes.scheduler  # fmt: skip
        self.queue: queue.Queue[FinishedGroup] = queue.Queue()
        self.lock = threading.Condition()
        self.running: dict[int, _Running] = {}  # by draw number
        self.error: BaseException | None = None
        self.busy_s = 0.0  # seconds of decode chunks (the rollout's busy time)
        self.tokens = 0  # response tokens sampled
        self.tool_wait_s = 0.0  # seconds nothing decoded, every trajectory waiting on tools
        self._draining = self._stopping = False
        # set while the trainer's thread waits for the lock: the loop lets it in before its
        # next chunk (a lock is not fair: a thread that releases it and takes it again at
        # once would otherwise starve the waiter for many chunks)
        self._wanted = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rollouter", daemon=True)

    # ------------------------------------------------------------------- the trainer's side

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the thread, aborting the running groups (their prompts stay pending). A
        thread stuck in a decode chunk (a hung rollout) is left behind, a daemon, after
        `timeout` seconds."""
        self._stopping = True
        if self.lock.acquire(timeout=timeout):
            self.lock.notify_all()
            self.lock.release()
        if self._thread.ident is not None:
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the rollouter thread did not stop in %.0f s: left behind", timeout)
            return
        for group in self.running.values():
            self._abort(group)
        self.running.clear()
        if self.episodes is not None:
            self.episodes.close()

    def check(self) -> None:
        """Raise the thread's exception, if it had one."""
        if self.error is not None:
            raise RolloutError(
                f"the rollouter thread failed: {type(self.error).__name__}: {self.error}"
            ) from self.error

    def get(self, timeout: float) -> FinishedGroup:
        """The next finished group; raises the thread's error, or `RolloutError` after
        `timeout` seconds without one."""
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            try:
                return self.queue.get(timeout=min(1.0, max(deadline - time.monotonic(), 0)))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    self.check()
                    raise RolloutError(
                        f"no finished group from the rollouter in {timeout:.0f} s "
                        f"({len(self.running)} groups running, gate {self.gate.started}/"
                        f"{self.gate.cap} started): it is stuck or far too slow; raise "
                        "async_training.rollout_timeout if it is only slow"
                    ) from None

    @contextlib.contextmanager
    def paused(self, *, drain: bool, timeout: float) -> Iterator[None]:
        """The block runs between two decode chunks, the thread waiting; `drain`: after the
        running groups have ended (no new ones admitted meanwhile). Raises `RolloutError`
        when the thread does not reach a chunk's end (or drain) within `timeout` seconds."""
        if not self._acquire(timeout):
            self.check()
            raise RolloutError(
                f"the rollouter did not finish its decode chunk in {timeout:.0f} s (a weight "
                "push waits for it): it is stuck or far too slow; raise "
                "async_training.rollout_timeout if it is only slow"
            )
        try:
            if drain:
                self._draining = True
                deadline = time.monotonic() + timeout
                while self.running and self.error is None:
                    if not self.lock.wait(timeout=max(deadline - time.monotonic(), 0)):
                        raise RolloutError(
                            f"the running groups did not end in {timeout:.0f} s (a push "
                            "without partial rollouts waits for them): raise "
                            "async_training.rollout_timeout, or set "
                            "async_training.partial_rollout=true"
                        )
                self.check()
            yield
        finally:
            self._draining = False
            self.lock.notify_all()
            self.lock.release()

    def give_back(self) -> None:
        """A finished group's start given back to the gate (the trainer dropped or evicted
        it), the lock taken before the thread's next chunk; the thread may start another."""
        self._acquire()
        try:
            self.gate.release()
            self.lock.notify_all()
        finally:
            self.lock.release()

    def _acquire(self, timeout: float = -1) -> bool:
        """Take the lock before the thread's next chunk (`_wanted`); False after `timeout`
        seconds without it (-1: wait as long as it takes)."""
        self._wanted.set()
        try:
            return self.lock.acquire(timeout=timeout)
        finally:
            self._wanted.clear()

    def pushed(self) -> list[FedPrompt]:
        """Under `paused`: count the push at the gate (the running and queued groups carried
        over) and abort the running groups it makes too stale; returns their prompts (the
        trainer puts them back in the feed)."""
        self.gate.push(carried=len(self.running) + self.queue.qsize())
        stale = [d for d, g in self.running.items() if self.gate.too_stale(g.push)]
        prompts = []
        for draw in stale:
            group = self.running.pop(draw)
            self._abort(group)
            self.gate.release()
            prompts.append(group.prompt)
        return prompts

    # --------------------------------------------------------------------------- the thread

    def _loop(self) -> None:
        try:
            while True:
                with self.lock:
                    while not self._stopping and (self._wanted.is_set() or not self._work()):
                        self.lock.wait(timeout=0.1)
                    if self._stopping:
                        return
                    if self.episodes is not None:
                        self.episodes.resume_ready()  # tool turns whose calls finished
                    self._admit()
                    decoding = self.scheduler.busy
                    if decoding:
                        start = time.perf_counter()
                        self._decode()
                        self.busy_s += time.perf_counter() - start
                    done = self._finished()
                    calls = [] if decoding or self.episodes is None else self.episodes.calls()
                    self.lock.notify_all()
                for group in done:
                    self.queue.put(group)
                if calls:  # every running trajectory waits on tools: wait outside the lock
                    start = time.perf_counter()
                    futures.wait(calls, timeout=_TOOLS_POLL_S, return_when="FIRST_COMPLETED")
                    self.tool_wait_s += time.perf_counter() - start
        except BaseException as e:  # the trainer raises it (check / get)
            self.error = e
            log.error("the rollouter thread failed: %s: %s", type(e).__name__, e)
            with self.lock:
                self.lock.notify_all()

    def _work(self) -> bool:
        """Whether there is something to do: groups running, or one may start."""
        return bool(self.running) or (not self._draining and self.gate.may_start())

    def _admit(self) -> None:
        while not self._draining and self.gate.may_start() and self.scheduler.free_slots >= self.n:
            prompt = self.feed.next()
            ids, mask = prompt.input_ids, prompt.attention_mask
            key = jax.random.fold_in(self.key, prompt.draw)
            group = _Running(prompt, -1, [])
            if self.episodes is None:  # response j samples with fold_in(key, j)
                group.handles = self.scheduler.submit(ids[mask > 0], self.sampling, key,
                                                      copies=self.n, pad_to=len(ids))  # fmt: skip
            else:  # trajectory j's turn t with fold_in(fold_in(key, j), t)
                rows = self.feed.dataset.batch([prompt.row]).repeat(self.n)
                requests = agent_requests(rows, self.default_agent)
                self.episodes.admit(
                    [
                        (name, r, jax.random.fold_in(key, j))
                        for j, (name, r) in enumerate(
                            zip(group.names(self.n), requests, strict=True)
                        )
                    ]
                )
            group.push = self.gate.start()
            self.running[prompt.draw] = group

    def _decode(self) -> None:
        if self.episodes is None:
            self.scheduler.step()
        else:
            self.episodes.decode()

    def _ended(self, group: _Running) -> bool:
        if self.episodes is None:
            return all(h.done for h in group.handles)
        return all(name in self.episodes.done for name in group.names(self.n))

    def _abort(self, group: _Running) -> None:
        """End a running group's unfinished responses (their slots freed)."""
        if self.episodes is None:
            for handle in group.handles:
                if not handle.done:
                    self.scheduler.abort(handle)
            return
        names = group.names(self.n)
        self.episodes.abort([name for name in names if name in self.episodes.running])
        for name in names:
            self.episodes.done.pop(name, None)

    def _finished(self) -> list[FinishedGroup]:
        ended = [d for d, g in self.running.items() if self._ended(g)]
        return [self._rows(self.running.pop(d)) for d in ended]

    def _rows(self, group: _Running) -> FinishedGroup:
        if self.episodes is not None:
            return self._trajectory_rows(group)
        n, width = len(group.handles), self.width
        responses = np.zeros((n, width), np.int32)
        mask = np.zeros((n, width), np.int32)
        log_probs = np.zeros((n, width), np.float32)
        versions = np.full((n, width), -1, np.int64)
        for j, handle in enumerate(group.handles):
            k = len(handle.tokens)
            responses[j, :k], mask[j, :k] = handle.tokens, 1
            log_probs[j, :k] = handle.log_probs
            versions[j, :k] = [-1 if v is None else v for v in handle.versions]
            self.tokens += k
        return FinishedGroup(group.prompt, group.push, responses, mask, log_probs, versions)

    def _trajectory_rows(self, group: _Running) -> FinishedGroup:
        trajectories = [self.episodes.done.pop(name) for name in group.names(self.n)]
        prompt_length = self.episodes.loop.max_prompt_length
        rows = trajectory_rows(
            trajectories, prompt_length=prompt_length, response_length=self.width, pad_id=0
        )
        versions = np.full((len(trajectories), self.width), -1, np.int64)
        for j, t in enumerate(trajectories):
            versions[j, : len(t.versions)] = [-1 if v is None else v for v in t.versions]
            self.tokens += sum(t.sampled)
        return FinishedGroup(
            group.prompt, group.push, rows["responses"], rows["response_mask"],
            rows["rollout_log_probs"], versions, trajectories=trajectories,
        )  # fmt: skip
