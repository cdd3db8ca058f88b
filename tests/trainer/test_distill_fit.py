"""On-policy distillation through the trainer: a teacher of another family and size (a Qwen2
teacher for the quickstart's Llama student, sharing its tokenizer) scores the student's
rollouts on the 8-device mesh exactly as the HF torch teacher does, the distillation loss
alone trains the student toward the teacher, several teachers each score the rows routed to
them, and a teacher with another tokenizer is refused."""

import re

import numpy as np
import pandas as pd
import pytest
from _hf import hf_response_logits
from test_fit import config

from jaxrl.data import DataError, load_tokenizer
from jaxrl.data.synthetic import write_tokenizer
from jaxrl.testing.numerics import STABLE_ADAM_OVERRIDES
from jaxrl.train import preflight_problems
from jaxrl.trainer.fit import build_run, fit
from jaxrl.trainer.loggers import read_metrics
from jaxrl.trainer.ppo_trainer import PPOTrainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def write_teacher(folder, student_dir, tokenizer_dir=None, seed=1, extra_vocab=0, layers=3):
    """A random Qwen2 causal LM (hidden 96, 3 layers: not the student's Llama shape) with the
    student's vocabulary size (+ `extra_vocab` padding rows) and the tokenizer of
    `tokenizer_dir` (default the student's)."""
    student = transformers.AutoConfig.from_pretrained(student_dir)
    torch.manual_seed(seed)
    hf = transformers.Qwen2Config(
        vocab_size=student.vocab_size + extra_vocab, hidden_size=96, intermediate_size=160,
        num_hidden_layers=layers, num_attention_heads=6, num_key_value_heads=2,
        max_position_embeddings=student.max_position_embeddings, tie_word_embeddings=False,
        pad_token_id=student.pad_token_id, eos_token_id=student.eos_token_id,
        initializer_range=0.05,
    )  # fmt: skip
    transformers.Qwen2ForCausalLM(hf).save_pretrained(folder)
    load_tokenizer(str(tokenizer_dir or student_dir)).save_pretrained(folder)
    return folder


def distill(teacher, *extra):
    return ["distillation.enabled=true",
            f"distillation.teacher_models.teacher_model.model_path={teacher}",
            "distillation.teacher_models.teacher_model.inference.dtype=float32",
            "trainer.test_freq=-1", "trainer.val_before_train=false", *extra]  # fmt: skip


def torch_log_probs(folder, host) -> np.ndarray:
    """The HF torch model's log-probs of the batch's response tokens [N, R]."""
    z = torch.log_softmax(torch.tensor(hf_response_logits(folder, host)), dim=-1)
    return torch.gather(z, -1, torch.tensor(host["responses"])[..., None])[..., 0].numpy()


@pytest.mark.entry
def test_teacher_scores_as_torch_and_distillation_trains_the_student(
    assets, tmp_path, step_batches
):
    """Distillation alone (`use_task_rewards=false`, k3 backpropagated): step 1's teacher
    log-probs equal the HF torch teacher's on the same rows, the step logs verl's
    distillation metrics, and over 16 steps the student's k3 distance to the teacher falls by
    more than 40% (last 4 steps against the first 4)."""
    teacher = write_teacher(tmp_path / "teacher", assets / "model")
    run = tmp_path / "run"
    fit(config(assets, run, *distill(teacher, "trainer.total_training_steps=16",
               "distillation.distillation_loss.use_task_rewards=false",
               "actor_rollout_ref.actor.optim.lr=1e-2")))  # fmt: skip
    host = step_batches[0]
    mask = host["response_mask"].astype(np.float32)
    want = torch_log_probs(teacher, host)
    # jaxrl's forward against torch's (float32 composite ops, DESIGN §6: 1e-4) on log-probs
    # of scale O(1)-O(10)
    np.testing.assert_allclose(host["teacher_log_probs"] * mask, want * mask, rtol=1e-4, atol=1e-4)

    rows = read_metrics(run)
    for key in ("distillation/loss", "distillation/abs_loss", "distillation/loss_min",
                "distillation/loss_max", "timing_s/teacher"):  # fmt: skip
        assert all(np.isfinite(row[key]) for row in rows), key
    assert rows[0]["distillation/loss_min"] <= rows[0]["distillation/loss_max"]
    losses = [row["distillation/loss"] for row in rows]
    assert np.mean(losses[-4:]) < 0.6 * np.mean(losses[:4]), losses


