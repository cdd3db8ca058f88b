"""A mixture-of-experts actor (a tiny Qwen3-MoE on the quickstart's tokenizer) through the RL
loop on 8 fake devices. Its experts split over `mesh.ep=2` with a capacity, routing replay R2
(the old-log-prob pass records, the two mini-batches' updates replay): GRPO with the
reference's KL loss and the router losses trains two steps, logs the router metrics (the
dropped pairs among them), moves the router, and exports a checkpoint transformers reads with
the same logits. With R3 the rollout records its routes and every pass replays them: the
old-log-prob pass gives the rollout's probabilities."""

import shutil

import jax
import numpy as np
import pytest
from _quickstart import quickstart_config

from jaxrl.trainer.fit import fit
from jaxrl.trainer.loggers import read_metrics

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

E, K = 8, 2


@pytest.fixture(scope="module")
def moe_model(assets, tmp_path_factory):
    """The quickstart model's tokenizer with a random tiny Qwen3-MoE of its vocabulary."""
    folder = tmp_path_factory.mktemp("moe_model")
    dense = transformers.AutoConfig.from_pretrained(str(assets / "model"))
    config = transformers.Qwen3MoeConfig(
        vocab_size=dense.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
        num_experts=E, num_experts_per_tok=K, norm_topk_prob=True, tie_word_embeddings=True,
        eos_token_id=dense.eos_token_id, pad_token_id=dense.pad_token_id,
        max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for f in (assets / "model").iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, folder / f.name)
    return folder


def _fed(batch):
    """[N, R]: the response tokens fed to the model as the rollout sampled (all but each
    response's last)."""
    mask = batch["response_mask"] > 0
    return mask & (np.cumsum(mask, -1) < mask.sum(-1, keepdims=True))


def test_an_moe_actor_trains_with_its_router_losses_and_exports(
    assets, moe_model, tmp_path, step_batches
):
    import jaxrl.models as M
    from jaxrl.export import export

    fit(quickstart_config(
        assets, tmp_path / "run", f"actor_rollout_ref.model.path={moe_model}",
        "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "mesh.dp=1", "mesh.fsdp=2", "mesh.ep=2", "mesh.tp=2",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.model.moe_capacity_factor=1.0",
        "actor_rollout_ref.actor.router_replay.mode=R2",
        "actor_rollout_ref.actor.moe_aux_loss_coeff=0.01",
        "actor_rollout_ref.actor.moe_z_loss_coeff=0.001", "trainer.logger=[]",
        "trainer.test_freq=-1", "trainer.total_training_steps=2", "trainer.save_freq=2",
    ))  # fmt: skip
    rows = read_metrics(tmp_path / "run")
    assert [r["training/global_step"] for r in rows][-2:] == [1, 2]
    # R2: the old-log-prob pass recorded a route for every real token, the last included
    batch = step_batches[-1]
    routes = batch["response_routed_experts"]
    assert routes.shape[2:] == (2, K) and routes.min() >= 0 and routes.max() < E
    for row in rows[-2:]:
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/z_loss"):
            assert np.isfinite(row[key]), (key, row[key])
        # HF's loss is k for perfectly balanced experts and at most E (one expert for all)
        assert 0 < row["actor/load_balancing_loss"] <= E, row["actor/load_balancing_loss"]
        assert 1 <= row["actor/moe_expert_load_imbalance"] <= E / K
        assert 0 <= row["actor/moe_dropped_token_fraction"] < 1
    out = export(tmp_path / "run", tmp_path / "hf")
    initial = transformers.AutoModelForCausalLM.from_pretrained(str(moe_model))
    trained = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    router = "model.layers.0.mlp.gate.weight"
    before, after = initial.state_dict()[router], trained.state_dict()[router]
    assert not torch.equal(before, after)  # the router is trained (aux, z and policy losses)
    ids = np.array([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        want = trained(torch.tensor(ids)).logits.numpy()
    config, params = M.from_pretrained(out)
    assert config.moe is not None and config.moe.num_experts == E
    # float32 in two libraries (DESIGN §6's composite tolerance)
    np.testing.assert_allclose(np.asarray(M.forward(config, params, ids)), want, atol=1e-4)
    assert jax.device_count() == 8


def test_r3_replays_the_rollouts_routes_in_every_pass(assets, moe_model, tmp_path, step_batches):
    fit(quickstart_config(
        assets, tmp_path / "run", f"actor_rollout_ref.model.path={moe_model}",
        "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
        "actor_rollout_ref.actor.megatron.router_replay.mode=R3",  # verl's key
        "actor_rollout_ref.ref.router_replay.mode=R3", "trainer.logger=[]",
        "trainer.test_freq=-1", "trainer.total_training_steps=2",
    ))  # fmt: skip
    rows = read_metrics(tmp_path / "run")
    for row in rows[-2:]:
        assert row["training/rollout_probs_diff_valid"] == 1
        # the same float32 model replaying the rollout's routes: the rollout's log-probs up
        # to the two programs' rounding (LOG_PROB_ATOL's 2e-5, as probabilities <= 1)
        assert row["training/rollout_probs_diff_max"] < 2e-5, row
        assert row["training/rollout_actor_probs_pearson_corr"] > 0.999
        assert np.isfinite(row["actor/kl_loss"]) and np.isfinite(row["actor/pg_loss"])
    # the rollout's routes: every fed token's, none for each response's last (-1: native)
    batch = step_batches[-1]
    routes, fed = batch["response_routed_experts"], _fed(batch)
    assert (routes[fed] >= 0).all() and (routes[~fed] == -1).all()
    prompt_routes = batch["prompt_routed_experts"]
    assert ((prompt_routes >= 0).all(-1).all(-1) == (batch["prompt_mask"] > 0)).all()
