"""The RL loop end to end on 8 fake devices: every role and option runs two steps; resume is
exact; a killed save leaves the previous checkpoint; the update does not depend on the
micro-batch split; the exported actor loads in transformers with the trained weights."""

import json
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from _env import subprocess_env
from _hf import hf_response_logits
from _quickstart import asset_paths

from jaxrl.compare import VOLATILE
from jaxrl.config import load_config
from jaxrl.data import load_tokenizer
from jaxrl.plot import plot_run
from jaxrl.rollout import RolloutEngine
from jaxrl.sharding.processes import to_host
from jaxrl.testing.reference import import_reference
from jaxrl.trainer.fit import fit
from jaxrl.trainer.loggers import read_metrics
from jaxrl.trainer.ppo_trainer import PPOTrainer

MESH_2221 = ["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2", "mesh.sp=1"]


def base_overrides(assets_dir, run_dir) -> list[str]:
    return [
        *asset_paths(assets_dir, run_dir),
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "trainer.logger=[]",
        "trainer.test_freq=2",
        "trainer.total_training_steps=2",
    ]


def config(assets_dir, run_dir, *extra, mesh=MESH_2221):
    return load_config(
        "configs/quickstart.yaml",
        [*base_overrides(assets_dir, run_dir), *mesh, *extra],
        num_devices=jax.device_count(),
    )


VERL_KEYS = (
    "critic/score/mean",
    "critic/advantages/mean",
    "response_length/mean",
    "prompt_length/mean",
    "actor/pg_loss",
    "actor/entropy",
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "actor/grad_norm",
    "actor/lr",
    "timing_s/gen",
    "timing_s/step",
    "timing_s/update_actor",
    "timing_per_token_ms/gen",
    "perf/throughput",
    "training/global_step",
)


@pytest.fixture(scope="module")
def grpo_run(assets, tmp_path_factory):
    """Two GRPO steps with validation, TensorBoard and a checkpoint at step 2: the run that
    `test_two_steps[grpo]`, the export and the fresh-run refusal read."""
    run = tmp_path_factory.mktemp("grpo")
    fit(config(assets, run, "trainer.logger=[console,tensorboard]", "trainer.save_freq=2"))
    return run


@pytest.mark.entry
@pytest.mark.parametrize(
    "name, extra, expect",
    [
        ("grpo", None, ()),  # the `grpo_run` fixture's run
        (
            "ppo_critic",
            ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=1"],
            ("critic/vf_loss", "critic/values/mean", "critic/vf_explained_var"),
        ),
        (
            "kl_loss_ref",
            ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.ppo_epochs=2"],
            ("actor/kl_loss", "timing_s/ref", "timing_s/old_log_prob"),
        ),
        (
            "kl_in_reward_adaptive",
            ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive"],
            ("actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"),
        ),
        (
            "bypass_rollout_correction",
            [
                "algorithm.rollout_correction.bypass_mode=true",
                "algorithm.rollout_correction.rollout_is=token",
                "actor_rollout_ref.actor.ppo_mini_batch_size=8",  # one mini-batch: still bypass
            ],
            ("actor/rollout_corr/kl", "actor/rollout_corr/rollout_is_mean"),
        ),
        (
            "dynamic_bsz",
            [
                "actor_rollout_ref.actor.use_dynamic_bsz=true",
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            ],
            ("timing_s/old_log_prob",),
        ),
    ],
)
def test_two_steps(assets, tmp_path, request, name, extra, expect):
    if extra is None:
        tmp_path = request.getfixturevalue("grpo_run")
    else:
        fit(config(assets, tmp_path, *extra))
    rows = read_metrics(tmp_path)
    assert [r["training/global_step"] for r in rows] == [0, 1, 2]
    assert any(k.startswith("val-core/jaxrl/synthetic_repeat/") for k in rows[0])
    for key in (*VERL_KEYS, *expect):
        assert key in rows[2], f"{name}: {key} missing"
        assert np.isfinite(rows[2][key]), f"{name}: {key} = {rows[2][key]}"
    assert rows[2]["actor/skipped_steps"] == 0
    elapsed = [r["timing_s/elapsed"] for r in rows]  # the loop's wall clock, validations in
    assert 0 < rows[0]["timing_s/testing"] <= elapsed[0] < elapsed[1] < elapsed[2], elapsed
    assert "timing_s/testing" in rows[2] and "timing_s/testing" not in rows[1]
    assert plot_run(tmp_path).stat().st_size > 1000  # the CLI's last act
    if name == "grpo":
        assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.entry
