"""LoRA RL on the quickstart task: only the adapters train (gradients, optimizer state), the
reference is the base without a copy of its own, the rollout keeps the base and takes only the
adapters after the first sync, resume is exact, `fsdp=4, tp=2` equals one device, and the
export is a PEFT folder that peft loads with jaxrl's logits (or `--merge`d HF weights)."""

import logging

import jax
import numpy as np
import pytest
import torch
import transformers
from _quickstart import assert_same_metrics, asset_paths, quickstart_config
from starlette.testclient import TestClient

import jaxrl.models as M
from jaxrl import serve
from jaxrl.config import load_config
from jaxrl.export import export
from jaxrl.models import lora
from jaxrl.models.peft_io import load_adapter
from jaxrl.testing import import_reference
from jaxrl.testing.numerics import STABLE_ADAM_OVERRIDES
from jaxrl.trainer.fit import build_run, fit
from jaxrl.trainer.loggers import read_metrics
from jaxrl.trainer.roles import LoraOptions, RoleSpec, load_role


@pytest.fixture(scope="module")
def peft():
    """The reference: PEFT (a test dependency; skips, or fails under
    JAXRL_REQUIRE_REFERENCE=1, where it is missing)."""
    return import_reference("peft")


MODEL = "actor_rollout_ref.model"
SHARDED = ["mesh.dp=1", "mesh.fsdp=4", "mesh.tp=2", "mesh.sp=1"]
ONE = ["mesh.dp=1", "mesh.fsdp=1", "mesh.tp=1", "mesh.sp=1"]
LORA = [
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "actor_rollout_ref.model.target_modules=[q_proj,v_proj,o_proj,gate_proj,down_proj]",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.optim.lr=2e-2",
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "trainer.logger=[]",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
]


def config(root, run_dir, *extra, mesh=SHARDED):
    if mesh is ONE:  # the first device alone
        overrides = [*asset_paths(root, run_dir), *LORA, *ONE, *extra]
        return load_config("configs/quickstart.yaml", overrides, num_devices=1)
    tp = "actor_rollout_ref.rollout.tensor_model_parallel_size=2"
    return quickstart_config(root, run_dir, *LORA, *mesh, tp, *extra)


def _bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_lora_cluster(assets, tmp_path):
    """One base copy serves actor and reference; gradients and optimizer moments exist for
    the adapters alone; a step changes the adapters (and a LoRA critic's adapters and value
    head) and leaves the base bit for bit; the rollout keeps its base copy across syncs."""
    critic_lora = ["algorithm.adv_estimator=gae", "critic.model.lora_rank=2"]
    run = build_run(config(assets, tmp_path, *critic_lora))
    cluster = run.trainer.cluster
    actor, ref, critic = cluster.actor, cluster.ref, cluster.critic
    # the critic trains its adapters and its fresh value head, its base frozen
    assert set(critic.state.params) == {"layers", "score"} and "score" not in critic.base
    critic_before = jax.tree.map(np.asarray, critic.state.params)
    assert actor.config.lora.targets == ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")
    assert set(actor.state.params) == {"layers"} and not lora.has_adapters(actor.base)
    # the reference is the actor's base: the same arrays, and the same function as the
    # checkpoint loaded on its own
    assert all(
        a is b
        for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(actor.base), strict=True)
    )
    embed_shape = actor.base["embed"]["tokens_vd"].shape
    live = [x for x in jax.live_arrays() if x.shape == embed_shape]
    # two models on the devices: the actor's base (= the reference) and the critic's
    assert len(live) == 2, "the reference holds no copy of its own"
    assert any(x is critic.base["embed"]["tokens_vd"] for x in live)
    config_, separate = M.from_pretrained(assets / "model")
    ids = np.array([[5, 6, 7, 8, 9, 10, 11, 12]])
    # the same model's forward on the same devices (the base as a shared reference): its
    # logits are O(1), one float32 program apart from the other's
    np.testing.assert_allclose(
        M.forward(ref.config, ref.params, ids), M.forward(config_, separate, ids), atol=1e-5
    )
    # optimizer state: adapter-shaped moments only (AdamW: two per adapter array)
    opt_bytes = _bytes(actor.state.opt_state)
    adapters_bytes = _bytes(actor.state.params)
    assert 2 * adapters_bytes <= opt_bytes < 2 * adapters_bytes + 1024
    assert opt_bytes < _bytes(actor.base) / 4
    base_before = jax.tree.map(np.asarray, actor.base)
    adapters_before = jax.tree.map(np.asarray, actor.state.params)
    cluster.sync_weights()
    rollout_base = jax.tree.leaves(cluster.rollout.weights.base)
    run.trainer.step(next(iter(run.train_loader)), 1)
    jax.tree.map(np.testing.assert_array_equal, base_before, jax.tree.map(np.asarray, actor.base))
    changed = jax.tree.map(
        lambda a, b: not np.array_equal(a, np.asarray(b)), adapters_before, actor.state.params
    )
    assert all(jax.tree.leaves(changed)), "every adapter array trained"
    changed = jax.tree.map(
        lambda a, b: not np.array_equal(a, np.asarray(b)), critic_before, critic.state.params
    )
    assert all(jax.tree.leaves(changed)), "the critic's adapters and head trained"
    cluster.sync_weights()
    assert all(
        a is b
        for a, b in zip(rollout_base, jax.tree.leaves(cluster.rollout.weights.base), strict=True)
    )


