"""The offline trainers over the cluster: SFT (verl's SFT trainer) and preference optimisation
(DPO and its variants, KTO; TRL's trainers), both driven by `fit.train_run` through the
`Trainer` protocol, with the RL trainer's `Cluster`, `Learner`, checkpoints and logs.

    run = build_sft_run(cfg)            # cfg: jaxrl.config.offline.SFTConfig
    run = build_preference_run(cfg)     # cfg: jaxrl.config.offline.DPOConfig
    train_run(cfg, run)

A step is one optimizer update on the loader's batch (`data.train_batch_size` examples),
accumulated over micro-batches of `data.micro_batch_size_per_gpu` examples per device; every
micro-batch loss divides by the whole batch's counts (trained tokens for SFT, pairs or rows
for DPO / KTO), so the update does not depend on the micro-batch size. A DPO pair's chosen and
rejected sequences are consecutive rows and always share a micro-batch (one forward pass).
The reference's sequence log-probs are computed once per batch before the update (or once
for the whole dataset before training, `dpo.precompute_ref_log_probs`; or taken as 0,
`dpo.reference_free`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config.mesh import TRAIN_RULES
from jaxrl.config.offline import is_kto, loss_types, offline_mesh
from jaxrl.core_algos.preference import kl_estimate
from jaxrl.data import PromptIterator, load_tokenizer, pack_prompt_response, row_length
from jaxrl.data.offline import OfflineBatch, OfflineDataset
from jaxrl.data.supervised import PreferenceLimits
from jaxrl.sharding.layouts import Layout, train_mesh
from jaxrl.sharding.processes import allgather_objects, gather_rows, to_host
from jaxrl.trainer import losses
from jaxrl.trainer.batch import RLBatch, place_rows
from jaxrl.trainer.cluster import Cluster, Training
from jaxrl.trainer.fit import Run
from jaxrl.trainer.learner import infer
from jaxrl.trainer.optim import learning_rate_schedule, make_optimizer
from jaxrl.trainer.roles import LoraOptions, RoleSpec, dtype_name, log_prob_fn, statistics_fn

log = logging.getLogger("jaxrl.train")


# ---------------------------------------------------------------------------------- the cluster


def offline_layout(cfg: Any, devices=None) -> Layout:
    """The training layout of `mesh.*` over `devices` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = offline_mesh(cfg, len(devices))
    return Layout.create(train_mesh(sizes, devices), dict(cfg.mesh.train_rules) or TRAIN_RULES)


def offline_specs(cfg: Any, *, reference: bool) -> dict[str, RoleSpec]:
    """The actor (trained) and, with `reference`, the frozen reference: both `model.path`."""
    m = cfg.model
    common = dict(
        path=m.path,
        param_dtype=dtype_name(m.model_dtype, "model.model_dtype"),
        compute_dtype=dtype_name(m.dtype, "model.dtype"),
        override_config=dict(m.override_config),
        attention_impl=m.attention_impl,
    )
    remat = m.remat_policy if m.enable_gradient_checkpointing else "none"
    lora = LoraOptions.from_config(m, "model")
    specs = {"actor": RoleSpec("actor", remat=remat, trainable=True, lora=lora, **common)}
    if reference:
        specs["ref"] = RoleSpec("ref", **common)
    return specs


def _tokenizer(cfg: Any) -> Any:
    m = cfg.model
    return load_tokenizer(m.tokenizer_path or m.path, trust_remote_code=m.trust_remote_code,
                          custom_chat_template=m.custom_chat_template)  # fmt: skip


def _steps(cfg: Any, loader: PromptIterator) -> int:
    if cfg.trainer.total_training_steps is not None:
        return int(cfg.trainer.total_training_steps)
    return loader.batches_per_epoch * cfg.trainer.total_epochs


def _loaders(cfg, train: OfflineDataset, val: OfflineDataset | None, val_size: int | None):
    loader = PromptIterator(train, cfg.data.train_batch_size, shuffle=cfg.data.shuffle,
                            seed=cfg.trainer.seed)  # fmt: skip
    val_loader = None
    if val is not None:
        val_loader = PromptIterator.for_validation(val, val_size or cfg.data.train_batch_size)
    return loader, val_loader


# ----------------------------------------------------------------------------- the shared part


