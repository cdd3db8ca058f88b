"""Roles on device groups of their own (`mesh.placement`, verl's resource pools) on 8 fake
CPU devices: the groups and their checks, and PPO with the critic on 4 devices beside the
actor's 4, or the rollout on 2 beside training on 6, computing the colocated run's step at
every step."""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _quickstart import quickstart_config

from jaxrl.config import ConfigError
from jaxrl.config.checks import placed_devices, role_devices
from jaxrl.testing.numerics import STABLE_ADAM_OVERRIDES
from jaxrl.trainer.cluster import Cluster
from jaxrl.trainer.fit import build_run, fit
from jaxrl.trainer.loggers import read_metrics
from jaxrl.trainer.memory import bytes_per_device
from jaxrl.trainer.ppo_trainer import ppo_training

# 6 prompts x 4 responses = 24 rows: whole mini-batches on 8, 6 and 4 batch shards
COMMON = [
    "data.train_batch_size=6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=6",
    "actor_rollout_ref.actor.ppo_epochs=2",
    "actor_rollout_ref.rollout.n=4",
    "algorithm.adv_estimator=gae",
    "actor_rollout_ref.actor.use_kl_loss=true",
    # float32 compute (the quickstart's; the critic's default is bf16): reduction order then
    # costs ~1e-7, not bfloat16's ~1e-2
    "critic.dtype=fp32",
    # Adam at STABLE_ADAM_EPS: a step's float32 rounding cannot move the next one by ~lr
    *STABLE_ADAM_OVERRIDES,
    "mesh.dp=1",
    "mesh.fsdp=-1",
    "mesh.tp=1",
    "mesh.sp=1",
    "trainer.logger=[]",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
]


def config(root, run_dir, *extra):
    return quickstart_config(root, run_dir, *COMMON, *extra)


def test_device_groups_from_jaxrl_and_verl_keys(assets, tmp_path):
    """Placed roles take devices from the end (rollout, ref, critic, reward); verl's
    `reward_model.enable_resource_pool` sizes the reward model's group."""
    cfg = config(
        assets,
        tmp_path,
        "mesh.placement.rollout.devices=2",
        "mesh.placement.critic.devices=2",
        "reward_model.enable=true",
        f"reward_model.model.path={assets}/model",
        "reward_model.enable_resource_pool=true",
        "reward_model.n_gpus_per_node=1",
        "reward_model.nnodes=1",
    )
    assert placed_devices(cfg) == {"rollout": 2, "ref": 0, "critic": 2, "reward": 1, "teacher": 0}
    groups = role_devices(cfg, 8)
    assert groups == {
        "train": range(0, 3),
        "rollout": range(3, 5),
        "critic": range(5, 7),
        "reward": range(7, 8),
    }


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["mesh.placement.reward.devices=2"],
            "mesh.placement.reward.devices=2, but this run has no reward role",
        ),
        (
            ["reward_model.enable_resource_pool=true"],
            "reward_model.enable_resource_pool=true, but this run has no reward role",
        ),
        (
            ["mesh.placement.ref.devices=2", "actor_rollout_ref.model.attention_impl=ring"],
            "set mesh.placement.ref.sp to 2 or more",
        ),
        (["mesh.placement.rollout.devices=8"], "leave the trainer none"),
        (["mesh.placement.rollout.devices=3"], "ppo_mini_batch_size x rollout.n = 6 x 4"),
        (["mesh.placement.rollout.tp=2"], "mesh.placement.rollout takes only `devices`"),
        (
            ["mesh.placement.critic.devices=4", "mesh.placement.critic.fsdp=3"],
            "mesh.placement.critic: mesh",
        ),
        (
            ["mesh.placement.rollout.devices=2", "trainer.n_gpus_per_node=8"],
            None,  # the trainer's pool holds the rollout's devices: fine
        ),
        (
            [
                "reward_model.enable=true",
                "reward_model.model.path=x",
                "reward_model.enable_resource_pool=true",
                "reward_model.n_gpus_per_node=2",
                "trainer.n_gpus_per_node=8",
            ],
            "+ the reward model's pool of 2",
        ),
    ],
)
def test_placement_checks_name_the_key(assets, tmp_path, extra, message):
    if message is None:
        config(assets, tmp_path, *extra)
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        config(assets, tmp_path, *extra)


def test_placed_roles_live_on_their_devices(assets, tmp_path):
    """Each role's parameters (and the rollout's synced copy) on exactly its group."""
    cfg = config(
        assets, tmp_path, "mesh.placement.rollout.devices=2", "mesh.placement.critic.devices=2"
    )
    cluster = Cluster.load(cfg, ppo_training(cfg, total_steps=1))
    devices = jax.devices()

    def on(tree):
        return {d for x in jax.tree.leaves(tree) for d in x.sharding.device_set}

    assert on(cluster.actor.state) == set(devices[:4])
    assert on(cluster.critic.state) == set(devices[6:])
    assert cluster.device_group("critic") == "critic" and cluster.device_group("ref") == "train"
    assert not cluster.rollout_colocated
    cluster.sync_weights()
    assert on(cluster.rollout.params) == set(devices[4:6])
    assert cluster.num_devices == 8


