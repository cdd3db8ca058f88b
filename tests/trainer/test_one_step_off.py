"""`async_training.mode=one_step_off` on 8 fake CPU devices (training on 4, the rollout on 4):
step k trains on a batch generated with the weights from before update k-1 (the step before
dispatched it), which equals a synchronous run whose rollout is handed those weights; a step
that saves looks no batch ahead, so a run resumed from its checkpoint computes the
uninterrupted run's later steps bit for bit; what the mode cannot run is refused by name."""

import re
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from _quickstart import assert_same_metrics, lagged_weights, quickstart_config

from jaxrl.config import ConfigError
from jaxrl.trainer.fit import fit
from jaxrl.trainer.loggers import read_metrics
from jaxrl.trainer.one_step_off import OneStepOff

STEPS, SAVE = 4, 2
COMMON = [
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "mesh.placement.rollout.devices=4",
    # AReaL's decoupled objective: IS weights pi_old / pi_rollout, the ratio clipped to pi_old
    "algorithm.rollout_correction.rollout_is=token",
    f"trainer.total_training_steps={STEPS}",
    f"trainer.save_freq={SAVE}",
    "trainer.logger=[]",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
]


def _fit(assets, run_dir, *extra):
    fit(quickstart_config(assets, run_dir, *COMMON, *extra))
    return read_metrics(run_dir)


@pytest.mark.slow
def test_one_step_off_equals_sync_with_the_lagged_weights_and_resumes_exactly(
    assets, tmp_path, monkeypatch
):
    ahead = _fit(assets, tmp_path / "ahead", "async_training.mode=one_step_off")
    assert [r["async/staleness/max"] for r in ahead] == [0, 1, 0, 1]  # step 3: after a save
    assert [r["async/queue_depth"] for r in ahead] == [1, 0, 1, 0]  # saves and the last: none
    assert all(0 <= r["async/rollout/idle_ratio"] <= 1 for r in ahead)
    assert ahead[1]["rollout_corr/rollout_is_mean"] != 1.0  # the IS weights see the lag

    resumed_dir = tmp_path / "resumed"
    resumed = _fit(
        assets,
        resumed_dir,
        "async_training.mode=one_step_off",
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={tmp_path / 'ahead' / 'checkpoints' / str(SAVE)}",
    )
    assert_same_metrics(ahead[SAVE:], resumed, list(range(SAVE + 1, STEPS + 1)))

    with monkeypatch.context() as patch:
        lagged_weights(patch, SAVE)
        reference = _fit(assets, tmp_path / "reference")
    assert_same_metrics(reference, [{k: r[k] for k in reference[0]} for r in ahead],
                        list(range(1, STEPS + 1)))  # fmt: skip


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "set mesh.placement.rollout.devices"),
        (
            [
                "mesh.placement.rollout.devices=4",
                "algorithm.filter_groups.enable=true",
                "algorithm.filter_groups.metric=acc",
            ],
            "async_training.mode=one_step_off with algorithm.filter_groups.enable=true: its "
            "rounds of generation would wait on the step's judge. async_training.mode="
            "fully_async judges each group as it finishes",
        ),
        (  # fully_async takes groups as they finish: nothing for the early abort to cut
            [
                "mesh.placement.rollout.devices=4",
                "async_training.mode=fully_async",
                "actor_rollout_ref.rollout.over_sample_rate=0.25",
            ],
            "Set actor_rollout_ref.rollout.over_sample_rate=0",
        ),
        (
            ["mesh.placement.rollout.devices=4", "algorithm.adv_estimator=remax"],
            "with algorithm.adv_estimator=remax (greedy baselines)",
        ),
        (["async_training.mode=one_step"], "did you mean 'one_step_off'?"),
        (  # fully_async's judge scores a group without its trajectories' turns
            [
                "mesh.placement.rollout.devices=4",
                "async_training.mode=fully_async",
                "actor_rollout_ref.rollout.multi_turn.enable=true",
                "algorithm.filter_groups.enable=true",
                "algorithm.filter_groups.metric=acc",
            ],
            "fully_async with actor_rollout_ref.rollout.multi_turn.enable=true and algorithm."
            "filter_groups",
        ),
    ],
)
def test_one_step_off_refuses_what_it_cannot_run(assets, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        quickstart_config(assets, tmp_path, "async_training.mode=one_step_off", *extra)


def test_the_agent_loop_ahead_is_refused_over_several_processes(monkeypatch):
    """The agent loop ahead runs on a thread beside the update; over several processes its
    gathers would interleave with the update's collectives: refused when built, by name. (The
    process count is faked: the producer is only read for its rollout's devices and mode.)"""
    mesh = SimpleNamespace(devices=np.array(jax.devices()[:4]))
    producer = SimpleNamespace(
        cluster=SimpleNamespace(rollout=SimpleNamespace(layout=SimpleNamespace(mesh=mesh))),
        rollout=SimpleNamespace(multi_turn=SimpleNamespace(enable=True)),
    )
    source = SimpleNamespace(peek=lambda: None)
    OneStepOff(producer, source, total_steps=2, save_freq=0, seed=0)  # one process: built
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="over 2 processes the loop's gathers would interleave"):
        OneStepOff(producer, source, total_steps=2, save_freq=0, seed=0)