def _global(batch: OfflineBatch) -> dict[str, np.ndarray]:
    """The batch's arrays of every process, concatenated in process order (each process holds
    its slice of the global batch), padded to common widths."""
    arrays = {**batch.arrays(), "row_ids": batch.row_ids}
    if batch.labels is not None:
        arrays["labels"] = batch.labels
    if jax.process_count() == 1:
        return arrays
    widths = allgather_objects((batch.prompts.shape[1], batch.responses.shape[1]))
    p, r = max(w[0] for w in widths), max(w[1] for w in widths)
    for k in ("prompts", "prompt_mask"):
        x = arrays[k]
        arrays[k] = np.pad(x, ((0, 0), (p - x.shape[1], 0)))
    for k in ("responses", "response_mask", "loss_mask"):
        x = arrays[k]
        arrays[k] = np.pad(x, ((0, 0), (0, r - x.shape[1])))
    return gather_rows(arrays)


class OfflineTrainer:
    """What the SFT and preference trainers share: the cluster (the trained actor, maybe a
    reference), host batches onto the devices, the step's one update, the learning rate, and
    the checkpointable state (the cluster's)."""

    # the Learner's metric name -> the trainer's
    metric_names: Mapping[str, str] = MappingProxyType({})

    def __init__(self, cfg: Any, cluster: Cluster, *, total_steps: int, rows_per_example: int):
        self.cfg, self.cluster = cfg, cluster
        self.layout = cluster.layouts["actor"]
        self.rows_per_example = rows_per_example
        self.schedule = learning_rate_schedule(cfg.optim, total_steps)

    def device_batch(self, batch: OfflineBatch) -> tuple[RLBatch, dict[str, np.ndarray]]:
        """The global batch on the devices (with its labels), and its host arrays (the same,
        with each row's dataset id `row_ids`): counts are read there, not back from the
        devices."""
        host = _global(batch)
        arrays = {k: v for k, v in host.items() if k != "row_ids"}
        return RLBatch.from_host(arrays, self.layout), host

    def batching(self) -> dict[str, Any]:
        """`Learner.update`'s micro-batch arguments (rows per device: examples x sequences)."""
        data = self.cfg.data
        budget = data.max_token_len_per_gpu if getattr(data, "use_dynamic_bsz", False) else None
        return dict(micro_rows=data.micro_batch_size_per_gpu * self.rows_per_example,
                    token_budget=budget)  # fmt: skip

    def update(self, rl: RLBatch, fields: tuple[str, ...], info: dict[str, Any]) -> dict:
        learner = self.cluster.actor
        lr = float(self.schedule(int(to_host(learner.state.step))))
        with self.cluster.on_device("actor", optimizer=True):
            metrics = learner.update(
                rl, mini_batch_rows=rl.num_rows, epochs=1, shuffle=False, seed=0, fields=fields,
                info=info, **self.batching(),
            )  # fmt: skip
        metrics["lr"] = lr
        return {self.metric_names.get(k, k): v for k, v in metrics.items()}

    def state_items(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.cluster.state_items()

    def restore(self, items: dict[str, Any], meta: dict[str, Any]) -> None:
        self.cluster.restore(items, meta)

    def log_probs(self, params: Any, rl: RLBatch, config) -> jax.Array:
        """Per-token log-probs [N, R] of `rl`'s completions under `params`."""
        fn = _log_prob_fn(config, self.layout, self.cfg.model.logits_chunk_size)
        return infer(fn, params, rl, layout=self.layout, **self.batching())


@functools.cache
def _log_prob_fn(config, layout, chunk_size):
    return log_prob_fn(config, layout, temperature=1.0, chunk_size=chunk_size)


@jax.jit
def _row_sums(lp: jax.Array, loss_mask: jax.Array) -> jax.Array:
    return jnp.sum(lp * loss_mask.astype(lp.dtype), axis=-1)


# ------------------------------------------------------------------------------------------ SFT


class SFTTrainer(OfflineTrainer):
    """verl's SFT trainer: the token-mean NLL of the trained tokens; metrics `train/loss`,
    `train/grad_norm`, `train/lr`, and on validation `val/loss` (the mean of the validation
    batches' token means, as verl) with `val/token_accuracy` (trained tokens whose greedy
    prediction is right) and `val/exact_match` (sequences whose every trained token is the
    greedy prediction: greedy decoding from the prompt writes exactly the target).

    With `model.use_remove_padding` (verl's default) a batch's sequences are packed into rows
    of at most `data.max_length` tokens, the length that needs the fewest padded tokens
    (`jaxrl.data.row_length`, `pack_prompt_response`; segment ids keep them apart), and a
    micro-batch is `data.micro_batch_size_per_gpu` such rows per device (or the rows within
    `max_token_len_per_gpu` under `use_dynamic_bsz`): at most the tokens of as many unpacked
    rows, with no padding computed. The loss, a sum over trained tokens over the batch's count,
    does not depend on the layout."""

    metric_names = MappingProxyType(
        {"grad_norm": "train/grad_norm", "lr": "train/lr", "skipped_steps": "train/skipped_steps"}
    )

    def device_batch(self, batch: OfflineBatch) -> tuple[RLBatch, dict[str, np.ndarray]]:
        if not self.cfg.model.use_remove_padding:
            return super().device_batch(batch)
        host = _global(batch)
        trained = host["loss_mask"].sum(-1) > 0  # the sequences packed (not filler)
        lengths = host["prompt_mask"].sum(-1) + host["response_mask"].sum(-1)
        host = pack_prompt_response(host, row_length(lengths[trained], self.cfg.data.max_length))
        return RLBatch.from_host(host, self.layout), host

    def step(self, batch: OfflineBatch, global_step: int) -> dict[str, float]:
        rl, _ = self.device_batch(batch)
        metrics = self.update(rl, (), {})
        metrics["train/global_tokens"] = float(
            np.sum(np.asarray(rl.prompt_lengths)) + np.sum(np.asarray(rl.response_lengths))
        )
        return metrics

    def validate(self, loader: PromptIterator, global_step: int) -> dict[str, float]:
        learner = self.cluster.actor
        losses_, correct, tokens, exact, sequences = [], 0.0, 0.0, 0.0, 0.0
        fn = _statistics_fn(learner.config, self.layout, self.cfg.model.logits_chunk_size,
                            ("log_probs", "top1"))  # fmt: skip
        with self.cluster.on_device("actor"):
            for batch in _one_pass(loader):
                trained = sum(allgather_objects(int(batch.loss_mask.sum())))
                if trained == 0:  # filler only on every process: nothing to score (or pack)
                    continue
                rl, host = self.device_batch(batch)
                lp, top1 = infer(fn, learner.params, rl, layout=self.layout, **self.batching())
                mask = host["loss_mask"].astype(np.float64)
                lp, top1 = np.asarray(to_host(lp), np.float64), np.asarray(to_host(top1))
                n = mask.sum()
                losses_.append(-(lp * mask).sum() / n)
                correct += (top1 * mask).sum()
                tokens += n
                segments = host.get("response_segment_ids", host["response_mask"])
                right, trained = _exact_sequences(top1, mask, segments)
                exact += right
                sequences += trained
        return {
            "val/loss": float(np.mean(losses_)),
            "val/token_accuracy": float(correct / max(tokens, 1.0)),
            "val/exact_match": exact / max(sequences, 1.0),
        }


def _exact_sequences(
    top1: np.ndarray, mask: np.ndarray, segments: np.ndarray
) -> tuple[float, float]:
    """(sequences whose every trained token is the greedy prediction, sequences with trained
    tokens), a sequence being a (row, segment id) pair of the [N, R] arrays."""
    segments = np.asarray(segments, np.int64)
    key = (np.arange(len(mask))[:, None] * (segments.max(initial=0) + 1) + segments).ravel()
    trained = np.bincount(key, weights=mask.ravel())
    right = np.bincount(key, weights=(top1 * mask).ravel(), minlength=len(trained))
    has = trained > 0
    return float((right[has] == trained[has]).sum()), float(has.sum())


def _one_pass(loader: PromptIterator) -> Iterator[OfflineBatch]:
    loader.epoch, loader.position = 0, 0  # every validation is one whole pass
    yield from loader.one_epoch()


@functools.cache
def _statistics_fn(config, layout, chunk_size, names):
    """`roles.statistics_fn`, built once per model, layout and statistics."""
    return statistics_fn(config, layout, names, chunk_size)


def sft_training(cfg: Any, total_steps: int) -> dict[str, Training]:
    optimizer = make_optimizer(cfg.optim, total_steps)
    chunk = cfg.model.logits_chunk_size
    loss = lambda config: functools.partial(losses.sft_loss, config=config, chunk_size=chunk)  # noqa: E731
    return {"actor": Training(loss, optimizer, cfg.optim.clip_grad)}


def build_sft_run(cfg: Any, devices=None) -> Run:
    """The tokenizer, loaders, cluster and `SFTTrainer` of an SFT config."""
    tokenizer = _tokenizer(cfg)
    train = OfflineDataset.sft(cfg.data, tokenizer, "train")
    val = OfflineDataset.sft(cfg.data, tokenizer, "val") if cfg.data.val_files else None
    loader, val_loader = _loaders(cfg, train, val, None)
    steps = _steps(cfg, loader)
    layout = offline_layout(cfg, devices)
    cluster = Cluster.offline(offline_specs(cfg, reference=False), layout, sft_training(cfg, steps))
    trainer = SFTTrainer(cfg, cluster, total_steps=steps, rows_per_example=1)
    return Run(tokenizer, loader, val_loader, steps, trainer)


# ---------------------------------------------------------------------------------- DPO and KTO


@dataclasses.dataclass(frozen=True)
class PreferenceSpec:
    """The preference loss of a run (`dpo.*`; see `jaxrl.core_algos.preference`)."""

    loss_types: tuple[str, ...]
    loss_weights: tuple[float, ...]
    beta: float
    label_smoothing: float
    discopop_tau: float
    kto: bool
    desirable_weight: float
    undesirable_weight: float

    @classmethod
    def from_config(cls, cfg: Any) -> PreferenceSpec:
        d = cfg.dpo
        types, weights = loss_types(cfg)
        return cls(types, weights, d.beta, d.label_smoothing, d.discopop_tau, is_kto(cfg),
                   d.desirable_weight, d.undesirable_weight)  # fmt: skip


class PreferenceTrainer(OfflineTrainer):
    """DPO (pairs) or KTO (labelled rows) against a frozen reference; TRL's metric names
    (`loss`, `grad_norm`, `learning_rate`, `rewards/chosen`, `rewards/rejected`,
    `rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`, `entropy`,
    `logits/chosen`, `logits/rejected`, `mean_token_accuracy`, `num_tokens`, KTO's `kl`; on
    validation the same with `eval_`, but `num_tokens`)."""

    metric_names = MappingProxyType({"lr": "learning_rate"})

    def __init__(self, cfg: Any, cluster: Cluster, *, total_steps: int, spec: PreferenceSpec):
        super().__init__(cfg, cluster, total_steps=total_steps,
                         rows_per_example=1 if spec.kto else 2)  # fmt: skip
        self.spec = spec
        self.reference_free = cfg.dpo.reference_free
        # dpo.precompute_ref_log_probs: {"train" | "val": [dataset rows, sequences per row]}
        self.ref_tables: dict[str, np.ndarray] = {}
        self.num_tokens = 0  # tokens of the examples trained on so far (TRL's num_tokens)

    # ------------------------------------------------------------------- reference values

    def reference_sums(self, rl: RLBatch, row_ids: np.ndarray, split: str = "train") -> jax.Array:
        """The reference's sequence log-probs [N] of the batch's rows (of dataset `split`)."""
        if self.reference_free:
            return place_rows(np.zeros((rl.num_rows,), np.float32), self.layout)
        if split in self.ref_tables:
            k = self.rows_per_example
            values = self.ref_tables[split][row_ids, np.arange(len(row_ids)) % k]
            return place_rows(np.asarray(values, np.float32), self.layout)
        ref = self.cluster.ref
        with self.cluster.on_device("ref"):
            lp = self.log_probs(ref.params, rl, ref.config)
        return _row_sums(lp, rl.loss_mask)

    def precompute_reference(self, datasets: dict[str, OfflineDataset], batch_size: int) -> None:
        """`dpo.precompute_ref_log_probs`: the reference's sequence log-probs of every row of
        each dataset (`train`, `val`), once; then the reference model is freed. Every
        process computes every row (any process may be dealt any row later)."""
        k = self.rows_per_example
        for split, dataset in datasets.items():
            table = np.zeros((len(dataset), k), np.float64)
            loader = PromptIterator.for_validation(dataset, batch_size, process_index=0,
                                                   process_count=1)  # fmt: skip
            for batch in _one_pass(loader):
                rl, host = self.device_batch(batch)
                row_ids = host["row_ids"]
                sums = np.asarray(to_host(self.reference_sums(rl, row_ids, split)), np.float64)
                table[row_ids, np.arange(len(row_ids)) % k] = sums
            self.ref_tables[split] = table
        self.cluster.frozen.pop("ref", None)  # its arrays go with the last reference to them

    # ------------------------------------------------------------------------------- step

    def _info(self, host: dict[str, np.ndarray]) -> dict[str, Any]:
        """The batch's global counts for the micro-batch losses (from its host arrays):
        examples (pairs; rows and desirable rows), trained tokens (all, chosen and rejected:
        KTO's desirable and undesirable rows)."""
        trained = host["loss_mask"].sum(-1)
        if self.spec.kto:
            real = trained > 0
            good = host["labels"] > 0
            counts = {
                "num_rows": real.sum(),
                "num_desirable": (good & real).sum(),
                "chosen_tokens": trained[good].sum(),
                "rejected_tokens": trained[~good].sum(),
            }
        else:
            counts = {"num_pairs": (trained[0::2] > 0).sum(), "chosen_tokens": trained[0::2].sum(),
                      "rejected_tokens": trained[1::2].sum()}  # fmt: skip
        return {k: jnp.float32(v) for k, v in counts.items()} | {
            "trained_tokens": jnp.float32(trained.sum())
        }

    def _weights(self, info: dict[str, Any]) -> dict[str, float]:
        """What each metric of a batch averages over (validation weighs batches by it): the
        pairs (DPO) or rows (KTO: its class's rows for `*/chosen`, `*/rejected`), and the
        tokens for the token-level metrics."""
        out = {k: float(info[v]) for k, v in losses.TOKEN_METRIC_COUNTS.items()}
        if not self.spec.kto:
            return {"": float(info["num_pairs"]), **out}
        rows = _kto_counts(info)
        classes = {
            f"{k}/{c}": rows[c] for k in ("rewards", "logps") for c in ("chosen", "rejected")
        }
        return {"": rows[""], **classes, **out}

    def _kl(self, batch: OfflineBatch) -> jax.Array:
        """KTO's KL estimate z from the batch's mismatched pairs, under the current policy
        (the pairs change with the batch, so they are never precomputed)."""
        if batch.kl is None or self.spec.loss_types[0] != "kto":
            return jnp.zeros((), jnp.float32)
        kl, kl_host = self.device_batch(batch.kl)
        actor = self.cluster.actor
        with self.cluster.on_device("actor"):
            policy = _row_sums(self.log_probs(actor.params, kl, actor.config), kl.loss_mask)
        ref = self.reference_sums(kl, kl_host["row_ids"], split="kl")
        mask = (jnp.sum(kl.loss_mask, axis=-1) > 0).astype(jnp.float32)
        return kl_estimate(policy, ref, mask)

    def step(self, batch: OfflineBatch, global_step: int) -> dict[str, float]:
        rl, host = self.device_batch(batch)
        rl = rl.replace(ref_sequence_log_probs=self.reference_sums(rl, host["row_ids"]))
        real = host["loss_mask"].sum(-1) > 0  # TRL's num_tokens: every token trained so far
        self.num_tokens += int(host["prompt_mask"][real].sum() + host["response_mask"][real].sum())
        info = self._info(host)
        fields = ("ref_sequence_log_probs",)
        if self.spec.kto:
            fields += ("labels",)
            info["kl"] = self._kl(batch)
        metrics = self.update(rl, fields, info)
        metrics["num_tokens"] = float(self.num_tokens)
        if self.spec.kto:
            metrics["kl"] = float(to_host(info["kl"]))
            metrics = _kto_metrics(metrics, _kto_counts(info))
        return metrics

    def state_items(self) -> tuple[dict[str, Any], dict[str, Any]]:
        items, meta = super().state_items()
        return items, {**meta, "num_tokens": self.num_tokens}

    def restore(self, items: dict[str, Any], meta: dict[str, Any]) -> None:
        super().restore(items, meta)
        self.num_tokens = int(meta.get("num_tokens", 0))

    def validate(self, loader: PromptIterator, global_step: int) -> dict[str, float]:
        """TRL's metrics over the validation set (`eval_*`): each a mean over what it describes
        (`_weights`): the pairs (DPO) or rows (KTO: desirable rows for `*/chosen`,
        undesirable rows for `*/rejected`, every row for the loss and `kl`), the tokens for
        the token-level metrics."""
        actor = self.cluster.actor
        fn = _statistics_fn(actor.config, self.layout, self.cfg.model.logits_chunk_size,
                            losses.PREFERENCE_STATISTICS)  # fmt: skip
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}
        for batch in _one_pass(loader):
            rl, host = self.device_batch(batch)
            ref = self.reference_sums(rl, host["row_ids"], split="val")
            with self.cluster.on_device("actor"):
                stats = infer(fn, actor.params, rl, layout=self.layout, **self.batching())
            rows = {name: _row_sums(x, rl.loss_mask) for name, x in
                    zip(losses.PREFERENCE_STATISTICS, stats, strict=True)}  # fmt: skip
            rows["tokens"] = jnp.sum(rl.loss_mask, axis=-1).astype(jnp.float32)
            info = self._info(host)
            if self.spec.kto:
                info["kl"] = self._kl(batch)
                loss, metrics = losses.kto_terms(rows, ref, rl.labels, info, spec=self.spec)
                metrics["kl"] = info["kl"]
            else:
                loss, metrics = losses.dpo_terms(rows, ref, info, spec=self.spec)
            weight = self._weights(info)
            for key, value in to_host({"loss": loss, **metrics}).items():
                n = weight.get(key, weight[""])
                sums[key] = sums.get(key, 0.0) + float(value) * n
                counts[key] = counts.get(key, 0.0) + n
        out = {k: sums[k] / counts[k] for k in sums if counts[k] > 0}
        if self.spec.kto:
            out = _kto_metrics(
                out, {k: counts.get(f"rewards/{k}", 0.0) for k in ("chosen", "rejected")}
            )
        return {f"eval_{k}": v for k, v in out.items()}