def test_resume_equals_uninterrupted_run(assets, tmp_path):
    """4 steps straight, against 2 steps + a checkpoint + a new process resuming to 4. The
    straight run builds no XLA program after step 2 (responses of at most 8 tokens fall in one
    length bucket, so the shapes repeat): `perf/compiles` is 0 at steps 3 and 4, and counts
    the programs step 1 compiled."""
    common = ["trainer.save_freq=2", "trainer.test_freq=-1", "trainer.val_before_train=false"]
    mesh = ["mesh.fsdp=4", "mesh.dp=2", "mesh.tp=1"]
    straight = tmp_path / "straight"
    fit(config(assets, straight, *common, "trainer.total_training_steps=4", mesh=mesh))
    stopped = tmp_path / "stopped"
    fit(config(assets, stopped, *common, "trainer.total_training_steps=2", mesh=mesh))
    fit(config(assets, stopped, *common, "trainer.total_training_steps=4", mesh=mesh))
    a, b = read_metrics(straight), read_metrics(stopped)
    assert [r["training/global_step"] for r in b] == [1, 2, 3, 4]
    compiles = [r["perf/compiles"] for r in a]
    assert compiles[0] > 0 and compiles[2:] == [0, 0], compiles
    for ra, rb in zip(a, b, strict=True):
        for key, value in ra.items():
            if key.startswith(VOLATILE):
                continue
            assert rb[key] == value, (ra["training/global_step"], key, value, rb[key])


@pytest.mark.entry
def test_sequence_parallel_ring_equals_one_sequence_shard(assets, tmp_path):
    """mesh.sp=2 trains with ring attention (zigzag layout); the step's metrics equal those of
    the same devices without sequence parallelism (same rollouts; one step, so the losses
    and the gradient norm differ by float32 reduction order only: the attention's sums in
    another blocking, ~1e-6 relative, checked at 1e-4 = DESIGN §6's composite tolerance)."""
    common = ["trainer.test_freq=-1", "trainer.val_before_train=false"]
    common += ["trainer.total_training_steps=1", "actor_rollout_ref.actor.use_kl_loss=true"]
    sp1, sp2 = tmp_path / "sp1", tmp_path / "sp2"
    fit(config(assets, sp1, *common, mesh=["mesh.dp=2", "mesh.fsdp=4", "mesh.tp=1", "mesh.sp=1"]))
    fit(config(assets, sp2, *common, mesh=["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=1", "mesh.sp=2"]))
    (a,), (b,) = read_metrics(sp1), read_metrics(sp2)
    assert a["response_length/mean"] == b["response_length/mean"]
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
        np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.entry
def test_killed_save_leaves_previous_checkpoint(tmp_path):
    """A process killed while writing step 2 leaves step 1 as the newest, restorable."""
    script = textwrap.dedent(
        f"""
        import os, jax.numpy as jnp
        from jaxrl.checkpoint import Checkpoints
        c = Checkpoints({str(tmp_path)!r})
        c.save(1, {{"item": {{"x": jnp.arange(4.0)}}}}, {{"global_step": 1}})
        c.wait()
        c.save(2, {{"item": {{"x": jnp.ones((4096, 4096))}}}}, {{"global_step": 2}})
        os._exit(0)  # killed mid-save: no wait, no close
        """
    )
    env = subprocess_env()
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    from jaxrl.checkpoint import Checkpoints, abstract

    c = Checkpoints(tmp_path)
    assert c.latest_step() == 1
    state, meta = c.restore(1, {"item": abstract({"x": jax.numpy.zeros(4)})})
    np.testing.assert_array_equal(state["item"]["x"], np.arange(4.0))
    assert meta["global_step"] == 1
    c.close()