@pytest.mark.entry
def test_policy_gradient_distillation_with_task_rewards_runs(assets, tmp_path):
    """k1 as a per-token reward beside the task's PPO loss: the PPO and the distillation
    metrics (verl's renamed `distillation/pg_*`) are both logged."""
    teacher = write_teacher(tmp_path / "teacher", assets / "model")
    run = tmp_path / "run"
    fit(config(assets, run, *distill(teacher, "trainer.total_training_steps=1",
               "distillation.distillation_loss.loss_mode=k1",
               "distillation.distillation_loss.use_policy_gradient=true",
               "distillation.distillation_loss.loss_max_clamp=10")))  # fmt: skip
    (row,) = read_metrics(run)
    for key in ("actor/pg_loss", "distillation/loss", "distillation/pg_clipfrac",
                "distillation/ppo_kl", "distillation/pg_clipfrac_lower"):  # fmt: skip
        assert np.isfinite(row[key]), key


def test_teacher_with_another_tokenizer_is_refused(assets, tmp_path):
    other = tmp_path / "other_tokenizer"
    write_tokenizer(other, tools=True)
    teacher = write_teacher(tmp_path / "teacher", assets / "model", tokenizer_dir=other)
    with pytest.raises(ValueError, match="tokenizer differs from the student's"):
        PPOTrainer.create(
            config(assets, tmp_path / "run", *distill(teacher)),
            lambda *a, **k: None,
            total_steps=1,
            tokenizer=load_tokenizer(str(assets / "model")),
        )


@pytest.mark.entry
def test_teacher_on_devices_of_its_own_equals_colocated(assets, tmp_path, monkeypatch):
    """The teacher on 4 devices of its own (verl's teacher pool: `distillation.nnodes` x
    `n_gpus_per_node`) beside training on the other 4, against colocated on all 8: the same
    rollouts, and the distillation and policy losses to float32 reduction order (sums over 8
    or 4 batch shards: measured <= 5e-6 relative, 5e-5 leaves 10x; 1e-6 absolute for values
    near 0). Adam at `STABLE_ADAM_EPS`, so step 1's rounding cannot move step 2 by ~lr."""
    teacher = write_teacher(tmp_path / "teacher", assets / "model")
    mesh = ["mesh.dp=1", "mesh.fsdp=-1", "mesh.tp=1", "mesh.sp=1"]
    groups = []
    step = PPOTrainer.step

    def spy(self, prompts, global_step):
        layout = self.cluster.teachers["teacher"].layout
        groups.append((self.cluster.device_group("teacher"), layout.mesh.devices.size))
        return step(self, prompts, global_step)

    monkeypatch.setattr(PPOTrainer, "step", spy)
    runs = {}
    for name, extra in (
        ("colocated", []),
        ("placed", ["distillation.nnodes=1", "distillation.n_gpus_per_node=4"]),
    ):
        run = tmp_path / name
        fit(config(assets, run, *distill(teacher, "trainer.total_training_steps=2", *extra),
                   *STABLE_ADAM_OVERRIDES, mesh=mesh))  # fmt: skip
        runs[name] = read_metrics(run)
    assert groups == [("train", 8)] * 2 + [("teacher", 4)] * 2
    for a, b in zip(runs["colocated"], runs["placed"], strict=True):
        assert a["fingerprint/inputs"] == b["fingerprint/inputs"]
        for key in ("distillation/loss", "distillation/abs_loss", "distillation/loss_max",
                    "actor/pg_loss"):  # fmt: skip
            np.testing.assert_allclose(b[key], a[key], rtol=5e-5, atol=1e-6, err_msg=key)


