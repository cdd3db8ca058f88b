"""`python -m jaxrl.train --config configs/NAME.yaml [dotted.key=value ...]`.

Loads and checks the configuration against the devices JAX sees (and the model and data paths
it names), makes the files `assets.*` asks for (the quickstart's model and data), prints a short
summary of the run and the device/mesh summary, writes the resolved config to the run directory
(`trainer.default_local_dir/config.yaml`), and runs the RL loop (`jaxrl.trainer.fit`).
"""

from __future__ import annotations

import os

# transformers' import-time "PyTorch was not found" advice: jaxrl needs no torch.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import argparse
import dataclasses
import json
import logging
import sys
import typing
from collections.abc import Sequence
from pathlib import Path

from jaxrl import distributed
from jaxrl.config import Config, ConfigError, load_config, save_config
from jaxrl.config.checks import check_model_context, critic_enabled, teachers
from jaxrl.config.reference import attribute_docs
from jaxrl.plot import plot_run

log = logging.getLogger("jaxrl.train")

REFERENCE = "docs/config.md"


def _epilog() -> str:
    docs = attribute_docs(Config)
    groups = "\n".join(f"  {f.name:<24} {docs.get(f.name, '')}" for f in dataclasses.fields(Config))
    return (
        f"config groups:\n{groups}\n\n"
        "overrides use Hydra's syntax, as verl's command lines do:\n"
        "  data.train_batch_size=256 actor_rollout_ref.rollout.n=5 trainer.logger=[console]\n"
        f"every key, its type, default and meaning: {REFERENCE} "
        "(or python -m jaxrl.config.reference)"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jaxrl.train",
        description="RL post-training (PPO, GRPO, ...) of a HuggingFace causal LM with JAX.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, help="YAML file with verl-style config groups")
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, applied in order"
    )
    return parser.parse_args(argv)


def _hf_config(path: str, override: typing.Mapping[str, object] | None = None) -> dict:
    """A local checkpoint's `config.json` with `override` applied, or {} when it is not here."""
    config_json = Path(path).expanduser() / "config.json"
    if not config_json.is_file():
        return {}
    return {**json.loads(config_json.read_text()), **(override or {})}


def _model_context(path: str, override: typing.Mapping[str, object]) -> int | None:
    """`max_position_embeddings` of a local checkpoint folder, or None when it is not here."""
    return _hf_config(path, override).get("max_position_embeddings")


def folder_problems(cfg: Config) -> list[str]:
    """Every model and tokenizer folder the run reads, checked before anything loads them:
    one message per problem, naming the key, the path and what is missing."""
    from jaxrl.data.templates import tokenizer_problems
    from jaxrl.models import checkpoint_problems

    actor_model = cfg.actor_rollout_ref.model
    models = [("actor_rollout_ref.model.path", actor_model.path)]
    if critic_enabled(cfg):
        models.append(("critic.model.path", cfg.critic.model.path))
    if cfg.reward_model.enable:
        models.append(("reward_model.model.path", cfg.reward_model.model.path))
    if cfg.distillation.enabled:
        key = "distillation.teacher_models.{}.model_path"
        models += [(key.format(name), e["model_path"]) for name, e in teachers(cfg).items()]
    tokenizer_key = "tokenizer_path" if actor_model.tokenizer_path else "path"
    found = [
        f"{key}={path}: {p}" for key, path in models if path for p in checkpoint_problems(path)
    ]
    if not found:  # a missing folder is reported once, as a model folder
        tokenizer = actor_model.tokenizer_path or actor_model.path
        found += [
            f"actor_rollout_ref.model.{tokenizer_key}={tokenizer}: {p}"
            for p in tokenizer_problems(tokenizer)
        ]
    return found


def preflight_problems(cfg: Config) -> list[str]:
    """What keeps a loaded config from starting, found without loading any weights: the model
    and tokenizer folders (`folder_problems`) and the lengths against each model's context."""
    problems = folder_problems(cfg)
    for key, model in [("actor_rollout_ref.model", cfg.actor_rollout_ref.model)] + (
        [("critic.model", cfg.critic.model)] if critic_enabled(cfg) else []
    ):
        context = _model_context(model.path, model.override_config)
        try:
            check_model_context(cfg, context, f"{key}.path={model.path}")
        except ConfigError as e:
            problems += e.problems
    for name, entry in teachers(cfg).items() if cfg.distillation.enabled else ():
        key = f"distillation.teacher_models.{name}.model_path={entry['model_path']}"
        try:
            check_model_context(cfg, _model_context(entry["model_path"], {}), key)
        except ConfigError as e:
            problems += e.problems
        problems += _top_k_problems(cfg, entry["model_path"])
    return problems


