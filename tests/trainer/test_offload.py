"""Offload (verl's `fsdp_config.param_offload` / `optimizer_offload`): the keys reach the roles,
offloaded state lives in pinned host memory between the passes that use it, training computes
exactly what it computes without offload (and resumes from a checkpoint of offloaded state),
and the memory plan counts offloaded state only for the programs that bring it back."""

import jax
import pytest
from _quickstart import assert_same_metrics, quickstart_config

from jaxrl.trainer.cluster import Cluster
from jaxrl.trainer.fit import build_run, fit
from jaxrl.trainer.loggers import read_metrics
from jaxrl.trainer.memory import bytes_per_device
from jaxrl.trainer.ppo_trainer import ppo_training
from jaxrl.trainer.roles import role_specs

# every role: the actor, the reference (KL loss) and the critic (GAE), two epochs
ROLES = [
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.ppo_epochs=2",
    "algorithm.adv_estimator=gae",
    "mesh.dp=2",
    "mesh.fsdp=4",
    "mesh.tp=1",
    "mesh.sp=1",
    "trainer.logger=[]",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
]
# verl's own keys
OFFLOAD = [
    "actor_rollout_ref.actor.fsdp_config.param_offload=true",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
    "actor_rollout_ref.ref.fsdp_config.param_offload=true",
    "critic.fsdp.param_offload=true",
    "critic.fsdp.optimizer_offload=true",
]


def config(root, run_dir, *extra):
    return quickstart_config(root, run_dir, *ROLES, *extra)


def kinds(tree) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def test_verl_keys_offload_the_roles_state_to_host_memory(assets, tmp_path):
    cfg = config(assets, tmp_path, *OFFLOAD)
    specs = role_specs(cfg)
    assert all(specs[r].param_offload for r in ("actor", "ref", "critic"))
    assert specs["actor"].optimizer_offload and specs["critic"].optimizer_offload
    cluster = Cluster.load(cfg, ppo_training(cfg, total_steps=1))
    actor, ref = cluster.actor, cluster.ref
    assert kinds(actor.state.params) == kinds(actor.state.opt_state) == {"pinned_host"}
    assert kinds(ref.params) == {"pinned_host"}
    with cluster.on_device("actor", optimizer=True), cluster.on_device("ref"):
        assert kinds(actor.state.params) == kinds(actor.state.opt_state) == {"device"}
        assert kinds(ref.params) == {"device"}
    assert kinds(actor.state.params) == kinds(actor.state.opt_state) == {"pinned_host"}
    with cluster.on_device("actor"):  # a pass: the parameters only
        assert kinds(actor.state.opt_state) == {"pinned_host"}
    cluster.sync_weights()
    assert kinds(cluster.rollout.params) == {"device"}
    assert kinds(actor.state.params) == {"pinned_host"}
    assert cluster.resident("ref") == {} and set(cluster.resident("actor")) == {"step"}


@pytest.mark.entry
def test_offloaded_training_equals_training_on_device(assets, tmp_path):
    """3 steps on the devices against 2 offloaded steps, a checkpoint of the offloaded state,
    and an offloaded resume to step 3: every metric equal (parameter fingerprints too: moving
    memory changes no bit)."""
    common = ["trainer.save_freq=1"]
    plain = tmp_path / "plain"
    fit(config(assets, plain, *common, "trainer.total_training_steps=3"))
    offloaded = tmp_path / "offloaded"
    for steps in (2, 3):
        fit(config(assets, offloaded, *common, *OFFLOAD, f"trainer.total_training_steps={steps}"))
    assert_same_metrics(read_metrics(plain), read_metrics(offloaded), steps=[1, 2, 3])


def test_memory_plan_counts_offloaded_state_where_it_is_used(assets, tmp_path):
    """From the compiled programs (nothing loaded): offloaded state leaves the resident
    total and is added back to exactly the programs whose phase brings it to the devices."""
    on_device = build_run(config(assets, tmp_path), abstract=True).trainer
    trainer = build_run(config(assets, tmp_path, *OFFLOAD), abstract=True).trainer
    plain, off = on_device.memory_plan(), trainer.memory_plan()
    cluster = trainer.cluster
    actor, critic = cluster.actor.state, cluster.critic.state
    params, opt = bytes_per_device(actor.params), bytes_per_device(actor.opt_state)
    critic_params = bytes_per_device(critic.params)
    critic_opt = bytes_per_device(critic.opt_state)
    ref = bytes_per_device(cluster.ref.params)
    assert off.resident == {
        "actor": bytes_per_device(actor.step),
        "critic": bytes_per_device(critic.step),
        "ref": 0,
    }
    assert off.host == {"actor": params + opt, "critic": critic_params + critic_opt, "ref": ref}
    assert sum(plain.resident.values()) - sum(off.resident.values()) == sum(off.host.values())
    expected = {
        "generate": 0,
        "actor log-probs": params,
        "ref log-probs": ref,
        "critic values": critic_params,
        "actor micro-batch": params + opt,
        "actor optimizer": params + opt,
        "critic micro-batch": critic_params + critic_opt,
        "critic optimizer": critic_params + critic_opt,
        "weight sync": params,  # the actor's parameters, copied from to the rollout
    }
    for name, more in expected.items():
        assert off.adds[name] == plain.adds[name] + more, name
    assert off.peak < plain.peak