@pytest.mark.entry
def test_fresh_run_refuses_existing_checkpoints(assets, grpo_run):
    with pytest.raises(FileExistsError, match="resume_mode=auto"):
        fit(config(assets, grpo_run, "trainer.resume_mode=disable"))


@pytest.mark.entry
def test_export_loads_in_transformers_with_trained_weights(assets, grpo_run, tmp_path):
    import torch
    import transformers

    import jaxrl.models as M
    from jaxrl.export import export

    out = export(grpo_run, tmp_path / "hf")
    initial = transformers.AutoModelForCausalLM.from_pretrained(str(assets / "model"))
    trained = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    changed = [
        not torch.equal(p, q)
        for p, q in zip(initial.parameters(), trained.parameters(), strict=True)
    ]
    assert any(changed)  # the weights are the trained ones, not the initial checkpoint
    ids = np.array([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        ref = trained(torch.tensor(ids)).logits.numpy()
    config_, params = M.from_pretrained(out)
    # jaxrl's forward against transformers' (the quickstart model's logits are O(1)):
    # DESIGN §6's composite tolerance
    np.testing.assert_allclose(M.forward(config_, params, ids), ref, atol=1e-4)
    assert (out / "tokenizer.json").is_file()
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    # transformers loads the tokenizer of training (AutoTokenizer), and generates with it
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    trained_tokenizer = load_tokenizer(str(assets / "model"))
    for text in ("repeat: 7", "copy: 1 2 3", "<|im_start|>user\nreverse: 4 5<|im_end|>"):
        assert tokenizer.encode(text) == trained_tokenizer.encode(text), text
    prompt = tokenizer("repeat: 7", return_tensors="pt")
    generated = trained.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]


@pytest.mark.entry
def test_pf_ppo_trains_on_rows_drawn_by_score(assets, tmp_path):
    """PF-PPO (GAE): step 1 generates the same rows with and without it (same seed and
    weights); with `pow` weights a zero-score row (weight 1e-8) is never drawn, so the rows
    trained on (the dump of the resampled batch) all score above 0, where the plain run's
    batch has some at 0."""
    common = ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=1",
              "trainer.test_freq=-1", "trainer.val_before_train=false",
              "trainer.total_training_steps=1"]  # fmt: skip
    scores = {}
    for name, extra in (("plain", []), ("pf", ["algorithm.use_pf_ppo=true"])):
        dump = tmp_path / f"dump_{name}"
        fit(config(assets, tmp_path / name, *common, *extra, f"trainer.rollout_data_dir={dump}"))
        rows = [json.loads(line) for line in (dump / "1.jsonl").read_text().splitlines()]
        scores[name] = np.array([r["score"] for r in rows])
    assert len(scores["pf"]) == len(scores["plain"]) == 16
    assert (scores["plain"] == 0).any() and (scores["plain"] > 0).any()  # the premise
    assert (scores["pf"] > 0).all()
    assert set(scores["pf"]) <= set(scores["plain"])  # the same rows, drawn again


