"""The run: data, rewards, roles, the step loop, validation, checkpoints and logs
(`RayPPOTrainer.fit`). `python -m jaxrl.train` calls `fit(cfg)`: `build_run` loads the cluster
and makes the PPO trainer, and `train_run` drives any trainer through the `Trainer` protocol
(`jaxrl.trainer.protocol`).

Steps are numbered from 1 as in verl. Step s validates when `test_freq > 0` and s is a multiple
of it or the last step (and, with `val_before_train`, before the first step of this process,
logged at the step it resumes from), and checkpoints when
`save_freq > 0` and s is a multiple of it or the last step. A resumed run (`resume_mode: auto`
finds the newest checkpoint of the run directory) restores the trainer's state (PPO: the actor
and critic parameters and optimizer states, the KL coefficient), the data iterator and the
step, so every later step computes what an uninterrupted run computes: the sampler's key is
derived from the step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from jaxrl.agent import load_tools
from jaxrl.agent.tools.base import schema_dict
from jaxrl.checkpoint import CheckpointError, Checkpoints, abstract, step_numbers
from jaxrl.config import Config
from jaxrl.data import DataError, PromptIterator, RLDataset, load_tokenizer
from jaxrl.data.batch import PromptBatch
from jaxrl.rewards import RewardInputs, make_reward_manager
from jaxrl.trainer.cluster import Cluster
from jaxrl.trainer.dynamic_sampling import DynamicSamplingError
from jaxrl.trainer.experience import RewardFn
from jaxrl.trainer.loggers import Tracking, read_metrics
from jaxrl.trainer.ppo_trainer import PPOTrainer, ppo_training
from jaxrl.trainer.protocol import Trainer
from jaxrl.trainer.rollouter import RolloutError
from jaxrl.trainer.teachers import TeacherRouter

log = logging.getLogger("jaxrl.train")


class TrainingError(RuntimeError):
    """A run that cannot usefully go on; the message names the steps and what to change."""


# What stops a run with a message a user can act on (the command lines print it and exit 1).
RUN_ERRORS = (
    CheckpointError,
    TrainingError,
    DynamicSamplingError,
    RolloutError,
    DataError,
    FileExistsError,
    FileNotFoundError,
)


class NonFiniteGuard:
    """Counts consecutive steps that skipped any optimizer update (actor or critic) for a
    non-finite gradient norm and stops the run at `limit` of them
    (`trainer.max_consecutive_nonfinite_steps`)."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.steps: list[int] = []

    def check(self, step: int, metrics: dict[str, float]) -> None:
        skipped = {k: v for k, v in metrics.items() if k.endswith("skipped_steps") and v}
        if not skipped:
            self.steps = []
            return
        self.steps.append(step)
        norms = {k: v for k, v in metrics.items() if k.endswith("grad_norm")}
        log.warning("step %d: non-finite gradient norm, update skipped (%s)", step, norms)
        if self.limit is not None and len(self.steps) >= self.limit:
            raise TrainingError(
                f"steps {self.steps[0]}-{step}: {len(self.steps)} steps in a row skipped "
                f"optimizer updates for a non-finite gradient norm (last: {norms}, skipped "
                f"{skipped}); stopped as trainer.max_consecutive_nonfinite_steps={self.limit} "
                "says. Look at those steps' rewards and advantages in metrics.jsonl "
                "(critic/score/*, critic/advantages/*), lower the learning rate, or raise the "
                "key (null: never stop)"
            )


def reward_fn_from(manager: Any, reward_model: Any = None) -> RewardFn:
    """A `RewardFn` over a reward manager (rule-based / custom scores), or a reward model whose
    score replaces them when `reward_model.enable` (as verl's managers return `rm_scores`)."""

    def fn(prompts: PromptBatch, responses: np.ndarray, mask: np.ndarray):
        if reward_model is not None:
            scores = reward_model.compute_rm_score(
                response_ids=responses,
                response_mask=mask,
                prompt_ids=prompts.input_ids,
                prompt_mask=prompts.attention_mask,
                raw_prompts=list(prompts.raw_prompt),
            )
            return np.asarray(scores, np.float32), {}, {}
        inputs = RewardInputs(
            response_mask=mask,
            data_sources=[str(s) for s in prompts.data_source],
            ground_truths=list(prompts.ground_truth),
            response_ids=responses,
            extra_infos=list(prompts.extra_info),
        )
        out = manager(inputs)
        return out.reward_tensor, dict(out.metrics), dict(out.reward_extra_info)

    return fn


