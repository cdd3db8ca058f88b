"""`python -m jaxrl.doctor --config configs/NAME.yaml [key=value ...]`: check a run, train nothing.

Takes the same arguments as `python -m jaxrl.train` and reports, section by section:

    config       loaded and checked against the devices JAX sees (as the run does); the
                 quickstart's files are made where `assets.quickstart` asks, as the run does
    models       the model and tokenizer folders, the lengths against each model's context
    data         every row of the train and val files: malformed rows, prompts longer than
                 data.max_prompt_length after the chat template (and what data.truncation /
                 data.filter_overlong_prompts do with them), ground truths the built-in
                 scorers cannot score
    checkpoints  every step folder of the run verified against its checksum manifest, and the
                 step a run would resume from
    plan         devices and meshes, steps, the batch sizes of a step
    memory       every program of a step (and of validation) compiled, not run, for the
                 largest batch the config allows, on abstract weights (only config.json is
                 read, nothing is allocated on the devices): XLA's memory analysis per device
                 and an estimate of the peak (`jaxrl.trainer.memory`). --no-compile skips it.

It checks against the devices of this host, as one process (a multi-host config's mesh checks
need the run's own launch). Exit status: 0 when nothing is wrong, 1 when a problem was found
(each names the key, the file and row, or the folder, and the fix), 2 when the config itself
is invalid.
"""

from __future__ import annotations

import os

# transformers' import-time "PyTorch was not found" advice: jaxrl needs no torch.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl.assets import prepare
from jaxrl.checkpoint import KILLED, step_numbers, survey, verify
from jaxrl.config import Config, ConfigError, load_config
from jaxrl.config.checks import critic_enabled, resolved_mesh
from jaxrl.data import PromptIterator, RLDataset, load_tokenizer
from jaxrl.data.dataset import selection
from jaxrl.data.rows import DataError, read_rows
from jaxrl.models import load_config as read_model_config
from jaxrl.models.params import parameter_counts
from jaxrl.rewards.scorers import ground_truth_problem
from jaxrl.train import device_summary, folder_problems, preflight_problems, run_summary
from jaxrl.trainer.fit import build_run, fresh_start_problem, resume_path_problem, total_steps
from jaxrl.trainer.memory import MemoryPlan, gib
from jaxrl.trainer.teachers import TeacherRouter

SHOWN = 3  # examples listed per kind of problem


@dataclasses.dataclass
class Report:
    """The doctor's findings, printed as they come."""

    problems: list[str] = dataclasses.field(default_factory=list)

    def section(self, title: str) -> None:
        print(f"\n== {title}")

    def info(self, text: str) -> None:
        print(f"   {text}")

    def problem(self, text: str) -> None:
        print(f"!! {text}")
        self.problems.append(text)


def _listing(items: Sequence[str]) -> str:
    more = f"; and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return "; ".join(items[:SHOWN]) + more


# ------------------------------------------------------------------------------------ data


def check_split(cfg: Config, tokenizer, split: str, report: Report) -> RLDataset | None:
    """Every row of the train or val files; returns the dataset a run would build (after
    `max_samples` and the overlong filter), or None when a run could not build it."""
    data = cfg.data
    key = f"data.{split}_files"
    files = data.train_files if split == "train" else data.val_files
    try:  # every row, bad ones too, so that all of them are listed
        rows, read = read_rows(files, prompt_key=data.prompt_key, skip_bad_rows=True)
    except (DataError, FileNotFoundError) as e:
        report.problem(f"{key}: {e}")
        return None
    total, count = sum(read.rows_per_file.values()), len(read.rows_per_file)
    report.info(f"{split}: {total} rows in {count} file(s)")
    if read.skipped:
        n = len(read.skipped)
        if data.skip_bad_rows:
            report.info(f"{split}: {n} malformed rows will be skipped: {_listing(read.skipped)}")
        else:
            report.problem(
                f"{split}: {n} malformed rows: {_listing(read.skipped)}; fix them, or set "
                "data.skip_bad_rows=true to skip them"
            )
    options = selection(data, split)
    filter_overlong = options.pop("filter_overlong_prompts")
    try:
        dataset = RLDataset.from_rows(rows, read, tokenizer, **options)
        if len(dataset) < len(rows):
            report.info(f"{split}: {len(dataset)} rows drawn ({split}_max_samples)")
        _check_lengths(cfg, dataset, split, report)
        if filter_overlong:
            dataset.filter_overlong()
    except DataError as e:
        report.problem(f"{key}: {e}")
        return None
    if cfg.custom_reward_function.path is None and not cfg.reward_model.enable:
        _check_ground_truths(dataset, split, report)
    router = TeacherRouter.from_config(cfg) if split == "train" else None
    if router is not None:  # several distillation teachers: every row must reach one
        try:
            router.check_rows(dataset.rows, key)
        except DataError as e:
            report.problem(str(e))
    return dataset


