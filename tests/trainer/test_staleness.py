"""The fully asynchronous mode's staleness rules (`jaxrl.trainer.staleness.StalenessGate`) in a
simulation of the rollouter and the trainer at random speeds: group lengths drawn long-tailed,
the trainer's steps random, the protocol the rollouter thread and the trainer follow (admit
while the gate lets a group start and slots are free; push every T steps, counting what is
running or queued and aborting what the push makes too stale; take R finished groups a step
in the order they finished, dropping those past the bound). Whatever the speeds: no trained
group is past the bound, no more groups start per version (or run at once) than the cap,
every drawn prompt is trained once or still pending, and the run never stalls."""

import collections
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl.config import load_config
from jaxrl.trainer.cluster import rollout_slots
from jaxrl.trainer.staleness import StalenessGate


def simulate(per_step, trigger, threshold, slots, lengths, step_times, steps):
    """Run `steps` training steps; returns (trained lags, max started per version, the most
    groups running at once, the prompts trained, the prompts pending at the end, the prompts
    drawn, the gate)."""
    gate = StalenessGate(per_step, trigger, threshold)
    again, fresh = collections.deque(), iter(range(10**9))
    running, queue, taking = {}, collections.deque(), []  # running: prompt -> (push, end)
    trained, lags, drawn, most, crowd = [], [], set(), 0, 0
    now, busy_until, done, pushed_for = 0, 0, 0, 0
    while done < steps:
        assert now < 10**5, "the simulation stalled"
        for prompt in [p for p, (_, end) in running.items() if end <= now]:
            queue.append((prompt, running.pop(prompt)[0]))
        if now >= busy_until:  # the trainer between steps, or waiting in `take`
            if not taking and done and done % trigger == 0 and pushed_for < done:
                pushed_for = done
                gate.push(carried=len(running) + len(queue))
                for prompt in [p for p, (push, _) in running.items() if gate.too_stale(push)]:
                    running.pop(prompt)
                    gate.release()
                    again.append(prompt)
            while queue and len(taking) < per_step:
                prompt, push = queue.popleft()
                if gate.too_stale(push):
                    gate.release()
                    again.append(prompt)
                else:
                    taking.append((prompt, push))
            if len(taking) == per_step:
                lags += [gate.lag(push) for _, push in taking]
                trained += [prompt for prompt, _ in taking]
                taking, done = [], done + 1
                busy_until = now + next(step_times)
        while gate.may_start() and len(running) < slots:
            prompt = again.popleft() if again else next(fresh)
            drawn.add(prompt)
            running[prompt] = (gate.start(), now + next(lengths))
            most = max(most, gate.started)
        crowd = max(crowd, len(running))
        now += 1
    pending = set(running) | {p for p, _ in queue} | {p for p, _ in taking} | set(again)
    return lags, most, crowd, trained, pending, drawn, gate


def long_tail(rng: np.random.Generator):
    """Group lengths in ticks, endless: mostly 1-3, a tenth 20-60 (the long responses)."""
    while True:
        yield int(rng.integers(20, 61) if rng.random() < 0.1 else rng.integers(1, 4))


@settings(max_examples=150, deadline=None)
@given(
    per_step=st.integers(1, 4),
    trigger=st.integers(1, 3),
    threshold=st.sampled_from([0.0, 0.1, 0.5, 1.0, 2.5]),
    extra_slots=st.integers(0, 48),  # up to more than the largest cap (42)
    slowest_step=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_staleness_bound_holds_at_any_speeds(
    per_step, trigger, threshold, extra_slots, slowest_step, seed
):
    rng, steps = np.random.default_rng(seed), 30
    step_times = iter(lambda: int(rng.integers(1, slowest_step + 1)), None)
    lags, most, crowd, trained, pending, drawn, gate = simulate(
        per_step, trigger, threshold, per_step + extra_slots, long_tail(rng), step_times, steps
    )
    assert gate.bound == math.ceil(1 + threshold)
    assert len(lags) == per_step * steps
    assert max(lags) <= gate.bound  # no trained group past the bound
    assert most <= gate.cap  # never more started per version than verl's cap
    assert crowd <= gate.cap  # never more running: the rollout's slots (`rollout_slots`)
    assert len(trained) == len(set(trained))  # each prompt trained once
    assert set(trained) | pending == drawn and not set(trained) & pending  # none lost


def test_gate_counts_as_verl():
    """verl's max_required_samples = R x T x (1 + θ); the carried groups count again."""
    gate = StalenessGate(per_step=4, trigger=2, threshold=0.5)
    assert (gate.cap, gate.bound) == (12, 2)
    for _ in range(12):
        assert gate.may_start()
        assert gate.start() == 0
    assert not gate.may_start()
    gate.push(carried=5)
    assert gate.started == 5 and gate.may_start()
    assert not gate.too_stale(0)
    gate.push(carried=0)
    gate.push(carried=0)
    assert gate.lag(0) == 3 and gate.too_stale(0)


@pytest.mark.parametrize(
    ("extra", "dp", "slots"),
    [
        ([], 1, 8 * 12),  # n x R x T x (1 + θ) = 8 x 4 x 2 x 1.5
        (["actor_rollout_ref.rollout.n=5"], 8, 64),  # 5 x 12 = 60, up to a multiple of dp
        (["actor_rollout_ref.rollout.max_num_seqs=64"], 1, 64),  # fewer asked: those
        (["async_training.mode=sync"], 1, 256),  # max_num_seqs (the default)
    ],
)
def test_the_rollout_holds_only_the_slots_the_gate_can_fill(extra, dp, slots):
    cfg = load_config(None, [
        "actor_rollout_ref.model.path=unused", "async_training.mode=fully_async",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=8", "async_training.staleness_threshold=0.5",
        "async_training.trigger_parameter_sync_step=2", "mesh.placement.spread=false",
        "mesh.placement.rollout.devices=1", *extra,
    ], num_devices=2)  # fmt: skip
    assert rollout_slots(cfg, dp) == slots
