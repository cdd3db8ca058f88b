"""The command line of the offline trainers: `python -m jaxrl.sft` and `python -m jaxrl.dpo`.

    python -m jaxrl.sft --config configs/sft_quickstart.yaml [dotted.key=value ...]
    python -m jaxrl.dpo --config configs/dpo_quickstart.yaml [dotted.key=value ...]

As `python -m jaxrl.train`: joins the processes, loads and checks the config (verl's SFT keys;
TRL's DPO / KTO keys under `dpo.*`), makes the demo's files (`assets.*`), writes the resolved
config to the run directory, trains with `fit.train_run` (validation, checkpoints, exact
resume, logs) and plots the run's `curves.png`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxrl import distributed
from jaxrl.config import ConfigError, save_config
from jaxrl.config.load import Schema, load_config
from jaxrl.config.reference import attribute_docs
from jaxrl.plot import plot_run

log = logging.getLogger("jaxrl.train")


@dataclasses.dataclass(frozen=True)
class Command:
    """One offline entry point: its name, schema, asset kind and run builder."""

    prog: str
    description: str
    schema: Schema
    assets: str
    build: Callable[[Any], Any]
    summary: Callable[[Any], str]


def parse_args(command: Command, argv: Sequence[str] | None) -> argparse.Namespace:
    docs = attribute_docs(command.schema.root)
    groups = "\n".join(
        f"  {f.name:<32} {docs.get(f.name, '')}" for f in dataclasses.fields(command.schema.root)
    )
    parser = argparse.ArgumentParser(
        prog=command.prog,
        description=command.description,
        epilog=f"config groups:\n{groups}\n\nevery key: docs/config.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, help="YAML file with the config groups")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    return parser.parse_args(argv)


def _problems(cfg: Any) -> list[str]:
    from jaxrl.data.templates import tokenizer_problems
    from jaxrl.models import checkpoint_problems

    m = cfg.model
    found = [f"model.path={m.path}: {p}" for p in checkpoint_problems(m.path)]
    if not found:
        tokenizer = m.tokenizer_path or m.path
        key = "model.tokenizer_path" if m.tokenizer_path else "model.path"
        found += [f"{key}={tokenizer}: {p}" for p in tokenizer_problems(tokenizer)]
    return found


def main(command: Command, argv: Sequence[str] | None = None) -> int:
    args = parse_args(command, argv)
    if (code := distributed.start_command()) is not None:
        return code
    import jax

    from jaxrl.assets import prepare

    try:
        cfg = load_config(args.config, args.overrides, num_devices=jax.device_count(),
                          schema=command.schema)  # fmt: skip
        written = prepare(cfg, command.assets) if distributed.is_main_process() else []
        distributed.barrier("jaxrl/assets")
        written += [] if distributed.is_main_process() else prepare(cfg, command.assets)
        for path in written:
            print(f"wrote {path}")
        if problems := _problems(cfg):
            raise ConfigError(problems)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        distributed.mark_failed(f"configuration error: {e}", exit_code=2)
        return 2
    print(command.summary(cfg))
    if distributed.is_main_process():
        path = save_config(cfg, cfg.trainer.default_local_dir)
        print(f"resolved config written to {path} (every key: docs/config.md)")
    from jaxrl.trainer.fit import RUN_ERRORS, train_run

    try:
        metrics = train_run(cfg, command.build(cfg))
    except RUN_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        distributed.mark_failed(f"run stopped: {e}", exit_code=1)
        return 1
    if distributed.is_main_process():
        plot_run(cfg.trainer.default_local_dir)
    shown = {k: round(v, 4) for k, v in metrics.items() if k.startswith(("val/", "eval_"))}
    print(f"done: {cfg.trainer.default_local_dir} ({shown or 'no validation'})")
    return 0


def _files(files: Any) -> str:
    return "(none)" if files is None else ", ".join(map(str, files))


def sft_summary(cfg: Any) -> str:
    d, t = cfg.data, cfg.trainer
    source = f"messages column {d.multiturn.messages_key!r}" if d.multiturn.enable else (
        f"columns {d.prompt_key!r} -> {d.response_key!r}"
    )  # fmt: skip
    steps = t.total_training_steps or f"{t.total_epochs} epochs of"
    return "\n".join([
        f"run: {t.default_local_dir}",
        f"model: {cfg.model.path}",
        f"data: train {_files(d.train_files)}, val {_files(d.val_files)} ({source})",
        f"schedule: {steps} steps of {d.train_batch_size} sequences, micro-batches of "
        f"{d.micro_batch_size_per_gpu} per device, max_length {d.max_length}",
    ])  # fmt: skip


def dpo_summary(cfg: Any) -> str:
    from jaxrl.config.offline import is_kto, loss_types

    d, t = cfg.data, cfg.trainer
    kind = "KTO rows" if is_kto(cfg) else "pairs"
    types, weights = loss_types(cfg)
    loss = cfg.dpo.loss_type if is_kto(cfg) else " + ".join(
        f"{w:g} {n}" for n, w in zip(types, weights, strict=True)
    )  # fmt: skip
    steps = t.total_training_steps or f"{t.total_epochs} epochs of"
    return "\n".join([
        f"run: {t.default_local_dir}",
        f"model: {cfg.model.path} (reference: "
        f"{'none' if cfg.dpo.reference_free else 'the same checkpoint, frozen'})",
        f"data: train {_files(d.train_files)}, val {_files(d.val_files)}",
        f"loss: {loss}, beta {cfg.dpo.beta}",
        f"schedule: {steps} steps of {d.train_batch_size} {kind}, micro-batches of "
        f"{d.micro_batch_size_per_gpu} per device",
    ])  # fmt: skip