def total_steps(cfg: Config, loader: PromptIterator) -> int:
    if cfg.trainer.total_training_steps is not None:
        return int(cfg.trainer.total_training_steps)
    return loader.batches_per_epoch * cfg.trainer.total_epochs


def resume_path_problem(path: Path) -> str | None:
    """Why `trainer.resume_from_path` is not a step folder to resume from (None: it is; its
    contents are verified against the manifest when restored)."""
    if not path.is_dir() or not path.name.isdigit():
        return (
            f"trainer.resume_from_path={path}: expected a step folder of a run's "
            "checkpoints (e.g. checkpoints/PROJECT/EXP/checkpoints/40)"
        )
    return None


def _resume_source(cfg: Config, ckpts: Checkpoints) -> tuple[Checkpoints, int] | None:
    """(checkpoints, step) to resume from: `resume_from_path`, or the newest intact step of
    the run (`restorable_step` sets broken and unfinished ones aside), or None."""
    mode = cfg.trainer.resume_mode
    if mode == "disable":
        return None
    if mode == "resume_path":
        path = Path(str(cfg.trainer.resume_from_path)).expanduser()
        if (problem := resume_path_problem(path)) is not None:
            raise CheckpointError(problem)
        return Checkpoints(path.parent), int(path.name)
    step = ckpts.restorable_step()
    return None if step is None else (ckpts, step)


def fresh_start_problem(cfg: Config, directory: Path) -> str | None:
    """Why a fresh run (`resume_mode=disable`) must not start in `directory`: it would write
    over (or be confused by) another run's checkpoints. None when it may."""
    steps = step_numbers(directory)
    if steps and cfg.trainer.resume_mode == "disable":
        return (
            f"{directory} already holds checkpoints of steps {steps}, and "
            f"trainer.resume_mode={cfg.trainer.resume_mode} starts over: set "
            "trainer.resume_mode=auto to continue that run, or choose another "
            "trainer.experiment_name / trainer.default_local_dir (or remove the folder)"
        )
    return None


def _restore(trainer: Trainer, loader: PromptIterator, ckpts: Checkpoints, step: int) -> int:
    """Restore step `step` into the trainer and the data iterator; returns the step."""
    items, meta = ckpts.restore(step, abstract(trainer.state_items()[0]))
    trainer.restore(items, meta)
    loader.load_state_dict(meta["data"])
    return int(meta["global_step"])


@dataclasses.dataclass
class Run:
    """What `build_run` makes of a config: the tokenizer, the data loaders, the number of
    steps and the trainer (models loaded on the mesh, nothing trained yet). Another trainer
    (DPO, SFT) makes its own `Run` and trains it with `train_run`."""

    tokenizer: Any
    train_loader: PromptIterator
    val_loader: PromptIterator | None
    steps: int
    trainer: Trainer


def build_run(cfg: Config, devices=None, *, abstract: bool = False) -> Run:
    """Load the tokenizer and data, build the reward managers and the trainer (`abstract`:
    one that only compiles, no weights loaded, no reward model; see `PPOTrainer`)."""
    model = cfg.actor_rollout_ref.model
    tokenizer = load_tokenizer(
        model.tokenizer_path or model.path,
        trust_remote_code=model.trust_remote_code,
        custom_chat_template=model.custom_chat_template,
    )
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    tools = None
    if multi_turn.enable and multi_turn.tool_config_path:
        tools = load_tools(multi_turn.tool_config_path)
    schemas = [schema_dict(t.tool_schema) for t in tools.values()] if tools else None
    train_set = RLDataset.from_config(cfg.data, tokenizer, "train", schemas)
    if (router := TeacherRouter.from_config(cfg)) is not None:  # several teachers
        router.check_rows(train_set.rows, "data.train_files")
    train_loader = PromptIterator(
        train_set,
        cfg.data.gen_batch_size or cfg.data.train_batch_size,  # a generation batch (DAPO)
        shuffle=cfg.data.shuffle,
        seed=cfg.data.seed,
    )
    val_loader = None
    if cfg.data.val_files and (cfg.trainer.test_freq > 0 or cfg.trainer.val_before_train):
        val_loader = PromptIterator.for_validation(
            RLDataset.from_config(cfg.data, tokenizer, "val", schemas), cfg.data.val_batch_size
        )
    steps = total_steps(cfg, train_loader)
    cluster = Cluster.load(
        cfg, ppo_training(cfg, steps), tokenizer=tokenizer, devices=devices, abstract=abstract
    )
    manager = make_reward_manager(cfg, tokenizer)
    val_manager = make_reward_manager(cfg, tokenizer, num_examine=1)
    trainer = PPOTrainer(
        cfg,
        cluster,
        reward_fn_from(manager, cluster.reward_model),
        total_steps=steps,
        val_reward_fn=reward_fn_from(val_manager, cluster.reward_model),
        tokenizer=tokenizer,
        tools=tools,
        prompt_source=train_loader,
    )
    return Run(tokenizer, train_loader, val_loader, steps, trainer)


