"""Validation: generate for every validation prompt with `val_kwargs` (greedy by default), score,
and report verl's `val-core/*` / `val-aux/*` metrics.

For each data source and each scored variable v (`reward`, the sequence score, plus what the
scorer returns as extra info, e.g. `acc`), over the n responses of each prompt:

    {sec}/{data_source}/{v}/mean@n    mean over prompts of the mean of their n values
    {sec}/{data_source}/{v}/std@n     mean over prompts of the std of their n values (n > 1)
    {sec}/{data_source}/{v}/best@n/mean    mean over prompts of the best of their n values
    {sec}/{data_source}/{v}/worst@n/mean   ... of the worst (both for n > 1)

`sec` is `val-core` for the core variable (`acc` when the scorer reports it, else `reward`) and
its mean/best, `val-aux` otherwise, as verl's `_val_metrics_update` sorts them. verl's best/
worst are bootstrap estimates over subsets of N = 2, 4, ..., n samples (with their std); jaxrl
reports the exact value over all n under verl's name for N = n, and no intermediate N.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl.data.iterator import PromptIterator
from jaxrl.sharding.processes import allgather_objects


def _numeric(values: list[Any]) -> np.ndarray | None:
    try:
        out = np.asarray([np.nan if v is None else float(v) for v in values], np.float64)
    except (TypeError, ValueError):
        return None
    return out


def validation_metrics(
    data_sources: list[str], group_ids: np.ndarray, infos: dict[str, list[Any]]
) -> dict[str, float]:
    """verl's validation metrics (see the module doc) from per-response values."""
    metrics: dict[str, float] = {}
    sources = np.asarray(data_sources, dtype=object)
    for source in sorted(set(data_sources)):
        rows = np.flatnonzero(sources == source)
        variables = {k: _numeric([v[i] for i in rows]) for k, v in infos.items()}
        variables = {k: v for k, v in variables.items() if v is not None}
        core = "acc" if "acc" in variables else "reward"
        groups: dict[int, list[int]] = defaultdict(list)
        for j, i in enumerate(rows):
            groups[int(group_ids[i])].append(j)
        n = max(len(g) for g in groups.values())
        for name, values in variables.items():
            per_group = [values[g] for g in groups.values()]
            stats = {f"mean@{n}": np.nanmean([np.nanmean(v) for v in per_group])}
            if n > 1:
                stats[f"std@{n}"] = np.nanmean([np.nanstd(v) for v in per_group])
                stats[f"best@{n}/mean"] = np.nanmean([np.nanmax(v) for v in per_group])
                stats[f"worst@{n}/mean"] = np.nanmean([np.nanmin(v) for v in per_group])
            for stat, value in stats.items():
                core_stat = name == core and stat.startswith(("mean", "best"))
                section = "val-core" if core_stat else "val-aux"
                metrics[f"{section}/{source}/{name}/{stat}"] = float(value)
    return metrics


