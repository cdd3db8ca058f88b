"""Where step metrics go: `metrics.jsonl` (always), the console, TensorBoard and W&B.

    loggers = Tracking(run_dir, ("console", "tensorboard"), project, experiment, config)
    loggers.log(metrics, step)
    loggers.close()

Only process 0 writes the files, TensorBoard and W&B (the metrics are already those of the
run); with `console`, the other processes print the same line to their own output, prefixed
`[process i/N]`, so that each process's log shows its progress. `metrics.jsonl` holds one
JSON object per line with `training/global_step` and verl's metric names. A fresh run starts it
anew; a run resumed after step s keeps the lines of steps <= s and appends, so no step appears
twice.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrl.distributed import is_main_process, process_log_prefix

# "file" (verl's JSON-lines logger) names `metrics.jsonl`, which is written in any case.
LOGGERS = ("console", "tensorboard", "wandb", "file")
_CONSOLE_KEYS = (
    "critic/score/mean",
    "val-core/mean",
    "actor/pg_loss",
    "actor/entropy",
    "actor/ppo_kl",
    "actor/grad_norm",
    "actor/kl_loss",
    "critic/vf_loss",
    "response_length/mean",
    "timing_s/step",
    "perf/throughput",
    # the offline trainers (verl's SFT names, TRL's DPO / KTO names)
    "train/loss",
    "val/loss",
    "val/exact_match",
    "loss",
    "rewards/accuracies",
    "rewards/margins",
    "kl",
    "eval_loss",
    "eval_rewards/accuracies",
)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _console_line(step: int, numbers: dict[str, int | float], progress: str = "") -> str:
    shown = [k for k in _CONSOLE_KEYS if k in numbers]
    shown += sorted(k for k in numbers if k.startswith("val-core/") and k not in shown)
    line = f"step {step}: " + " ".join(f"{k}={numbers[k]:.4g}" for k in shown)
    return f"{line} | {progress}" if progress else line


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Progress:
    """`step/total, eta` for the per-step console line: the mean wall time per step since the
    first step this process logged (so compilation and validation before it do not count),
    times the steps left."""

    def __init__(self, total_steps: int | None):
        self.total = total_steps
        self.first: tuple[int, float] | None = None

    def __call__(self, step: int) -> str:
        if not self.total:
            return ""
        now = time.monotonic()
        if self.first is None or step <= self.first[0]:
            self.first = (step, now)
            return f"{step}/{self.total}"
        per_step = (now - self.first[1]) / (step - self.first[0])
        return f"{step}/{self.total}, eta {_duration(per_step * max(self.total - step, 0))}"


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of a run's `metrics.jsonl`."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Tracking:
    """verl's `Tracking`: fan step metrics out to the configured backends."""

    def __init__(
        self,
        run_dir: str | Path,
        backends: Sequence[str],
        project: str,
        experiment: str,
        config: dict[str, Any] | None = None,
        resume_step: int = 0,  # the last step already done (0: a fresh run)
        total_steps: int | None = None,  # for the console line's progress and ETA
    ):
        unknown = [b for b in backends if b not in LOGGERS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown {unknown}; use any of {list(LOGGERS)}")
        self.enabled = is_main_process()
        self.run_dir = Path(run_dir)
        self.backends = tuple(backends)
        self._tb = self._wandb = None
        self.progress = Progress(total_steps)
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        rows = read_metrics(self.run_dir) if resume_step > 0 else []
        kept = [r for r in rows if r.get("training/global_step", 0) <= resume_step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._jsonl = path.open("a")
        if "tensorboard" in self.backends:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "trainer.logger has tensorboard but tensorboardX is not installed: "
                    "pip install tensorboardX"
                ) from e
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if "wandb" in self.backends:
            try:
                import wandb
            except ImportError as e:
                raise ImportError(
                    "trainer.logger has wandb but it is not installed: pip install wandb"
                ) from e
            self._wandb = wandb.init(project=project, name=experiment, config=config or {})

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.enabled and "console" not in self.backends:
            return
        row = {"training/global_step": step, **{k: _plain(v) for k, v in metrics.items()}}
        numbers = {k: v for k, v in row.items() if isinstance(v, int | float)}
        if not self.enabled:
            line = _console_line(step, numbers, self.progress(step))
            print(f"{process_log_prefix()}{line}", flush=True)
            return
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)
        if "console" in self.backends:
            print(_console_line(step, numbers, self.progress(step)), flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
