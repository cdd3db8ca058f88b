"""The offline trainers (`jaxrl.sft`, `jaxrl.dpo`) against the PyTorch references, and their
loop: one step equals verl's SFT loss + torch AdamW, TRL 1.16's `DPOTrainer` and
`KTOTrainer` (parameters after the step, float32); micro-batch invariance; exact resume; bad
rows named by file and row.

Parameters after Adam steps are compared as `jaxrl.testing.numerics` says: both sides use
Adam's eps = `STABLE_ADAM_EPS` (so a gradient's rounding cannot move an element by ~lr) and
the updates agree to `UPDATE_RTOL` of the learning rate. Logged losses and metrics are
reductions of a few hundred float32 terms computed in another order (torch, or another
micro-batch split): 1e-5 relative, 1e-6 absolute for those near 0, covers their rounding
(~1e-7 per term) with a 10x margin; TRL's grad_norm is a norm over every gradient element
(composite: 1e-4).

The model is a tiny random Llama with the synthetic task's ChatML word-level tokenizer, so
TRL, verl and jaxrl tokenize the same rows into the same ids.
"""

from __future__ import annotations

import logging
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import export
from jaxrl.compare import VOLATILE
from jaxrl.config.load import load_config
from jaxrl.config.offline import DPO, SFT
from jaxrl.data import load_tokenizer, supervised, synthetic
from jaxrl.data.offline import Example, OfflineDataset
from jaxrl.data.rows import DataError, write_parquet
from jaxrl.data.supervised import PreferenceLimits
from jaxrl.models import from_pretrained, outputs
from jaxrl.testing.numerics import STABLE_ADAM_EPS, assert_updates_close
from jaxrl.testing.reference import import_reference
from jaxrl.testing.tiny import save_tiny
from jaxrl.trainer import offline
from jaxrl.trainer.fit import train_run
from jaxrl.trainer.loggers import read_metrics
from jaxrl.trainer.offline import build_preference_run, build_sft_run

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