def timed_validation(trainer: Trainer, loader: PromptIterator, step: int) -> dict[str, float]:
    """`trainer.validate` with its wall time as verl's `timing_s/testing`."""
    began = time.perf_counter()
    val = trainer.validate(loader, step)
    return {**val, "timing_s/testing": time.perf_counter() - began}


def fit(cfg: Config, devices=None) -> dict[str, float]:
    """Run `cfg` to its last step; returns the last step's metrics. The trainer's `close()`
    (if it has one: the tool runner's threads of a multi-turn run) runs at the end."""
    run = build_run(cfg, devices)
    try:
        return train_run(cfg, run)
    finally:
        if callable(close := getattr(run.trainer, "close", None)):
            close()


def train_run(cfg: Config, run: Run) -> dict[str, float]:
    """Train `run` (its trainer through the `Trainer` protocol only) to its last step, with
    `cfg.trainer`'s validation, checkpoints, logs and resume; returns the last step's
    metrics."""
    if not isinstance(run.trainer, Trainer):
        raise TypeError(f"{type(run.trainer).__name__} does not implement the Trainer protocol")
    run_dir = Path(cfg.trainer.default_local_dir).expanduser()
    trainer, train_loader, val_loader, steps = (
        run.trainer,
        run.train_loader,
        run.val_loader,
        run.steps,
    )
    keep = getattr(cfg.trainer, "max_actor_ckpt_to_keep", None)  # the RL config's name
    keep = getattr(cfg.trainer, "max_ckpt_to_keep", keep)  # the offline configs'
    ckpts = Checkpoints(run_dir / "checkpoints", max_to_keep=keep)
    start = 0
    if (problem := fresh_start_problem(cfg, ckpts.directory)) is not None:
        raise FileExistsError(problem)
    source = _resume_source(cfg, ckpts)
    if source is not None:
        start = _restore(trainer, train_loader, *source)
        if source[0] is not ckpts:
            source[0].close()
        log.info("resumed from step %d of %d (%s)", start, steps, source[0].directory)
        if start >= steps:
            log.warning(
                "the run is already at its last step (%d); raise trainer.total_training_steps "
                "to train further",
                steps,
            )
            if not cfg.trainer.val_only:  # nothing to train, validate or log again
                ckpts.close()
                rows = read_metrics(run_dir)
                return {k: v for row in rows if row.get("training/global_step") == start
                        for k, v in row.items()}  # fmt: skip
        ckpts.set_aside_after(start)  # later steps of a run resumed from an earlier one
    tracking = Tracking(
        run_dir,
        cfg.trainer.logger,
        cfg.trainer.project_name,
        cfg.trainer.experiment_name,
        resume_step=start,
        total_steps=steps,
    )
    metrics: dict[str, float] = {}
    guard = NonFiniteGuard(cfg.trainer.max_consecutive_nonfinite_steps)
    began = time.perf_counter()
    try:
        if val_loader is not None and cfg.trainer.val_before_train:  # on resume too, as verl
            val = timed_validation(trainer, val_loader, start)
            tracking.log({**val, "timing_s/elapsed": time.perf_counter() - began}, start)
            if cfg.trainer.val_only:
                return val
        progress = tqdm(range(start + 1, steps + 1), initial=start, total=steps, disable=None)
        for step in progress:
            metrics = trainer.step(next(train_loader), step)
            ckpts.raise_if_failed()  # a checkpoint write that failed in the background
            last = step == steps
            freq = cfg.trainer.test_freq
            if val_loader is not None and freq > 0 and (step % freq == 0 or last):
                metrics.update(timed_validation(trainer, val_loader, step))
            save = cfg.trainer.save_freq
            if save > 0 and (step % save == 0 or last):
                items, meta = trainer.state_items()
                # a trainer drawing from the loader in the background (fully_async) gives the
                # loader's state that goes with its own
                meta.setdefault("data", train_loader.state_dict())
                meta["global_step"] = step
                ckpts.save(step, items, meta)
            metrics["timing_s/elapsed"] = time.perf_counter() - began
            tracking.log(metrics, step)
            guard.check(step, metrics)
    finally:
        try:
            ckpts.close()
        finally:
            tracking.close()
    return metrics