def _top_k_problems(cfg: Config, teacher: str) -> list[str]:
    """`forward_kl_topk` takes the top `topk` tokens of both models: at most the smaller
    vocabulary."""
    loss = cfg.distillation.distillation_loss
    if loss.loss_mode != "forward_kl_topk":
        return []
    student, teacher_vocab = (
        _hf_config(path).get("vocab_size") for path in (cfg.actor_rollout_ref.model.path, teacher)
    )
    known = [v for v in (student, teacher_vocab) if v is not None]
    problems = []
    if known and loss.topk > min(known):
        problems.append(
            f"distillation.distillation_loss.topk={loss.topk} is more than the vocabulary "
            f"({min(known)} tokens, actor or teacher); use at most {min(known)}"
        )
    if student is not None and teacher_vocab is not None and teacher_vocab > student:
        problems.append(
            f"distillation teacher {teacher}: its embedding has {teacher_vocab} rows, the "
            f"student's {student}; forward_kl_topk needs every teacher top-k id to be a student "
            "token (the same tokenizer padded to a smaller or equal size)"
        )
    return problems


def _files(files) -> str:
    if files is None:
        return "(none)"
    return files if isinstance(files, str) else ", ".join(map(str, files))


def run_summary(cfg: Config, overrides: Sequence[str]) -> str:
    """A few lines for the console: the run, the overrides, models, data and the schedule (the
    whole resolved config goes to the run directory)."""
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    data, t = cfg.data, cfg.trainer
    models = [f"actor {cfg.actor_rollout_ref.model.path}"]
    if critic_enabled(cfg):
        models.append(f"critic {cfg.critic.model.path}")
    if cfg.reward_model.enable:
        models.append(f"reward model {cfg.reward_model.model.path}")
    steps = (
        f"{t.total_training_steps} steps"
        if t.total_training_steps
        else f"{t.total_epochs} epochs of steps"
    )
    return "\n".join(
        [
            f"run: {t.default_local_dir}",
            f"overrides: {' '.join(overrides) or '(none)'}",
            f"models: {', '.join(models)}",
            f"data: train {_files(data.train_files)}, val {_files(data.val_files)}",
            f"schedule: {steps} of {data.train_batch_size} prompts x {rollout.n} "
            f"responses; {cfg.algorithm.adv_estimator}, loss {actor.policy_loss.loss_mode}, "
            f"mini-batch {actor.ppo_mini_batch_size} prompts x {actor.ppo_epochs} epochs",
        ]
    )


def device_summary(cfg: Config) -> str:
    """Platform, device and process counts, and the meshes of the trainer, the rollout and
    each role placed on devices of its own."""
    import jax

    from jaxrl.sharding.layouts import role_layouts

    kinds = sorted({d.device_kind for d in jax.devices()})
    lines = [
        f"devices: {jax.device_count()} x {', '.join(kinds)} ({jax.default_backend()}), "
        f"{jax.process_count()} process(es), jax {jax.__version__}"
    ]
    for role, layout in role_layouts(cfg).items():
        ids = [d.id for d in layout.mesh.devices.flat]
        where = f" on devices {min(ids)}-{max(ids)}" if len(ids) < jax.device_count() else ""
        lines.append(f"{role + ' mesh:':<14}{dict(layout.mesh.shape)}{where}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if (code := distributed.start_command()) is not None:
        return code
    import jax

    try:
        cfg = load_config(args.config, args.overrides, num_devices=jax.device_count())
        from jaxrl.assets import prepare

        # Process 0 writes the files; the others wait, then write what their host still lacks
        # (hosts without a shared disk).
        written = prepare(cfg) if distributed.is_main_process() else []
        distributed.barrier("jaxrl/assets")
        written += [] if distributed.is_main_process() else prepare(cfg)
        for path in written:
            print(f"wrote {path}")
        if problems := preflight_problems(cfg):
            raise ConfigError(problems)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        distributed.mark_failed(f"configuration error: {e}", exit_code=2)
        return 2
    print(run_summary(cfg, args.overrides))
    print(device_summary(cfg))
    if distributed.is_main_process():
        path = save_config(cfg, cfg.trainer.default_local_dir)
        print(f"resolved config written to {path} (every key: {REFERENCE})")
    from jaxrl.trainer.fit import RUN_ERRORS, fit

    try:
        metrics = fit(cfg)
    except RUN_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        distributed.mark_failed(f"run stopped: {e}", exit_code=1)
        return 1
    if distributed.is_main_process():
        plot_run(cfg.trainer.default_local_dir)  # the run directory's curves.png
    core = {k: v for k, v in metrics.items() if k.startswith("val-core/")}
    print(f"done: {cfg.trainer.default_local_dir} ({core or 'no validation'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