ONE = jax.devices()[:1]
LR = 1e-3  # `_cfg`'s learning rate
STABLE = f"optim.eps={STABLE_ADAM_EPS}"  # where parameters after Adam steps are compared
SFT_COLUMNS = ("data.prompt_key=prompt", "data.response_key=response")
KTO = ("dpo.loss_type=kto",)
MESSAGES = [
    {"role": "system", "content": "copy"},
    {"role": "user", "content": "copy: 1 2 3"},
    {"role": "assistant", "content": "1 2 3"},
    {"role": "user", "content": "reverse: 4 5"},
    {"role": "assistant", "content": "5 4"},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny float32 Llama (2 layers, untied) and the synthetic tokenizer in one folder."""
    folder = tmp_path_factory.mktemp("offline") / "model"
    synthetic.write_tokenizer(folder)
    tok = load_tokenizer(str(folder))
    save_tiny("llama_mha_tied", folder, vocab_size=32, num_hidden_layers=2, hidden_size=32,
              intermediate_size=48, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
              eos_token_id=tok.eos_token_id, bos_token_id=None)  # fmt: skip
    return folder


def _write(folder, name, records):
    return write_parquet(records, folder / f"{name}.parquet")


def _sft_rows(n, seed=0):
    rows = synthetic.sft_records(n, task="reverse", length=3, seed=seed)
    return [{"prompt": r["prompt"][0]["content"], "response": r["response"]} for r in rows]


def _cfg(schema, tiny, run_dir, *overrides, num_devices=1):
    base = [f"model.path={tiny}", "model.model_dtype=fp32", "model.dtype=fp32",
            "model.enable_gradient_checkpointing=false", f"trainer.default_local_dir={run_dir}",
            "trainer.logger=[console]", "optim.lr_scheduler_type=constant",
            "optim.lr_warmup_steps_ratio=0.0", "optim.weight_decay=0.0", f"optim.lr={LR}",
            "data.shuffle=false", "mesh.fsdp=1"]  # fmt: skip
    return load_config(None, [*base, *overrides], num_devices=num_devices, schema=schema)


def _torch_params(folder):
    """A transformers checkpoint folder's parameters as jaxrl's tree (float32)."""
    return from_pretrained(str(folder), dtype="float32")[1]


def _assert_trees_equal(ours, ref):
    flat_ours = jax.tree_util.tree_leaves_with_path(ours)
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref))
    for path, x in flat_ours:
        np.testing.assert_array_equal(np.asarray(x), np.asarray(flat_ref[path]),
                                      err_msg=jax.tree_util.keystr(path))  # fmt: skip


# ------------------------------------------------------------------------------------------ SFT


def _verl_multiturn(monkeypatch, path, tokenizer, **config):
    """verl 0.9.1's `MultiTurnSFTDataset` (its vision-model import stubbed: it needs
    transformers < 5.11 and only serves image rows)."""
    stub = types.ModuleType("verl.models.transformers.qwen2_vl")
    stub.get_rope_index = None
    monkeypatch.setitem(sys.modules, "verl.models.transformers.qwen2_vl", stub)
    module = import_reference("verl.utils.dataset.multiturn_sft_dataset")
    return module.MultiTurnSFTDataset(str(path), tokenizer, {"pad_mode": "right", **config})


@pytest.mark.parametrize(("truncation", "max_length"), [("error", 64), ("left", 20), ("right", 20)])
def test_multiturn_tokens_equal_verl(tiny, tmp_path, monkeypatch, truncation, max_length):
    """Token ids and loss mask of a conversation (system, two user and two assistant turns)
    equal verl's `MultiTurnSFTDataset`: loss on assistant tokens after the role header, the
    end-of-turn tokens included; truncation from either side."""
    tok = load_tokenizer(str(tiny))
    path = _write(tmp_path, "mt", [{"messages": MESSAGES}])
    ref = _verl_multiturn(monkeypatch, path, tok, max_length=max_length, truncation=truncation)[0]
    n = int(ref["attention_mask"].sum())
    cfg = _cfg(SFT, tiny, tmp_path / "run", f"data.train_files={path}",
               "data.multiturn.enable=true", f"data.max_length={max_length}",
               f"data.truncation={truncation}")  # fmt: skip
    (example,) = OfflineDataset.sft(cfg.data, tok, "train").examples
    seq = example.sequences[0]
    ids = [*seq.prompt, *seq.completion]
    mask = [0] * len(seq.prompt) + list(seq.loss_mask)
    assert ids == ref["input_ids"][:n].tolist()
    assert mask == ref["loss_mask"][:n].tolist()
    if truncation == "error":
        assert sum(mask) > 4  # both assistant turns are trained on


def test_template_mismatch_refused_or_concatenated_as_verl(tiny, tmp_path, monkeypatch, caplog):
    """A template that renders the last message differently in a whole conversation (as
    Qwen's thinking templates do) cannot locate the assistant tokens: the row is refused,
    or with `ignore_input_ids_mismatch` trained on the messages' concatenation, verl's ids
    and mask exactly; `enable_thinking_default` reaches the template of rows without a flag."""
    tok = load_tokenizer(str(tiny))
    tok.chat_template = (  # the synthetic ChatML, "copy" after the last message without thinking
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% if loop.last and enable_thinking is defined and not enable_thinking %} copy"
        "{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    path = _write(tmp_path, "mt", [{"messages": MESSAGES}])
    base = [f"data.train_files={path}", "data.multiturn.enable=true", "data.max_length=64"]
    cfg = _cfg(SFT, tiny, tmp_path / "run", *base, "data.multiturn.enable_thinking_default=false")
    with pytest.raises(DataError, match="ignore_input_ids_mismatch=true"):
        OfflineDataset.sft(cfg.data, tok, "train")
    cfg = _cfg(SFT, tiny, tmp_path / "run", *base, "data.multiturn.enable_thinking_default=false",
               "data.multiturn.ignore_input_ids_mismatch=true")  # fmt: skip
    supervised._warn_mismatch.cache_clear()  # once per process
    with caplog.at_level(logging.WARNING, "jaxrl.data"):
        (example,) = OfflineDataset.sft(cfg.data, tok, "train").examples
    assert "training on the concatenation" in caplog.text
    flags = dict(enable_thinking_default=False, ignore_input_ids_mismatch=True)
    ref = _verl_multiturn(monkeypatch, path, tok, max_length=64, truncation="error", **flags)[0]
    seq = example.sequences[0]
    n = int(ref["attention_mask"].sum())
    assert [*seq.prompt, *seq.completion] == ref["input_ids"][:n].tolist()
    assert [0] * len(seq.prompt) + list(seq.loss_mask) == ref["loss_mask"][:n].tolist()
    # without the default (the template's own: undefined), pieces and whole agree
    cfg = _cfg(SFT, tiny, tmp_path / "run", *base)
    assert len(OfflineDataset.sft(cfg.data, tok, "train").examples) == 1


def _verl_sft_loss(hf_model, ids_list, masks_list, batch_tokens):
    """verl's `sft_loss` (no padding: jagged tensors) over HF log-probs of rolled labels."""
    import torch

    losses = import_reference("verl.workers.utils.losses")
    tu = import_reference("verl.utils.tensordict_utils")
    from tensordict import TensorDict

    lps = []
    for ids in ids_list:
        x = torch.tensor([ids])
        logits = hf_model(input_ids=x).logits[0]
        labels = torch.roll(x[0], -1)
        lps.append(torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None])[:, 0])
    nested = torch.nested.as_nested_tensor(lps, layout=torch.jagged)
    mask = torch.nested.as_nested_tensor([torch.tensor(m) for m in masks_list], layout=torch.jagged)
    data = TensorDict({"loss_mask": mask}, batch_size=[len(ids_list)])
    tu.assign_non_tensor(data, pad_mode="no_padding", dp_size=1, batch_num_tokens=batch_tokens)
    loss, _ = losses.sft_loss(None, {"log_probs": nested}, data)
    return loss