@pytest.mark.entry
def test_lora_resume_sharding_and_export(peft, assets, tmp_path, caplog):
    """fsdp=4, tp=2: two steps straight equal one step + checkpoint + resume (other LoRA
    settings are refused); one device, with the actor (base and reference) offloaded, gives
    the same step metrics; the PEFT export loads in peft with jaxrl's logits, `--merge` in
    transformers, and as a new run's `lora_adapter_path` gives back the same adapters."""
    # Adam at STABLE_ADAM_EPS: step 1's rounding on one device cannot move step 2 by ~lr
    saving = ["trainer.save_freq=1", *STABLE_ADAM_OVERRIDES]
    common = [*saving, "trainer.total_training_steps=2"]
    fit(config(assets, tmp_path / "straight", *common))
    stopped = tmp_path / "stopped"
    fit(config(assets, stopped, *saving, "trainer.total_training_steps=1"))
    fit(config(assets, stopped, *common))
    straight = read_metrics(tmp_path / "straight")
    assert_same_metrics(straight, read_metrics(stopped), [1, 2])
    with pytest.raises(ValueError, match=r"trained with LoRA .*'alpha': 8\.0.*lora_alpha"):
        fit(
            config(
                assets,
                stopped,
                *saving,
                "trainer.total_training_steps=3",
                f"{MODEL}.lora_alpha=4",
            )
        )
    # one device, the actor's parameters (and with them the base = the reference) offloaded
    offload = "actor_rollout_ref.actor.param_offload=true"
    fit(config(assets, tmp_path / "one", *common, offload, mesh=ONE), devices=jax.devices()[:1])
    for a, b in zip(straight, read_metrics(tmp_path / "one"), strict=True):
        assert a["response_length/mean"] == b["response_length/mean"]
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
            # 8 devices against 1 (offloaded): reduction order, DESIGN §6's composite 1e-4
            np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert straight[1]["actor/kl_loss"] > 0  # the adapters moved the policy off the base

    adapter = export(stopped, tmp_path / "adapter")
    merged = export(stopped, tmp_path / "merged", merge=True)
    assert {p.name for p in adapter.iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    ids = np.array([[5, 6, 7, 8, 9, 10, 11, 12]])
    base = M.from_pretrained(assets / "model")[1]
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(str(assets / "model"))
    model = peft.PeftModel.from_pretrained(hf_base, str(adapter)).eval()
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    spec, adapters = load_adapter(adapter, M.load_config(assets / "model"))
    config_ = M.load_config(assets / "model").replace(lora=spec)
    ours = np.asarray(M.forward(config_, lora.merge(base, adapters), ids))
    # PEFT's forward against jaxrl's: DESIGN §6's composite tolerance, of the logits' scale
    np.testing.assert_allclose(ours, ref, atol=1e-4 * np.abs(ref).max())
    assert np.abs(ref - np.asarray(M.forward(config_, base, ids))).max() > 1e-4
    # the exported folder as a new run's start (verl's lora_adapter_path): the same adapters
    with caplog.at_level(logging.WARNING, "jaxrl.train"):  # the folder's rank 4 rules, not 8
        over = (f"{MODEL}.lora_adapter_path={adapter}", f"{MODEL}.lora_rank=8")
        start = build_run(config(assets, tmp_path / "from_adapter", *over))
    assert "the adapter's rank 4 and alpha 8 are used, not lora_rank=8" in caplog.text

    restarted = jax.tree.map(np.asarray, start.trainer.cluster.actor.state.params)
    jax.tree.map(np.testing.assert_array_equal, restarted, adapters)
    hf_merged = transformers.AutoModelForCausalLM.from_pretrained(str(merged)).eval()
    with torch.no_grad():
        # transformers' forward against jaxrl's: DESIGN §6's composite tolerance (logits O(1))
        np.testing.assert_allclose(hf_merged(torch.tensor(ids)).logits.numpy(), ours, atol=1e-4)
    # the checkpoint served (`python -m jaxrl.serve --checkpoint`): the adapted policy's
    # next token and its log-prob, greedy, after the same ids
    served = serve.load(checkpoint=stopped, max_num_seqs=2, max_model_len=32)
    try:
        assert served.model == "stopped-step2"
        body = {"model": served.model, "prompt": ids[0].tolist(), "max_tokens": 1,
                "temperature": 0, "logprobs": 1}  # fmt: skip
        with TestClient(serve.make_app(served)) as client:
            (choice,) = client.post("/v1/completions", json=body).json()["choices"]
    finally:
        served.engine.close()
    want = jax.nn.log_softmax(ours[0, -1])
    token = served.tokenizer.decode([int(np.argmax(want))])
    assert choice["logprobs"]["tokens"] == [token]
    # the engine's program against the forward's: DESIGN §6's composite tolerance
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][0], want.max(), atol=1e-4)


def test_lora_on_a_family_jaxrl_cannot_load(tmp_path):
    """LoRA asked of a model family jaxrl does not implement: the loader refuses it, naming
    the model type and the supported families."""
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2, "n_embd": 8}')
    spec = RoleSpec(
        "actor", str(tmp_path), "float32", "float32", trainable=True,
        lora=LoraOptions("actor_rollout_ref.model", 8, 16.0),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"model type 'gpt2' is not supported.*llama"):
        load_role(spec, None)