def _where(row) -> str:
    """`FILE: row I` of a row, as every data message names it."""
    path, index = row.source
    return f"{path}: row {index}"


def _check_lengths(cfg: Config, dataset: RLDataset, split: str, report: Report) -> None:
    """Prompt lengths after the chat template against `data.max_prompt_length`, and what
    `data.filter_overlong_prompts` / `data.truncation` do with longer ones."""
    data, p = cfg.data, cfg.data.max_prompt_length
    lengths = dataset.prompt_lengths()
    report.info(
        f"{split}: templated prompts of {lengths.min()}-{lengths.max()} tokens "
        f"(median {int(np.median(lengths))}; data.max_prompt_length={p})"
    )
    over = np.flatnonzero(lengths > p)
    if not over.size:
        return
    where = [f"{_where(dataset.rows[i])} ({lengths[i]} tokens)" for i in over]
    if data.filter_overlong_prompts:
        if over.size == len(lengths):
            report.problem(
                f"{split}: every prompt is longer than data.max_prompt_length={p}: raise it"
            )
        else:
            report.info(f"{split}: {over.size} longer prompts will be dropped (filter_overlong)")
    elif data.truncation == "error":
        report.problem(
            f"{split}: {over.size} prompts are longer than data.max_prompt_length={p} after "
            f"the chat template: {_listing(where)}; raise data.max_prompt_length, set "
            "data.filter_overlong_prompts=true, or data.truncation=left|right|middle"
        )
    else:
        report.info(f"{split}: {over.size} prompts will be cut to {p} tokens ({data.truncation})")


def _check_ground_truths(dataset: RLDataset, split: str, report: Report) -> None:
    """Rows the built-in scorers cannot score (unknown data source, ground truth type)."""
    bad = [
        f"{_where(row)}: {problem}"
        for row in dataset.rows
        if (problem := ground_truth_problem(row.data_source, row.ground_truth)) is not None
    ]
    if bad:
        report.problem(
            f"{split}: {len(bad)} rows the built-in scorers cannot score: {_listing(bad)}; "
            "fix the rows or set custom_reward_function.path to a scorer that can"
        )


# ----------------------------------------------------------------------------- checkpoints


def check_checkpoints(cfg: Config, steps: int | None, report: Report) -> None:
    """The run's checkpoint folder (or `trainer.resume_from_path`), read only."""
    t = cfg.trainer
    directory = Path(t.default_local_dir).expanduser() / "checkpoints"
    if t.resume_mode == "resume_path":
        path = Path(str(t.resume_from_path)).expanduser()
        problem = resume_path_problem(path)
        if problem is None and (broken := verify(path)) is not None:
            problem = f"trainer.resume_from_path={path}: {broken}"
        if problem is None:
            report.info(f"resumes from {path} (intact)")
        else:
            report.problem(problem)
        return
    if (problem := fresh_start_problem(cfg, directory)) is not None:
        report.problem(problem)
        return
    found = survey(directory) if t.resume_mode != "disable" else {}
    if not found:
        report.info(f"{directory}: no checkpoints; the run starts at step 1")
        return
    for step, problem in found.items():
        report.info(f"step {step}: {'intact' if problem is None else problem}")
    older = len(step_numbers(directory)) - len(found)
    if older:
        report.info(f"{older} older step(s) not read (a run does not reach them)")
    intact = [step for step, problem in found.items() if problem is None]
    if not intact and all(problem == KILLED for problem in found.values()):
        report.info(
            f"steps {list(found)} are saves killed before they committed: a run deletes them "
            "and starts at step 1"
        )
        return
    if not intact:
        report.problem(
            f"{directory}: no intact checkpoint; a run refuses to start (move the folders "
            "away, or set trainer.resume_mode=resume_path trainer.resume_from_path=...)"
        )
        return
    newer = [step for step in found if step > intact[0]]
    aside = f"; steps {newer} are set aside or deleted first" if newer else ""
    report.info(f"a run resumes from step {intact[0]}{aside}")
    if steps is not None and intact[0] >= steps:
        report.info(f"the run is finished ({steps} steps): raise trainer.total_training_steps")