@pytest.mark.entry
def test_top_k_forward_kl_through_the_trainer(assets, tmp_path, step_batches):
    """`forward_kl_topk` (k = 4, backpropagated): the teacher pass's top-k log-probs and ids
    equal the HF torch teacher's top-4 on the step's rows, and the step logs verl's top-k
    metrics (the masses and the overlap of the two top-k sets)."""
    teacher = write_teacher(tmp_path / "teacher", assets / "model")
    run = tmp_path / "run"
    fit(config(assets, run, *distill(teacher, "trainer.total_training_steps=1",
               "distillation.distillation_loss.loss_mode=forward_kl_topk",
               "distillation.distillation_loss.topk=4",
               "distillation.distillation_loss.log_prob_min_clamp=-10")))  # fmt: skip
    (host,) = step_batches
    mask = host["response_mask"].astype(bool)
    z = torch.log_softmax(torch.tensor(hf_response_logits(teacher, host)), dim=-1)
    want_lp, want_ids = torch.topk(z, 4, dim=-1)
    np.testing.assert_allclose(host["teacher_topk_log_probs"][mask], want_lp.numpy()[mask],
                               rtol=1e-4, atol=1e-4)  # fmt: skip  # vs torch: DESIGN §6
    assert (host["teacher_topk_ids"][mask] == want_ids.numpy()[mask]).mean() > 0.99  # ties
    (row,) = read_metrics(run)
    for key in ("distillation/loss", "distillation/student_mass", "distillation/teacher_mass",
                "distillation/teacher_mass_min", "distillation/student_mass_max",
                "distillation/overlap_ratio", "distillation/overlap_token_advantage",
                "distillation/loss_min", "distillation/loss_max"):  # fmt: skip
        assert np.isfinite(row[key]), key
    assert 0 < row["distillation/teacher_mass"] <= 1
    assert row["distillation/loss_min"] >= 0  # the top-k sum is clamped at 0, as verl


def test_top_k_teacher_with_a_larger_embedding_is_named(assets, tmp_path):
    """forward_kl_topk: a teacher padded past the student's vocabulary could rank an id the
    student does not have; the preflight names it, and a top-k above the vocabulary."""
    teacher = write_teacher(tmp_path / "teacher", assets / "model", extra_vocab=8)
    topk = ["distillation.distillation_loss.loss_mode=forward_kl_topk"]
    problems = preflight_problems(config(assets, tmp_path / "run", *distill(teacher), *topk,
                                         "distillation.distillation_loss.topk=4"))  # fmt: skip
    assert len(problems) == 1 and "embedding has" in problems[0]
    problems = preflight_problems(config(assets, tmp_path / "run", *distill(teacher), *topk,
                                         "distillation.distillation_loss.topk=1000"))  # fmt: skip
    assert any("more than the vocabulary" in p for p in problems)


def prompt_digit(text: str) -> int:
    """The digit of a quickstart prompt (`repeat: 7`; the chat template has no digits)."""
    (digit,) = re.findall(r"\d", text)
    return int(digit)


def routed_data(assets, path, values):
    """The quickstart's training rows with a column `teacher`: `values[digit % len(values)]`
    of each row's prompt digit, so a batch row's teacher follows from its prompt alone."""
    frame = pd.read_parquet(assets / "train.parquet")
    digits = [prompt_digit(m[0]["content"]) for m in frame["prompt"]]
    frame["teacher"] = [values[d % len(values)] for d in digits]
    frame.to_parquet(path)
    return frame


def teacher_rows(assets, host, first, second):
    """(teacher folder, bool [N, R] of its rows' response tokens) of a batch routed by
    `routed_data(..., ["a", "b"])`: `first` scores even prompt digits, `second` odd ones
    (both have rows)."""
    tokenizer = load_tokenizer(str(assets / "model"))
    prompts = zip(host["prompts"], host["prompt_mask"], strict=True)
    odd = np.array([prompt_digit(tokenizer.decode(ids[m == 1])) % 2 for ids, m in prompts])
    assert 0 < odd.sum() < len(odd)  # both teachers have rows
    mask = host["response_mask"].astype(bool)
    return [
        (folder, (odd == parity)[:, None] & mask) for parity, folder in enumerate((first, second))
    ]


def two_teachers(first, second, *extra):
    entries = [
        f"+distillation.teacher_models.{name}.{k}={v}"
        for name, key, path in (("math", "a", first), ("code", "b", second))
        for k, v in (("key", key), ("model_path", path), ("inference.dtype", "float32"))
    ]
    return ["distillation.enabled=true", "distillation.teacher_key=teacher", *entries,
            "trainer.test_freq=-1", "trainer.val_before_train=false", *extra]  # fmt: skip