@pytest.mark.parametrize("packed", [True, False])
def test_sft_step_equals_verl_loss_and_torch_adamw(tiny, tmp_path, packed):
    """One SFT step (single- and multi-turn rows in one batch, micro-batches of one row) equals
    verl's `sft_loss` on the HF model followed by `clip_grad_norm_(1.0)` and torch AdamW:
    the logged loss and every parameter's update (module docstring). Packed: the four
    sequences share rows of 48 tokens (segment ids), as verl's no-padding mode removes
    padding; else each is a padded row."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(str(tiny))
    single = _write(tmp_path, "single", _sft_rows(3))
    multi = _write(tmp_path, "multi", [{"messages": MESSAGES}] * 1)
    rows = []
    for path, enable in ((single, "false"), (multi, "true")):
        cfg = _cfg(SFT, tiny, tmp_path / "x", f"data.train_files={path}", *SFT_COLUMNS,
                   f"data.multiturn.enable={enable}")  # fmt: skip
        rows += [e.sequences[0] for e in OfflineDataset.sft(cfg.data, tok, "train").examples]
    ids = [[*s.prompt, *s.completion] for s in rows]
    masks = [[0] * len(s.prompt) + list(s.loss_mask) for s in rows]
    tokens = sum(map(sum, masks))

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    opt = torch.optim.AdamW(hf.parameters(), lr=LR, betas=(0.9, 0.95), eps=STABLE_ADAM_EPS,
                            weight_decay=0.01)  # fmt: skip
    want_loss = _verl_sft_loss(hf, ids, masks, tokens)
    want_loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
    opt.step()
    hf.save_pretrained(str(tmp_path / "torch_after"))

    # jaxrl: the same four sequences as one batch
    four = _write(tmp_path, "four", _sft_rows(4))
    cfg = _cfg(SFT, tiny, tmp_path / "run", f"data.train_files={four}", *SFT_COLUMNS,
               "data.train_batch_size=4", "data.micro_batch_size_per_gpu=1",
               "optim.betas=[0.9,0.95]", "optim.weight_decay=0.01", "data.max_length=48",
               f"model.use_remove_padding={str(packed).lower()}",
               "trainer.total_training_steps=1", STABLE)  # fmt: skip
    run = build_sft_run(cfg, ONE)
    dataset = run.train_loader.dataset
    dataset.examples = [Example((s,), None, ("test", 0)) for s in rows]
    rl, _ = run.trainer.device_batch(dataset.batch(np.arange(4)))
    assert rl.num_rows == (2 if packed else 4) and (rl.prompt_segment_ids is not None) == packed
    metrics = run.trainer.step(dataset.batch(np.arange(4)), 1)
    np.testing.assert_allclose(metrics["train/loss"], float(want_loss.detach()), rtol=1e-5)
    assert_updates_close(_torch_params(tiny), run.trainer.cluster.actor.params,
                         _torch_params(tmp_path / "torch_after"), LR)  # fmt: skip


def test_packed_validation_equals_padded(tiny, tmp_path, monkeypatch):
    """SFT validation over packed rows gives the padded rows' loss, token accuracy and exact
    match (per sequence: a (row, segment) of the packed arrays). The greedy check is stubbed
    to "right unless the target is one digit token", so some sequences match exactly and
    others do not."""
    tok = load_tokenizer(str(tiny))
    rows = _sft_rows(6)
    wrong = tok(rows[0]["response"])["input_ids"][0]  # in some responses, not in all
    statistics = dict(outputs.TOKEN_STATISTICS)
    statistics["top1"] = lambda z, y: (y != wrong).astype(jnp.float32)
    monkeypatch.setattr(outputs, "TOKEN_STATISTICS", statistics)
    offline._statistics_fn.cache_clear()  # trace with the stub (and again after)
    monkeypatch.setattr(offline, "_statistics_fn", offline._statistics_fn.__wrapped__)
    path = _write(tmp_path, "rows", rows)
    got = {}
    for packed in (True, False):
        flag = f"model.use_remove_padding={str(packed).lower()}"
        cfg = _cfg(SFT, tiny, tmp_path / f"run{packed}", f"data.train_files={path}",
                   f"data.val_files={path}", *SFT_COLUMNS, "data.max_length=32",
                   "data.train_batch_size=4", flag)  # fmt: skip
        run = build_sft_run(cfg, ONE)
        rl, _ = run.trainer.device_batch(next(iter(run.val_loader)))
        assert rl.num_rows == (2 if packed else 4)  # two sequences a packed row
        got[packed] = run.trainer.validate(run.val_loader, 0)
    assert 0 < got[False]["val/exact_match"] < 1
    for key, value in got[False].items():
        np.testing.assert_allclose(got[True][key], value, rtol=1e-6, err_msg=key)
    # exact match per sequence: row 0 holds segments 1 (all right) and 2 (one wrong), row 1
    # segment 1 (all right, one untrained token wrong)
    top1 = np.array([[1, 1, 1, 0, 1, 0], [1, 0, 1, 1, 0, 0]], float)
    mask = np.array([[1, 1, 1, 1, 1, 0], [1, 0, 1, 0, 0, 0]], float)
    seg = np.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]])
    assert offline._exact_sequences(top1, mask, seg) == (2.0, 3.0)


# ---------------------------------------------------------------------------------- DPO and KTO


def test_dpo_validation_does_not_depend_on_its_batch_size(tiny, tmp_path):
    """Validation weighs each batch's metrics by what they average over (pairs, chosen or
    rejected tokens, all trained tokens): batches of 4 pairs (the last half filler) give the
    metrics of one batch of all 6."""
    path = _write(tmp_path, "pairs", _pairs(6))
    got = []
    for size in (4, 6):
        cfg = _cfg(DPO, tiny, tmp_path / f"run{size}", f"data.train_files={path}",
                   f"data.val_files={path}", "data.train_batch_size=4",
                   f"data.val_batch_size={size}")  # fmt: skip
        run = build_preference_run(cfg, ONE)
        got.append(run.trainer.validate(run.val_loader, 0))
    assert {"eval_entropy", "eval_logits/rejected", "eval_mean_token_accuracy"} <= set(got[1])
    for key, value in got[1].items():
        np.testing.assert_allclose(got[0][key], value, rtol=1e-5, atol=1e-7, err_msg=key)


def _pairs(n, seed=0, conversational=True):
    rows = synthetic.preference_records(n, task="repeat", length=3, seed=seed)
    if conversational:
        return rows
    return [{"prompt": r["prompt"][0]["content"] + " ->", "chosen": " " + r["chosen"][0]["content"],
             "rejected": " " + r["rejected"][0]["content"]} for r in rows]  # fmt: skip


def _kto_rows(pairs):
    """KTO's unpaired rows: each pair's chosen (desirable) and rejected completion."""
    rows = _pairs(pairs, conversational=False)
    return [{"prompt": p["prompt"], "completion": p[k], "label": k == "chosen"}
            for p in rows for k in ("chosen", "rejected")]  # fmt: skip


def _trl_step(trainer_cls, config_cls, tiny, records, out, **args):
    import datasets
    import torch

    torch.manual_seed(0)
    tok = load_tokenizer(str(tiny))
    common = dict(output_dir=str(out), per_device_train_batch_size=len(records),
                  gradient_accumulation_steps=1, max_steps=1, learning_rate=LR,
                  lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
                  weight_decay=0.0, max_grad_norm=1.0, bf16=False, fp16=False, use_cpu=True,
                  gradient_checkpointing=False, report_to="none", logging_steps=1,
                  save_strategy="no", seed=0, dataloader_num_workers=0, max_length=64,
                  adam_epsilon=STABLE_ADAM_EPS)  # fmt: skip
    trainer = trainer_cls(model=str(tiny), args=config_cls(**common, **args),
                          train_dataset=datasets.Dataset.from_list(records),
                          processing_class=tok)  # fmt: skip
    trainer.train()
    trainer.model.save_pretrained(str(out / "after"))
    return trainer.state.log_history[0]


# Every DPO loss type in one step or another: the mixtures sum the types' losses (equal
# weights), so a type computed wrong moves the parameters away from TRL's.
SMOOTH_FREE = ["hinge", "ipo", "sigmoid_norm", "nca_pair", "bco_pair", "sppo_hard", "apo_zero",
               "apo_down", "discopop"]  # fmt: skip
DPO_STEPS = [
    ((["sigmoid"], None, {}), ["dpo.loss_type=sigmoid"]),
    ((["ipo", "sft"], [1.0, 0.5], {}), ["dpo.loss_type=ipo", "dpo.rpo_alpha=0.5"]),
    ((SMOOTH_FREE, [1.0] * 9, {}), [f"dpo.loss_type=[{','.join(SMOOTH_FREE)}]"]),
    ((["robust", "exo_pair"], [1.0, 1.0], {"label_smoothing": 0.1}),
     ["dpo.loss_type=[robust,exo_pair]", "dpo.label_smoothing=0.1"]),
]  # fmt: skip
# What TRL logs that jaxrl's step reports too (not rewards/accuracies: at the first step the
# policy is the reference, every reward is 0 up to rounding, and `chosen > rejected` compares
# rounding noise)
DPO_METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
               "logps/rejected", "entropy", "logits/chosen", "logits/rejected",
               "mean_token_accuracy", "num_tokens")  # fmt: skip


@pytest.mark.parametrize(("trl_loss", "ours"), DPO_STEPS)
def test_dpo_step_equals_trl(tiny, tmp_path, trl_loss, ours):
    """One DPO step from the same checkpoint on the same pairs (conversational rows; chosen
    and rejected in one forward) equals TRL 1.16's `DPOTrainer` step: every parameter's
    update, the loss and TRL's metrics (rpo_alpha as TRL 1.16's `sft` term)."""
    trl = import_reference("trl")
    records = _pairs(4)
    types_, weights, more = trl_loss
    extra = more if weights is None else {"loss_weights": weights, **more}
    logged = _trl_step(trl.DPOTrainer, trl.DPOConfig, tiny, records, tmp_path / "trl",
                       beta=0.2, loss_type=types_, **extra)  # fmt: skip
    path = _write(tmp_path, "pairs", records)
    cfg = _cfg(DPO, tiny, tmp_path / "run", f"data.train_files={path}", "dpo.beta=0.2",
               "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2", "dpo.max_length=64",
               STABLE, *ours)  # fmt: skip
    run = build_preference_run(cfg, ONE)
    metrics = run.trainer.step(next(run.train_loader), 1)
    for key in DPO_METRICS:
        np.testing.assert_allclose(metrics[key], logged[key], rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(metrics["grad_norm"], logged["grad_norm"], rtol=1e-4)
    assert_updates_close(_torch_params(tiny), run.trainer.cluster.actor.params,
                         _torch_params(tmp_path / "trl/after"), LR)  # fmt: skip


def test_kto_step_equals_trl(tiny, tmp_path):
    """One KTO step (string rows, the KL estimate from each prompt with the previous row's
    completion) equals TRL 1.16's `KTOTrainer` step: parameters' updates, loss and metrics."""
    trl = import_reference("trl")
    records = _kto_rows(3)
    logged = _trl_step(trl.KTOTrainer, trl.KTOConfig, tiny, records, tmp_path / "trl",
                       beta=0.2, desirable_weight=1.2, undesirable_weight=0.8)  # fmt: skip
    path = _write(tmp_path, "kto", records)
    cfg = _cfg(DPO, tiny, tmp_path / "run", f"data.train_files={path}", "dpo.loss_type=kto",
               "dpo.beta=0.2", "dpo.desirable_weight=1.2", "dpo.undesirable_weight=0.8",
               "data.train_batch_size=6", "data.micro_batch_size_per_gpu=6",
               "dpo.max_length=64", STABLE)  # fmt: skip
    run = build_preference_run(cfg, ONE)
    metrics = run.trainer.step(next(run.train_loader), 1)
    trl_only = {"epoch", "step", "learning_rate"}  # (jaxrl's learning_rate: its schedule)
    assert set(logged) - trl_only <= set(metrics)
    for key in set(logged) - trl_only:
        np.testing.assert_allclose(metrics[key], logged[key], rtol=1e-4 if key == "grad_norm"
                                   else 1e-5, atol=1e-6, err_msg=key)  # fmt: skip
    assert_updates_close(_torch_params(tiny), run.trainer.cluster.actor.params,
                         _torch_params(tmp_path / "trl/after"), LR)  # fmt: skip


# ---------------------------------------------------------------------------- loop properties


def _run(cfg, devices=ONE):
    build = build_preference_run if hasattr(cfg, "dpo") else build_sft_run
    run = build(cfg, devices)
    train_run(cfg, run)
    return run


def _timeless(rows: list[dict]) -> list[dict]:
    """Metric rows without their wall-clock entries (`jaxrl.compare.VOLATILE`)."""
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in rows]


@pytest.mark.parametrize("kind", ["sft", "dpo", "kto"])
def test_micro_batches_and_resume(tiny, tmp_path, kind):
    """Two steps with micro-batches of one example equal two steps without (metrics and
    updates as the module docstring says); two steps straight equal one step + checkpoint +
    resume (shuffled rows: the data order resumes too), every metric and parameter exactly."""
    if kind == "sft":  # packed two sequences a row: two rows a batch
        schema, rows, extra = SFT, _sft_rows(8), [*SFT_COLUMNS, "data.max_length=32"]
    elif kind == "dpo":
        schema, rows, extra = DPO, _pairs(8), ["dpo.loss_type=[sigmoid,bco_pair]"]
    else:
        schema, rows, extra = DPO, _kto_rows(4), KTO
    path = _write(tmp_path, "rows", rows)
    common = [f"data.train_files={path}", "data.train_batch_size=4", "trainer.save_freq=1",
              "trainer.total_training_steps=2", "data.shuffle=true", STABLE, *extra]  # fmt: skip

    def run(name, *more):
        cfg = _cfg(schema, tiny, tmp_path / name, *common, *more)
        return _run(cfg), read_metrics(tmp_path / name)

    whole, whole_rows = run("whole", "data.micro_batch_size_per_gpu=4")
    split, split_rows = run("split", "data.micro_batch_size_per_gpu=1")
    others = [(split, split_rows)]
    if kind == "sft":  # micro-batches of at most 32 tokens: one packed row each
        others.append(run("dynamic", "data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=32"))
    for other, other_rows in others:
        for a, b in zip(whole_rows, other_rows, strict=True):
            for key, value in a.items():
                if key.startswith(VOLATILE):
                    continue
                if key == "rewards/accuracies" and a["training/global_step"] == 1:
                    continue  # step 1: the policy is the reference; it compares rounding noise
                np.testing.assert_allclose(b[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
        assert_updates_close(_torch_params(tiny), other.trainer.cluster.actor.params,
                             whole.trainer.cluster.actor.params, LR, steps=2)  # fmt: skip

    run("resumed", "data.micro_batch_size_per_gpu=4", "trainer.total_training_steps=1")
    resumed, resumed_rows = run("resumed", "data.micro_batch_size_per_gpu=4")
    assert _timeless(resumed_rows) == _timeless(whole_rows)
    jax.tree.map(
        lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
        resumed.trainer.cluster.actor.params,
        whole.trainer.cluster.actor.params,
    )


# -------------------------------------------------------------------------------------- bad rows


@pytest.mark.parametrize(
    ("row", "overrides", "message"),
    [
        ({"prompt": "repeat: 1", "chosen": None, "rejected": "2 2"}, [], "column 'chosen'"),
        ({"prompt": "repeat: 1", "chosen": "", "rejected": "2 2"}, [], "empty chosen"),
        ({"prompt": "repeat: 1 1 1 1 1 1", "chosen": "1", "rejected": "2"},
         ["dpo.max_prompt_length=3", "dpo.truncation_mode=error"], "dpo.max_prompt_length=3"),
        ({"prompt": "repeat: 1", "completion": None, "label": 1}, KTO, "column 'completion'"),
        ({"prompt": "repeat: 1", "completion": "", "label": 0}, KTO, "empty completion"),
        ({"prompt": "repeat: 1", "completion": "1", "label": 2}, KTO, "2 is not a boolean"),
        ({"prompt": "repeat: 1", "completion": "1", "label": None}, KTO, "column 'label'"),
    ],
)  # fmt: skip
def test_bad_preference_rows_are_named(tiny, tmp_path, row, overrides, message):
    kto = overrides == KTO
    if kto:
        good = {"prompt": "repeat: 1", "completion": "1 1", "label": 1}  # 0/1 labels are booleans
    else:
        good = {"prompt": "repeat: 1", "chosen": "1 1", "rejected": "2 2"}
    path = _write(tmp_path, "bad", [good, good, row, good])
    tok = load_tokenizer(str(tiny))
    for skip in (False, True):
        cfg = _cfg(DPO, tiny, tmp_path / "run", f"data.train_files={path}",
                   f"data.skip_bad_rows={str(skip).lower()}", *overrides)  # fmt: skip
        d = cfg.dpo
        limits = PreferenceLimits(d.max_length, d.max_prompt_length, d.max_completion_length,
                                  d.truncation_mode)  # fmt: skip
        if not skip:
            with pytest.raises(DataError, match=f"{path}: row 2: .*{message}"):
                OfflineDataset.preference(cfg.data, limits, tok, "train", kto=kto)
        else:
            dataset = OfflineDataset.preference(cfg.data, limits, tok, "train", kto=kto)
            assert len(dataset) == 3 and len(dataset.report.skipped) == 1
            assert "row 2" in dataset.report.skipped[0]


def test_bad_sft_rows_are_named(tiny, tmp_path):
    path = _write(tmp_path, "bad", [*_sft_rows(2), {"prompt": "copy: 1", "response": ""}])
    tok = load_tokenizer(str(tiny))
    cfg = _cfg(SFT, tiny, tmp_path / "run", f"data.train_files={path}", *SFT_COLUMNS)
    with pytest.raises(DataError, match=f"{path}: row 2: .*'response'"):
        OfflineDataset.sft(cfg.data, tok, "train")
    long = _write(tmp_path, "long", [{"prompt": "copy: " + " ".join("1" * 40), "response": "1"}])
    cfg = _cfg(SFT, tiny, tmp_path / "run", f"data.train_files={long}", "data.max_length=16",
               *SFT_COLUMNS)  # fmt: skip
    with pytest.raises(DataError, match=f"{long}: row 0: .*data.max_length=16"):
        OfflineDataset.sft(cfg.data, tok, "train")


# ------------------------------------------------------------------------- reference handling


def test_precomputed_reference_equals_per_batch_and_lora(tiny, tmp_path):
    """`precompute_ref_log_probs` trains exactly as the per-batch reference (and frees the
    reference model); `reference_free` differs; with LoRA only the adapters move and the
    reference is the frozen base (no model of its own)."""
    path = _write(tmp_path, "pairs", _pairs(8))
    common = [f"data.train_files={path}", f"data.val_files={path}", "data.train_batch_size=4",
              "data.micro_batch_size_per_gpu=2", "trainer.total_training_steps=2",
              "trainer.test_freq=2"]  # fmt: skip

    def run(name, *more):
        cfg = _cfg(DPO, tiny, tmp_path / name, *common, *more)
        return _run(cfg), read_metrics(tmp_path / name)

    per_batch, rows = run("per_batch")
    pre, pre_rows = run("pre", "dpo.precompute_ref_log_probs=true")
    assert "ref" in per_batch.trainer.cluster.frozen and "ref" not in pre.trainer.cluster.frozen
    for a, b in zip(rows, pre_rows, strict=True):
        for key, value in a.items():
            if key.startswith(VOLATILE):
                continue
            if key == "rewards/accuracies" and a["training/global_step"] == 1:
                continue  # step 1: the policy is the reference; it compares rounding noise
            # the reference's log-probs from another program (measured: bit for bit equal);
            # 1e-5 relative (DESIGN §6, simple ops) should XLA fuse that pass otherwise
            np.testing.assert_allclose(b[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    _, free_rows = run("free", "dpo.reference_free=true")
    # not rounding: another objective trains other weights, but 2 small steps leave the policy
    # near the first run's (measured 0.4% apart); 20% says the run trained sanely
    assert free_rows[-1]["eval_logps/chosen"] == pytest.approx(rows[-1]["eval_logps/chosen"],
                                                               rel=0.2)  # fmt: skip
    assert free_rows[0]["rewards/chosen"] != pytest.approx(0.0, abs=1e-3)  # no reference: -> 0

    lora, lora_rows = run("lora", "model.lora_rank=4", "model.lora_alpha=8")
    cluster = lora.trainer.cluster
    assert cluster.shared_ref and "ref" not in cluster.frozen
    base = _torch_params(tiny)
    _assert_trees_equal(cluster.actor.base, base)  # the base did not move
    assert lora_rows[-1]["eval_rewards/margins"] > 0  # the adapters learned the preference


@pytest.mark.parametrize("kind", ["sft", "kto"])
def test_lora_trains_only_the_adapters(tiny, tmp_path, kind):
    """SFT and KTO with `model.lora_rank`: the base weights stay as loaded, the adapters
    learn (SFT: the validation loss falls; KTO: desirable rows' rewards rise above the
    undesirable ones')."""
    if kind == "sft":
        schema, rows, extra = SFT, _sft_rows(8), [*SFT_COLUMNS, "data.max_length=32"]
    else:
        schema, rows, extra = DPO, _kto_rows(4), KTO
    path = _write(tmp_path, "rows", rows)
    cfg = _cfg(schema, tiny, tmp_path / "run", f"data.train_files={path}",
               f"data.val_files={path}", "data.train_batch_size=8", "optim.lr=1e-2",
               "trainer.total_training_steps=4", "trainer.test_freq=4",
               "trainer.val_before_train=true", "model.lora_rank=4", "model.lora_alpha=8",
               *extra)  # fmt: skip
    run = _run(cfg)
    rows = read_metrics(tmp_path / "run")
    _assert_trees_equal(run.trainer.cluster.actor.base, _torch_params(tiny))
    if kind == "sft":
        assert rows[-1]["val/loss"] < 0.8 * rows[0]["val/loss"]
    else:
        assert rows[-1]["eval_rewards/margins"] > 0


@pytest.mark.parametrize(
    ("kind", "mesh"),
    [("sft", ["mesh.fsdp=2", "mesh.tp=2", "mesh.sp=2"]), ("dpo", ["mesh.fsdp=4", "mesh.tp=2"]),
     ("kto", ["mesh.dp=2", "mesh.fsdp=2", "mesh.tp=2"])],
)  # fmt: skip
def test_sharded_equals_one_device_and_exports(tiny, tmp_path, kind, mesh):
    """Two steps on 8 devices (fsdp x tp, and sp: ring attention, for SFT) equal two steps on
    one (the updates, module docstring); the checkpoint exports to an HF folder with the
    trained weights, bit for bit."""
    if kind == "sft":
        schema, rows, extra = SFT, _sft_rows(8), list(SFT_COLUMNS)
    elif kind == "dpo":
        schema, rows, extra = DPO, _pairs(8), []
    else:
        schema, rows, extra = DPO, _kto_rows(4), KTO
    path = _write(tmp_path, "rows", rows)
    common = [f"data.train_files={path}", "data.train_batch_size=4", "trainer.save_freq=2",
              "data.micro_batch_size_per_gpu=1", "trainer.total_training_steps=2", STABLE,
              *extra]  # fmt: skip
    one = _run(_cfg(schema, tiny, tmp_path / "one", *common))
    cfg = _cfg(schema, tiny, tmp_path / "mesh", *common, *mesh, num_devices=8)
    sharded = _run(cfg, jax.devices())
    assert_updates_close(_torch_params(tiny), sharded.trainer.cluster.actor.params,
                         one.trainer.cluster.actor.params, LR, steps=2)  # fmt: skip
    out = tmp_path / "hf"
    assert export.main(["--checkpoint", str(tmp_path / "mesh"), "--out", str(out)]) == 0
    _assert_trees_equal(sharded.trainer.cluster.actor.params, _torch_params(out))
