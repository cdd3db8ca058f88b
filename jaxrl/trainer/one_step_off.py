"""`async_training.mode=one_step_off`: the rollout generates the next step's batch while the
trainer updates on this one (verl's `one_step_off_policy` recipe), on devices of its own.

    ahead = OneStepOff(producer, train_loader, total_steps=..., save_freq=..., seed=...)
    experience = ahead.experience(prompts, global_step, rng)   # in place of producer.produce
    ahead.metrics(experience, actor_version, summaries, timing, window)   # async/*

Step k (θ_j: the actor's weights after update j, θ_0 the initial ones):

    1. read batch k (dispatched at step k-1 with θ_{k-2}, or now when nothing was ahead),
       score it on the host and, with several processes, gather what the step needs: the
       hosts' collectives run on a device of each process, which on the rollout's would
       wait behind the next generation
    2. publish θ_{k-1} to the rollout and dispatch the generation of batch k+1 (the loader's
       next batch, `peek`ed; the key of step k+1); the host does not wait for it
    3. passes, advantages and update k on the trainer's devices, beside generation k+1

    rollout devices  |gen 1 θ0|gen 2 θ0|      |gen 3 θ1|      |gen 4 θ2|
    trainer devices           |   update 1   |   update 2   |   update 3   |
    host             ^launch 1, 2            ^launch 3       ^launch 4

So batch k is sampled by θ_{k-2} and trained at θ_{k-1}: one update stale (batches 1 and 2
are sampled by θ_0). The old-log-prob pass recomputes the log-probs under θ_{k-1} (the plan
runs it: the rollout's log-probs are not the current policy's); with
`algorithm.rollout_correction` the loss weighs each token by π_{θ_{k-1}} / π_{θ_{k-2}}
(IS weights, rejection) and clips the ratio to θ_{k-1}: AReaL's decoupled objective, the
recomputed policy as its proximal one; `bypass_mode` (verl's recipe default) clips against
the rollout's own log-probs instead.

A step that saves a checkpoint (`trainer.save_freq`), and the last step, look no batch ahead:
nothing is in flight at a checkpoint, the next step generates its own batch (then with the
current weights), and a resumed run computes what an uninterrupted one does, bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from concurrent import futures

import jax
import numpy as np

from jaxrl import distributed
from jaxrl.data.batch import PromptBatch
from jaxrl.sharding.processes import owners
from jaxrl.trainer.experience import Experience, ExperienceProducer, Launched, step_key
from jaxrl.trainer.spans import Spans

log = logging.getLogger("jaxrl.train")
_FIGURES = distributed.StepMessages("jaxrl/one_step_off/rollout/")  # the rollout's figures
_FIGURES_TIMEOUT_S = 60.0  # the rollout's process ends the same step about as soon


class OneStepOff:
    """The one-step-off-policy schedule (module doc).

    Args:
        producer: Launches and scores the generations.
        source: The train loader (`peek` gives the next step's batch without taking it).
        total_steps: The run's last step (it looks no batch ahead).
        save_freq: `trainer.save_freq` (its steps look no batch ahead).
        seed: `rollout.seed`: step k samples with `step_key(seed, k)`.
    """

    def __init__(
        self,
        producer: ExperienceProducer,
        source,
        *,
        total_steps: int,
        save_freq: int,
        seed: int,
    ):
        if not callable(getattr(source, "peek", None)):
            raise ValueError(
                "async_training.mode=one_step_off generates the next step's batch ahead: the "
                "trainer needs the train loader as prompt_source=... (a PromptIterator, whose "
                "peek() gives that batch)"
            )
        self.producer, self.source, self.seed = producer, source, seed
        self.total_steps, self.save_freq = total_steps, save_freq
        # the rollout's figures are measured where its devices are: the first of those
        # processes posts them to any process that holds none of them (`_rollout_figures`)
        homes = owners(producer.cluster.rollout.layout.mesh.devices.flat)
        self.poster = min(homes) if len(homes) < jax.process_count() else None
        if producer.rollout.multi_turn.enable and jax.process_count() > 1:
            raise ValueError(
                "async_training.mode=one_step_off with actor_rollout_ref.rollout.multi_turn."
                f"enable runs the agent loop on a thread beside the update, and over "
                f"{jax.process_count()} processes the loop's gathers would interleave with the "
                "update's collectives: not built; run it in one process, or use "
                "async_training.mode=sync"
            )
        self.measures = jax.process_index() in homes
        self.step = 0
        self.ahead: Launched | None = None
        self.rollout_spans = Spans()  # this step's generations on the rollout's devices
        # this step's batch's dispatch and the previous batch's end: its generation ran from
        # the later of the two
        self.launched_at = self.rollout_free_at = 0.0

    @contextlib.contextmanager
    def validation(self) -> Iterator[None]:
        """The block (validation's generation on the same engine, with the current weights)
        after the batch generated ahead: batch generation is queued on the devices before
        it with its own weights, but the agent loop's thread uses the engine and its weights
        until it ends (`StepRollout.dispatch_agent`)."""
        if self.ahead is not None:
            _off_the_engine(self.ahead)  # failed: the next step's read raises
        yield

    def looks_ahead(self, step: int) -> bool:
        """Whether step `step` dispatches the next step's generation (module doc)."""
        saves = self.save_freq > 0 and step % self.save_freq == 0
        return step < self.total_steps and not saves

    def experience(self, prompts: PromptBatch, global_step: int, rng: jax.Array) -> Experience:
        """Step `global_step`'s experience of `prompts` (the module doc's 1. and 2.)."""
        self.step = global_step
        launched, self.ahead = self.ahead, None
        if launched is not None and not np.array_equal(launched.prompts.uid, prompts.uid):
            log.warning(
                "step %d: its prompts are not the batch generated ahead (the loader's next); "
                "generating them now",
                global_step,
            )
            _off_the_engine(launched)  # before the relaunch publishes weights
            launched = None
        if launched is None:  # the first step, or after one that looked no batch ahead
            launched = self.producer.launch(prompts, rng)
        self.rollout_spans = spans = Spans()
        self.launched_at = launched.dispatched
        spans.track("gen", launched.dispatched, _arrays(launched), group="rollout")
        # this batch read, scored and (several processes) gathered before the next
        # generation is queued: the hosts' collectives run on a device of each process,
        # which on the rollout's would wait behind it
        start = time.perf_counter()
        read = self.producer.rollout.collect(launched.pending)
        waited = time.perf_counter() - start
        ready = dataclasses.replace(launched, pending=read)
        experience = self.producer.produce(prompts, global_step, rng, launched=ready)
        experience.timing["gen"] = waited  # the wait for the batch's generation
        if self.looks_ahead(global_step):
            following = global_step + 1
            self.ahead = self.producer.launch(self.source.peek(), step_key(self.seed, following))
            spans.track("gen_ahead", self.ahead.dispatched, _arrays(self.ahead), group="rollout")
        return experience

    def metrics(
        self,
        experience: Experience,
        actor_version: int,
        tokens: tuple[float, float],
        timing: dict[str, float],
        window: tuple[float, float],
    ) -> dict[str, float]:
        """`async/*` of a step: the batch's staleness in weight versions (optimizer updates:
        the trainer's version at the update less the one that sampled it; each token's, one
        number for a batch generation), each side's idle fraction of the step and tokens per
        second while busy, and the batches in flight at its end. `tokens`: the batch's
        (response, all) tokens; `window`: the step's (start, end) on `time.perf_counter`."""
        lag = float(actor_version - experience.policy_version)
        start, end = window
        seconds = max(end - start, 1e-9)
        rollout_idle, generating = self._rollout_figures(window)
        trainer_busy = max(seconds - timing.get("gen", 0.0), 1e-9)
        return {
            "async/staleness/mean": lag,
            "async/staleness/max": lag,
            "async/queue_depth": float(self.ahead is not None),
            "async/trainer/idle_ratio": timing.get("gen", 0.0) / seconds,
            "async/rollout/idle_ratio": rollout_idle,
            "async/rollout/tokens_per_second": tokens[0] / generating,
            "async/trainer/tokens_per_second": tokens[1] / trainer_busy,
        }

    def _rollout_figures(self, window: tuple[float, float]) -> tuple[float, float]:
        """(the rollout's idle share of the step, seconds it spent generating this step's
        batch), from its outputs' readiness where the rollout's devices are. A process that
        holds none of them cannot wait on those arrays: it reads the figures the first
        process that does posts to the coordination service (`jaxrl.distributed.post`)."""
        if not self.measures:
            data = _FIGURES.receive(self.step, _FIGURES_TIMEOUT_S)
            if data is None:
                log.warning("step %d: no rollout figures from process %d", self.step, self.poster)
                return float("nan"), float("nan")
            idle, generating = json.loads(data)
            return idle, generating
        start, end = window
        busy = self.rollout_spans.busy("rollout", start, end)
        generated = self.rollout_spans.ended("gen")  # this step's batch: read already
        generating = max(generated - max(self.launched_at, self.rollout_free_at), 1e-9)
        self.rollout_free_at = generated
        idle = max(0.0, 1.0 - busy / max(end - start, 1e-9))
        if self.poster == jax.process_index():
            _FIGURES.send(self.step, json.dumps([idle, generating]).encode())
        return idle, generating


def _off_the_engine(launched: Launched) -> None:
    """Wait until a generation dispatched ahead no longer uses the engine: an agent loop's
    thread until it ends (batch generation is queued on the devices: nothing to wait for)."""
    if isinstance(launched.pending, futures.Future):
        futures.wait([launched.pending])


def _arrays(launched: Launched) -> tuple | futures.Future:
    """What `Spans` waits on for a dispatched generation: its output arrays (`BatchOutput`
    is a plain dataclass, not a pytree), or the agent loop's future."""
    if isinstance(launched.pending, futures.Future):
        return launched.pending
    out = launched.pending.output
    return out.responses, out.response_mask, out.log_probs