# ------------------------------------------------------------------------------------ plan


def plan_lines(cfg: Config, loader: PromptIterator | None, steps: int | None) -> list[str]:
    """The schedule and the batch sizes of one step."""
    actor_rollout_ref, data, t = cfg.actor_rollout_ref, cfg.data, cfg.trainer
    n = actor_rollout_ref.rollout.n
    rows = data.train_batch_size * n
    lines = []
    if steps is not None and loader is not None:
        lines.append(
            f"steps: {steps} ({loader.batches_per_epoch} batches per epoch of "
            f"{len(loader.dataset)} rows; save every {t.save_freq}, validate every "
            f"{t.test_freq})"
        )
    lines.append(
        f"per step: {data.train_batch_size} prompts x n={n} = {rows} responses of up to "
        f"{data.max_response_length} tokens after prompts of up to {data.max_prompt_length}"
    )
    roles = [("actor", actor_rollout_ref.actor)] + (
        [("critic", cfg.critic)] if critic_enabled(cfg) else []
    )
    for name, role in roles:
        mini = role.ppo_mini_batch_size * n
        updates = -(-rows // mini) * role.ppo_epochs
        micro = (
            f"up to {role.ppo_max_token_len_per_gpu} tokens"
            if role.use_dynamic_bsz
            else f"{role.ppo_micro_batch_size_per_gpu or 'all'} rows"
        )
        lines.append(
            f"{name}: {updates} optimizer steps per step (mini-batches of {mini} rows x "
            f"{role.ppo_epochs} epochs), micro-batches of {micro} per device"
        )
    return lines


# ---------------------------------------------------------------------------------- memory


def memory_lines(plan: MemoryPlan) -> list[str]:
    """The memory plan as a table, bytes per device."""
    lines = [
        "resident: "
        + ", ".join(f"{role} {gib(size)}" for role, size in plan.resident.items())
        + " (parameters, optimizer states)"
    ]
    if plan.host:
        offloaded = ", ".join(f"{role} {gib(size)}" for role, size in plan.host.items())
        lines.append(
            f"offloaded to host memory: {offloaded} (on the devices only for the programs "
            "that use them)"
        )
    if plan.batch:
        lines.append(
            f"the step's batch: {gib(plan.batch)} (on the devices from scoring through the "
            "updates: in the adds of the passes and updates)"
        )
    lines.append(f"{'program':<22}{'arguments':>12}{'outputs':>12}{'temporaries':>14}{'adds':>12}")
    for name, stats in plan.programs.items():
        lines.append(
            f"{name:<22}{gib(stats.arguments):>12}{gib(stats.outputs):>12}"
            f"{gib(stats.temporaries):>14}{gib(plan.adds[name]):>12}"
        )
    for name in [n for n in plan.adds if n not in plan.programs]:  # phases without a program
        lines.append(f"{name:<22}{'-':>12}{'-':>12}{'-':>14}{gib(plan.adds[name]):>12}")
    groups = sorted(set(plan.groups.values()) | {"train"})
    if len(groups) > 1:
        lines.append(
            "device groups (mesh.placement): "
            + ", ".join(f"{g} peak {gib(plan.group_peak(g))}" for g in groups)
        )
    lines.append(
        f"estimated peak per device: {gib(plan.peak)} (resident + {plan.largest}; the "
        "allocator's overhead comes on top)"
    )
    return lines


def check_memory(cfg: Config, report: Report) -> None:
    """Compile a step's programs on an abstract trainer (nothing allocated) and report the
    plan; a plan over the device's memory is a problem."""
    run = build_run(cfg, abstract=True)
    val_prompts = run.val_loader.batch_size if run.val_loader is not None else None
    plan = run.trainer.memory_plan(val_prompts)
    for line in memory_lines(plan):
        report.info(line)
    if cfg.reward_model.enable:
        report.info("not counted: the reward model's weights and its pass (reward_model.*)")
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if limit and plan.peak > limit:
        report.problem(
            f"the estimated peak {gib(plan.peak)} per device exceeds the device's "
            f"{gib(limit)}: lower the micro-batch sizes (*_micro_batch_size_per_gpu, "
            "*_max_token_len_per_gpu), enable gradient checkpointing, or shard over more "
            "devices (mesh.fsdp)"
        )


# ------------------------------------------------------------------------------------ main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jaxrl.doctor",
        description="Check a run's config, models, data and checkpoints without training.",
    )
    parser.add_argument("--config", type=Path, help="YAML file with verl-style config groups")
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="skip the memory estimate (it compiles every program of a step)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser.parse_args(argv)