def _kto_counts(info: dict[str, Any]) -> dict[str, float]:
    """The rows each KTO metric averages over: "chosen" (desirable), "rejected", "" (all)."""
    rows, good = float(info["num_rows"]), float(info["num_desirable"])
    return {"": rows, "chosen": good, "rejected": rows - good}


def _kto_metrics(metrics: dict[str, float], counts: dict[str, float]) -> dict[str, float]:
    """KTO's metrics as TRL logs them: a class's metrics only when it has rows, and
    `rewards/margins` when both have."""
    out = {
        k: v for k, v in metrics.items()
        if k.rpartition("/")[2] not in ("chosen", "rejected") or counts[k.rpartition("/")[2]] > 0
    }  # fmt: skip
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


def preference_training(cfg: Any, total_steps: int, spec: PreferenceSpec) -> dict[str, Training]:
    optimizer = make_optimizer(cfg.optim, total_steps)
    chunk = cfg.model.logits_chunk_size

    def loss(config):
        return functools.partial(losses.preference_loss, config=config, spec=spec, chunk_size=chunk)

    return {"actor": Training(loss, optimizer, cfg.optim.clip_grad)}


def build_preference_run(cfg: Any, devices=None) -> Run:
    """The tokenizer, loaders, cluster and `PreferenceTrainer` of a DPO / KTO config."""
    tokenizer = _tokenizer(cfg)
    spec = PreferenceSpec.from_config(cfg)
    d = cfg.dpo
    limits = PreferenceLimits(d.max_length, d.max_prompt_length, d.max_completion_length,
                              d.truncation_mode)  # fmt: skip
    train = OfflineDataset.preference(cfg.data, limits, tokenizer, "train", kto=spec.kto)
    val = None
    if cfg.data.val_files:
        val = OfflineDataset.preference(cfg.data, limits, tokenizer, "val", kto=spec.kto)
    loader, val_loader = _loaders(cfg, train, val, cfg.data.val_batch_size)
    steps = _steps(cfg, loader)
    layout = offline_layout(cfg, devices)
    specs = offline_specs(cfg, reference=not d.reference_free)
    cluster = Cluster.offline(specs, layout, preference_training(cfg, steps, spec))
    trainer = PreferenceTrainer(cfg, cluster, total_steps=steps, spec=spec)
    if d.precompute_ref_log_probs:
        datasets = {"train": train} if val is None else {"train": train, "val": val}
        trainer.precompute_reference(datasets, cfg.data.val_batch_size or cfg.data.train_batch_size)
    return Run(tokenizer, loader, val_loader, steps, trainer)