@pytest.mark.entry
@pytest.mark.parametrize("loss_mode", ["k3", "forward_kl_topk"])
def test_each_row_is_scored_by_the_teacher_its_field_routes_it_to(
    assets, tmp_path, step_batches, loss_mode
):
    """verl's multi-teacher distillation: two teachers (different weights and depths) keyed
    `a` and `b`, rows routed by their `teacher` column (`distillation.teacher_key=teacher`:
    `a` for an even prompt digit, `b` for an odd one). Each row's teacher log-probs (or
    top-4 log-probs and ids) equal the HF torch ones of the teacher its prompt names, both
    teachers score rows, and the step trains with verl's distillation metrics."""
    first = write_teacher(tmp_path / "first", assets / "model", seed=1)
    second = write_teacher(tmp_path / "second", assets / "model", seed=2, layers=2)
    data = tmp_path / "train.parquet"
    routed_data(assets, data, ["a", "b"])
    run = tmp_path / "run"
    loss = [f"distillation.distillation_loss.loss_mode={loss_mode}",
            "distillation.distillation_loss.topk=4"]  # fmt: skip
    fit(config(assets, run, *two_teachers(first, second, "trainer.total_training_steps=1",
                                          f"data.train_files={data}", *loss)))  # fmt: skip
    (host,) = step_batches
    for folder, rows in teacher_rows(assets, host, first, second):
        z = torch.log_softmax(torch.tensor(hf_response_logits(folder, host)), dim=-1)
        if loss_mode == "k3":
            want = torch.gather(z, -1, torch.tensor(host["responses"])[..., None])[..., 0]
            got = host["teacher_log_probs"]
        else:
            want, want_ids = torch.topk(z, 4, dim=-1)
            assert (host["teacher_topk_ids"][rows] == want_ids.numpy()[rows]).mean() > 0.99
            got = host["teacher_topk_log_probs"]
        # jaxrl's forward against torch's: DESIGN §6's composite tolerance
        np.testing.assert_allclose(got[rows], want.numpy()[rows], rtol=1e-4, atol=1e-4)
    (row,) = read_metrics(run)
    assert np.isfinite(row["distillation/loss"]) and np.isfinite(row["timing_s/teacher"])


def test_rows_no_teacher_scores_are_named_before_training(assets, tmp_path):
    """A row whose routing field is missing or matches no teacher's key: the run stops
    before any weights load, naming the file, the row and the keys."""
    first = write_teacher(tmp_path / "first", assets / "model", seed=1)
    data = tmp_path / "train.parquet"
    frame = routed_data(assets, data, ["a", "b", "c"])
    bad = int(np.flatnonzero(frame["teacher"] == "c")[0])
    cfg = config(assets, tmp_path / "run", *two_teachers(first, first, f"data.train_files={data}"))
    with pytest.raises(DataError) as err:
        fit(cfg)
    message = str(err.value)
    assert f"{data}: row {bad}: its teacher='c' is the key of no teacher" in message
    assert "['a', 'b']" in message and "data.train_files" in message
    cfg = config(assets, tmp_path / "run2", *two_teachers(first, first))  # no column
    with pytest.raises(DataError, match="row 0: it has no field 'teacher'"):
        fit(cfg)


def test_placed_teachers_share_the_teacher_devices_in_the_memory_plan(assets, tmp_path):
    """Two teachers on the teacher's 4 devices (`distillation.nnodes` x `n_gpus_per_node`):
    both are held there, each pass is its own program, and the group's peak counts both
    teachers' weights plus the larger pass."""
    first = write_teacher(tmp_path / "first", assets / "model", seed=1)
    second = write_teacher(tmp_path / "second", assets / "model", seed=2, layers=2)
    data = tmp_path / "train.parquet"
    routed_data(assets, data, ["a", "b"])
    placed = ["distillation.nnodes=1", "distillation.n_gpus_per_node=4",
              f"data.train_files={data}"]  # fmt: skip
    mesh = ["mesh.dp=1", "mesh.fsdp=-1", "mesh.tp=1", "mesh.sp=1"]
    cfg = config(assets, tmp_path / "run", *two_teachers(first, second, *placed), mesh=mesh)
    trainer = build_run(cfg, abstract=True).trainer
    assert {n: t.layout.mesh.devices.size for n, t in trainer.cluster.teachers.items()} == {
        "teacher:a": 4, "teacher:b": 4
    }  # fmt: skip
    plan = trainer.memory_plan()
    passes = ("teacher:a log-probs", "teacher:b log-probs")
    assert {plan.groups[name] for name in ("teacher:a", "teacher:b", *passes)} == {"teacher"}
    both = plan.resident["teacher:a"] + plan.resident["teacher:b"]
    assert plan.resident["teacher:a"] > plan.resident["teacher:b"] > 0  # 3 layers against 2
    assert plan.group_peak("teacher") == both + max(plan.adds[p] for p in passes)