def diagnose(cfg: Config, report: Report, *, compile_step: bool = True) -> None:
    """Every section after the config's own checks; an unexpected error in one is reported
    as a problem of that section and the next goes on."""
    state: dict[str, Any] = {"loader": None, "steps": None}
    sections = [
        ("models", lambda: _models(cfg, report, state)),
        ("data", lambda: _data(cfg, report, state)),
        ("checkpoints", lambda: check_checkpoints(cfg, state["steps"], report)),
        ("plan", lambda: _plan(cfg, report, state)),
        ("memory", lambda: _memory(cfg, report, compile_step)),
    ]
    for title, run in sections:
        report.section(title)
        try:
            run()
        except Exception as e:  # a diagnosis, not a crash: name it and go on
            report.problem(f"{title}: {type(e).__name__}: {e}")


def _models(cfg: Config, report: Report, state: dict[str, Any]) -> None:
    state["folders_ok"] = not (folders := folder_problems(cfg))
    for problem in preflight_problems(cfg):
        report.problem(problem)
    if not folders:
        report.info(f"actor {cfg.actor_rollout_ref.model.path}: readable")
        report.info(model_line(cfg))


def model_line(cfg: Config) -> str:
    """The actor's size, and for a mixture of experts what a token uses of it and the experts
    each device holds (`mesh.ep`)."""
    config = read_model_config(cfg.actor_rollout_ref.model.path)
    total, active = parameter_counts(config)
    line = f"actor: {config.model_type}, {total / 1e6:.1f}M parameters"
    if config.moe is None:
        return line
    e, k = config.moe.num_experts, config.moe.top_k
    ep = resolved_mesh(cfg, jax.device_count())["ep"]
    return (f"{line}, {active / 1e6:.1f}M of them active per token ({k} of {e} experts); "
            f"{e // ep} experts per device (mesh.ep={ep})")  # fmt: skip


def _data(cfg: Config, report: Report, state: dict[str, Any]) -> None:
    if not state.get("folders_ok"):
        report.info("not checked: the model or tokenizer folder has problems (above)")
        return
    model = cfg.actor_rollout_ref.model
    tokenizer = load_tokenizer(
        model.tokenizer_path or model.path,
        trust_remote_code=model.trust_remote_code,
        custom_chat_template=model.custom_chat_template,
    )
    train = check_split(cfg, tokenizer, "train", report)
    if cfg.data.val_files:
        check_split(cfg, tokenizer, "val", report)
    if train is None:
        return
    try:
        batch_size = cfg.data.gen_batch_size or cfg.data.train_batch_size  # as fit's loader
        loader = PromptIterator(train, batch_size, seed=cfg.data.seed)
    except DataError as e:
        report.problem(f"data.train_files: {e}")
        return
    state["loader"], state["steps"] = loader, total_steps(cfg, loader)


def _plan(cfg: Config, report: Report, state: dict[str, Any]) -> None:
    lines = [*device_summary(cfg).splitlines(), *plan_lines(cfg, state["loader"], state["steps"])]
    for line in lines:
        report.info(line)


def _memory(cfg: Config, report: Report, compile_step: bool) -> None:
    if not compile_step:
        report.info("skipped (--no-compile)")
    elif report.problems:
        report.info("not estimated: fix the problems above first")
    else:
        check_memory(cfg, report)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # The rows are read with skip_bad_rows on, to list every bad row; the report says what a
    # run does with them, not the reader's "skipped" warning.
    logging.getLogger("jaxrl.data").setLevel(logging.ERROR)
    report = Report()
    report.section("config")
    try:
        cfg = load_config(args.config, args.overrides, num_devices=jax.device_count())
        for path in prepare(cfg):
            report.info(f"wrote {path} (assets.quickstart)")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in run_summary(cfg, args.overrides).splitlines():
        report.info(line)
    diagnose(cfg, report, compile_step=not args.no_compile)
    if report.problems:
        print(f"\n{len(report.problems)} problem(s) found (marked !! above)")
        return 1
    print("\nno problems found")
    return 0


if __name__ == "__main__":
    sys.exit(main())