def validate(trainer, loader: PromptIterator, step: int, dump_dir: str | None = None) -> dict:
    """One pass over the validation set: metrics (and a JSONL dump of the generations)."""
    sampling = trainer.val_sampling
    processes = jax.process_count()
    # One record per batch: (data sources, group ids, {variable: values}, dump rows) of its
    # kept rows. With several processes each holds its slice of every batch; the records are
    # gathered and merged batch by batch, process by process: the global batch's order.
    records: list[tuple[list[str], np.ndarray, dict[str, list[Any]], list[dict]]] = []
    offset = 0  # prompts before this batch (this process's; x processes: the global count)
    rng = jax.random.fold_in(jax.random.key(trainer.cfg.actor_rollout_ref.rollout.seed + 1), step)
    loader.epoch, loader.position = 0, 0  # every validation is one whole pass
    for prompts in loader.one_epoch():
        keep = ~prompts.is_padding
        before = offset * processes
        generated = trainer.generate(prompts, sampling, jax.random.fold_in(rng, before))
        batch, conversations = generated.rows, generated.conversations
        repeated = generated.scored(prompts.repeat(sampling.n))
        if generated.scores is not None:  # scored as they ran (an external agent's rewards)
            scores, _, extra = generated.scores
        else:
            scores, _, extra = trainer.val_reward_fn(
                repeated, batch["responses"], batch["response_mask"]
            )
        keep_rows = np.repeat(keep, sampling.n)
        reward = scores.sum(-1)
        infos = {"reward": reward[keep_rows].tolist()}
        for key, values in extra.items():
            if key != "reward":
                infos[key] = [v for v, k in zip(values, keep_rows, strict=True) if k]
        dump = []
        if dump_dir is not None and trainer.tokenizer is not None:
            gts = [str(g) for g in repeated.ground_truth]
            dump = generation_rows(
                trainer.tokenizer, batch, reward, step, gts, keep_rows, conversations
            )
        if conversations is not None:
            infos["num_turns"] = [c["num_turns"] for c, k in zip(conversations, keep_rows,
                                                                 strict=True) if k]  # fmt: skip
        sources = [str(s) for s in repeated.data_source[keep_rows]]
        records.append((sources, repeated.group_ids[keep_rows] + before, infos, dump))
        offset += len(prompts)
    if processes > 1:
        every = allgather_objects(records)
        records = [part[k] for k in range(len(records)) for part in every]
    sources, ids, infos, dump = _merge(records)
    turns = infos.pop("num_turns", None)
    metrics = validation_metrics(sources, ids, infos)
    if turns:  # verl's multi-turn validation statistics
        turns = np.asarray(turns, np.float64)
        metrics.update({f"val-aux/num_turns/{k}": float(getattr(turns, k)())
                        for k in ("min", "max", "mean")})  # fmt: skip
    if dump_dir is not None:
        write_jsonl(dump, Path(dump_dir).expanduser() / f"{step}.jsonl")
    return metrics


def _merge(records) -> tuple[list[str], np.ndarray, dict[str, list], list[dict]]:
    """The batch records in one: variables a batch lacks are None for its rows."""
    keys = sorted({k for _, _, infos, _ in records for k in infos})
    sources: list[str] = []
    ids: list[np.ndarray] = [np.zeros((0,), np.int64)]
    merged: dict[str, list] = {k: [] for k in keys}
    dump: list[dict] = []
    for s, g, infos, d in records:
        sources += s
        ids.append(np.asarray(g, np.int64))
        for k in keys:
            merged[k] += infos.get(k, [None] * len(s))
        dump += d
    return sources, np.concatenate(ids), merged, dump


def generation_rows(
    tokenizer: Any,
    batch: dict[str, np.ndarray],
    scores: np.ndarray,
    step: int,
    ground_truths: list[str] | None = None,
    keep: np.ndarray | None = None,
    conversations: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One JSON row per kept sequence of `batch`: step, decoded input and output, score (and
    ground truth) - verl's `rollout_data_dir` / `validation_data_dir` dumps; a multi-turn
    row adds its conversation (`messages`, `num_turns`, `tool_calls`, `finish`)."""
    keep = np.ones(len(scores), bool) if keep is None else keep
    rows = []
    for i in np.flatnonzero(keep):
        prompt = batch["prompts"][i][batch["prompt_mask"][i] > 0]
        response = batch["responses"][i][batch["response_mask"][i] > 0]
        row = {
            "step": step,
            "input": tokenizer.decode(prompt, skip_special_tokens=True),
            "output": tokenizer.decode(response, skip_special_tokens=True),
            "score": float(scores[i]),
        }
        if ground_truths is not None:
            row["gts"] = ground_truths[i]
        if conversations is not None:
            row.update(conversations[i])
        rows.append(row)
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: Path) -> None:
    """Write `rows` as JSON lines (process 0 only)."""
    if jax.process_index() != 0:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