def test_memory_plan_of_placed_roles_is_per_device_group(assets, tmp_path):
    """With the critic and the rollout on groups of their own, each group's peak counts its
    own resident state and programs; the plan's peak is the largest group's."""
    cfg = config(
        assets, tmp_path, "mesh.placement.critic.devices=2", "mesh.placement.rollout.devices=2"
    )
    trainer = build_run(cfg, abstract=True).trainer
    plan = trainer.memory_plan()
    assert plan.groups["critic micro-batch"] == plan.groups["critic"] == "critic"
    assert plan.groups["generate"] == plan.groups["rollout"] == "rollout"
    assert plan.groups["actor micro-batch"] == plan.groups["weight sync"] == "train"
    copy = bytes_per_device(trainer.cluster.rollout.copy_of(trainer.cluster.actor.params))
    assert plan.resident["rollout"] == copy  # kept between steps on its own devices
    critic_only = plan.resident["critic"] + max(
        plan.adds[p] for p in ("critic values", "critic micro-batch", "critic optimizer")
    )
    assert plan.group_peak("critic") == critic_only
    assert plan.group_peak("rollout") == copy + max(plan.adds["generate"], 0)
    assert plan.peak == max(plan.group_peak(g) for g in ("train", "critic", "rollout"))


def test_passes_on_separate_device_groups_run_at_once(assets, tmp_path):
    """The reference and the critic on 2 devices each: the step dispatches the values pass
    without waiting for the reference pass, whose results here wait on a host callback that
    sleeps 1 s (device time that burns no CPU, so the 2-core host is free to dispatch), so
    their spans (dispatch or the group's previous phase -> results ready) intersect; a step
    that waited after each pass would start the values pass after the reference's end. The
    same for the updates: the critic's first optimizer step's metrics wait 1 s, and the
    actor's update (on the train devices) runs meanwhile. The plan names the passes and
    their groups."""
    cfg = config(
        assets, tmp_path, "mesh.placement.ref.devices=2", "mesh.placement.critic.devices=2"
    )
    run = build_run(cfg)
    trainer = run.trainer
    assert trainer.plan.passes == ("old_log_prob", "ref", "values")
    assert trainer.plan.groups == {"old_log_prob": "train", "ref": "ref", "values": "critic"}
    ref_pass, critic = trainer._ref_log_prob, trainer.cluster.critic
    critic_apply = critic._apply

    def slowed_by(times: int):
        """x, ready 1 s after the program that made it, in the first `times` calls."""
        slept = []

        def sleep(value):
            if len(slept) < times:
                slept.append(value)
                time.sleep(1.0)
            return value

        def slowed(x):
            shape = jax.ShapeDtypeStruct((), jnp.float32)
            return x + 0.0 * jax.pure_callback(sleep, shape, x.ravel()[0])

        return jax.jit(slowed)

    slow_ref, slow_critic = slowed_by(10**6), slowed_by(1)  # every ref call; one critic step
    trainer._ref_log_prob = lambda params, mb: slow_ref(ref_pass(params, mb))

    def slowed_apply(state, grads):
        state, applied = critic_apply(state, grads)
        return state, {**applied, "grad_norm": slow_critic(applied["grad_norm"])}

    critic._apply = slowed_apply
    metrics = trainer.step(next(iter(run.train_loader)), 1)
    spans = trainer.spans.intervals()
    for first, second in (("ref", "values"), ("update_critic", "update_actor")):
        (a_start, a_end), (b_start, b_end) = spans[first], spans[second]
        assert b_start < a_end and a_start < b_end, (first, second, spans)
        assert a_end - a_start >= 1.0, spans
        assert metrics[f"timing_s/{first}"] == pytest.approx(a_end - a_start)
    assert {"old_log_prob", "adv"} <= set(spans)
    assert np.isfinite(metrics["critic/grad_norm"]) and np.isfinite(metrics["actor/grad_norm"])


IGNORED = ("timing", "perf/", "fingerprint/")  # parameter hashes: the last bits differ


@pytest.mark.entry
@pytest.mark.slow
def test_placed_runs_equal_the_colocated_run(assets, tmp_path):
    """3 PPO steps (critic, GAE, KL loss, two epochs): colocated on 8 devices, the reference
    and the critic on 2 devices each beside the actor's 4, and the rollout on 2 beside
    training on 6. The rollouts and scores are the
    same (`fingerprint/inputs`, bit for bit) and so are the response statistics; losses,
    gradient norms and values agree to float32 reduction order: the batch is split over 8, 6,
    4 or 2 devices, so sums are added in another order (measured: at most 5e-6 relative, 6e-8
    absolute on means that are 0 up to rounding; rtol 5e-5 and atol 1e-6 leave 10x)."""
    steps = "trainer.total_training_steps=3"
    colocated = read_metrics(_run(assets, tmp_path / "colocated", steps))
    runs = {
        "ref and critic on 2 each": [
            "mesh.placement.ref.devices=2",
            "mesh.placement.critic.devices=2",
        ],
        "rollout on 2": ["mesh.placement.rollout.devices=2"],
    }
    for name, placement in runs.items():
        placed = read_metrics(_run(assets, tmp_path / name.replace(" ", "_"), steps, *placement))
        assert len(placed) == len(colocated) == 3, name
        for a, b in zip(colocated, placed, strict=True):
            step = a["training/global_step"]
            assert b["fingerprint/inputs"] == a["fingerprint/inputs"], (name, step)
            for key, value in a.items():
                if key.startswith(IGNORED):
                    continue
                np.testing.assert_allclose(
                    b[key], value, rtol=5e-5, atol=1e-6, err_msg=f"{name}: {key}"
                )


def _run(root, run_dir, *extra):
    fit(config(root, run_dir, *extra))
    return run_dir