@pytest.mark.entry
@pytest.mark.parametrize(
    ("estimator", "verl_name"),
    [("optimal_token_baseline", "compute_optimal_token_baseline_advantage"),
     ("tir_optimal_token_baseline", "compute_multi_turn_optimal_token_baseline_advantage")],
)  # fmt: skip
def test_optimal_token_baseline_through_the_trainer(assets, tmp_path, monkeypatch, estimator,
                                                    verl_name):  # fmt: skip
    """A step with an optimal-token-baseline estimator: the old-log-prob pass's sum_v pi_v^2
    (logits / rollout temperature, chunked, on the 8-device mesh) equals verl's
    `calculate_sum_pi_squared_from_logits` on the HF torch model's logits of the same rows,
    and the step's advantages equal verl's estimator on the step's batch."""
    torch = pytest.importorskip("torch")
    verl = import_reference()
    torch_functional = import_reference("verl.utils.torch_functional")
    pytest.importorskip("transformers")
    captured = []
    advantages = PPOTrainer._advantages

    def spy(self, batch, extra):
        out = advantages(self, batch, extra)
        captured.append((self.temperature, to_host(out[0].present())))
        return out

    monkeypatch.setattr(PPOTrainer, "_advantages", spy)
    fit(config(assets, tmp_path, f"algorithm.adv_estimator={estimator}",
               "actor_rollout_ref.actor.calculate_sum_pi_squared=true",
               "actor_rollout_ref.actor.entropy_from_logits_with_chunking=true",
               "actor_rollout_ref.actor.entropy_from_logits_chunk_size=3",
               "trainer.test_freq=-1", "trainer.val_before_train=false",
               "trainer.total_training_steps=1"))  # fmt: skip
    ((temperature, host),) = captured
    mask = host["loss_mask"].astype(np.float32)

    z = torch.tensor(hf_response_logits(assets / "model", host)) / temperature
    want = torch_functional.calculate_sum_pi_squared_from_logits(z).numpy()
    # sum_v pi_v^2 in (0, 1] from jaxrl's forward against torch's: composite (DESIGN §6)
    np.testing.assert_allclose(host["sum_pi_squared"] * mask, want * mask, rtol=1e-4, atol=1e-5)

    ref_adv, _ = getattr(verl, verl_name)(
        token_level_rewards=torch.tensor(host["token_level_rewards"]),
        response_mask=torch.tensor(mask),
        index=np.array([f"uid{g}" for g in host["group_ids"]], dtype=object),
        old_log_probs=torch.tensor(host["old_log_probs"]),
        sum_pi_squared=torch.tensor(host["sum_pi_squared"]),
    )
    # verl's estimator on the same float32 inputs in torch: elementwise ops and group sums,
    # ~1e-7 relative on O(1) advantages (1e-5 absolute for those near 0)
    np.testing.assert_allclose(host["advantages"], ref_adv.numpy(), rtol=1e-5, atol=1e-5)
    assert np.abs(host["advantages"]).max() > 0


@pytest.mark.entry
@pytest.mark.parametrize("streaming", [False, True], ids=["batches", "streaming"])
def test_dynamic_sampling_trains_on_disagreeing_groups_and_resumes(
    assets, tmp_path, streaming, monkeypatch
):
    """DAPO dynamic sampling (generation batches of 4 prompts for a step of 8), whole batches
    or streamed through the engine's slots: every trained group's two responses score
    differently, each step took at least two generation batches, and 3 steps straight equal
    1 step + checkpoint + resume to 3 (the extra batches come from the loader, whose saved
    state covers them). The weights reach the rollout once per step, whatever the number
    of generation batches, and once for a validation of 4 batches."""
    common = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward",
              "data.gen_batch_size=4", "trainer.test_freq=3", "trainer.val_before_train=false",
              "data.val_batch_size=2", "trainer.save_freq=1",
              f"algorithm.filter_groups.streaming={streaming}"]  # fmt: skip
    mesh = ["mesh.fsdp=4", "mesh.dp=2", "mesh.tp=1"]
    dump = tmp_path / "dump"
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    loads, load_weights = [], RolloutEngine.load_weights

    def counted(engine, *args, **kwargs):
        loads.append(kwargs.get("version"))
        return load_weights(engine, *args, **kwargs)

    monkeypatch.setattr(RolloutEngine, "load_weights", counted)
    fit(config(assets, straight, *common, "trainer.total_training_steps=3",
               f"trainer.rollout_data_dir={dump}", mesh=mesh))  # fmt: skip
    # three steps, then the validation after the third (8 prompts: 4 batches), each a new
    # version (optimizer steps taken: 2 mini-batches a step)
    assert loads == [0, 2, 4, 6], loads
    fit(config(assets, stopped, *common, "trainer.total_training_steps=1", mesh=mesh))
    fit(config(assets, stopped, *common, "trainer.total_training_steps=3", mesh=mesh))
    # step 1 and the validation after its last step; the resumed run goes on from the save
    assert loads[4:] == [0, 2, 2, 4, 6], loads
    a, b = read_metrics(straight), read_metrics(stopped)
    for ra, rb in zip(a, b, strict=True):
        for key, value in ra.items():
            if not key.startswith(VOLATILE):
                assert rb[key] == value, (ra["training/global_step"], key, value, rb[key])
    for row in a:
        assert row["train/num_gen_batches"] >= 2  # batches of 4 prompts for 8 groups
        scores = [json.loads(x)["score"] for x in (dump / f"{row['training/global_step']}.jsonl")
                  .read_text().splitlines()]  # fmt: skip
        assert len(scores) == 16  # 8 groups of 2
        assert all(scores[i] != scores[i + 1] for i in range(0, 16, 2))
    assert sum(row["training/filter_groups/evicted_samples"] for row in a) > 0  # it filtered
    for row in a:  # tokens sampled per trained group: at least the trained ones' own
        assert row["training/filter_groups/sampled_tokens_per_group"] >= row[
            "response_length/mean"] * 2  # fmt: skip
        if streaming:  # reported (their accounting: tests/rollout/test_streaming.py)
            assert "training/filter_groups/discarded_surplus_samples" in row
            assert "training/filter_groups/aborted_groups" in row


@pytest.mark.entry
def test_decoupled_rollout_correction_equals_verls(assets, tmp_path, monkeypatch):
    """Decoupled rollout correction (no bypass) with a top-16 rollout (its log-probs are
    renormalised over 16 tokens, the trained policy's are not): the step's IS weights,
    rejection mask and `rollout_corr/*` metrics equal verl's
    `compute_rollout_correction_and_add_to_batch` on the step's old and rollout log-probs
    (the rejection bounds keep every token here: the rejection's own cases are compared with
    verl in tests/core_algos/test_policy_losses.py), and the actor trains with the weights."""
    torch = pytest.importorskip("torch")
    helper = import_reference("verl.trainer.ppo.rollout_corr_helper")
    protocol = import_reference("verl.protocol")
    captured = []
    correction = PPOTrainer._rollout_correction

    def spy(self, batch):
        out = correction(self, batch)
        captured.append((to_host(batch.present()), to_host(out[0].present())))
        return out

    monkeypatch.setattr(PPOTrainer, "_rollout_correction", spy)
    rc = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1",
          "rollout_rs_threshold": "0.6_1.7"}  # fmt: skip
    fit(config(assets, tmp_path, *(f"algorithm.rollout_correction.{k}={v}" for k, v in rc.items()),
               "actor_rollout_ref.rollout.top_k=16", "trainer.test_freq=-1",
               "trainer.val_before_train=false", "trainer.total_training_steps=1"))  # fmt: skip
    ((before, after),) = captured
    data = protocol.DataProto.from_dict(tensors={
        "old_log_probs": torch.tensor(before["old_log_probs"]),
        "rollout_log_probs": torch.tensor(before["rollout_log_probs"]),
        "response_mask": torch.tensor(before["loss_mask"].astype(np.float32)),
    })  # fmt: skip
    ref, ref_metrics = helper.compute_rollout_correction_and_add_to_batch(data, rc)
    mask = ref.batch["response_mask"].numpy()
    np.testing.assert_array_equal(after["loss_mask"], mask)
    # exp of a float32 log-ratio, in torch and in jax: ~1e-7 relative (weights <= 2)
    np.testing.assert_allclose(after["rollout_is_weights"], ref.batch["rollout_is_weights"].numpy(),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    weights = after["rollout_is_weights"][mask > 0]
    assert np.abs(weights - 1).max() > 0.05  # the premise: the two policies differ
    (row,) = read_metrics(tmp_path)
    for key, value in ref_metrics.items():
        # means over the batch of the weights' statistics, summed in another order
        np.testing.assert_allclose(row[key], float(value), rtol=1e-4, atol=1e-5, err_msg=key)
    assert np.isfinite(row["actor/pg_loss"]) and row["actor/grad_norm"] > 0
