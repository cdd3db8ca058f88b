"""`python -m jaxrl.plot RUN_DIR`: a PNG of a run's curves from its `metrics.jsonl`.

Panels (those with data), against `training/global_step`: for RL runs training score
(`critic/score/mean`), validation score (every `val-core/*` mean), response length, KL
(`actor/kl_loss`, `actor/reward_kl_penalty`, `actor/ppo_kl`) and entropy (`actor/entropy`);
for the offline trainers loss (SFT's `train/loss`, `val/loss`; DPO's `loss`, `eval_loss`),
accuracy (`val/exact_match`, `val/token_accuracy`, `rewards/accuracies`,
`eval_rewards/accuracies`) and reward margins. Written to `RUN_DIR/curves.png` at the end of
every run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxrl.trainer.loggers import read_metrics

PANELS = (
    ("score", ("critic/score/mean",)),
    ("validation score", ("val-core/",)),
    ("response length", ("response_length/mean",)),
    ("KL", ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl")),
    ("entropy", ("actor/entropy",)),
    ("loss", ("train/loss", "val/loss", "loss", "eval_loss")),
    (
        "accuracy",
        ("val/exact_match", "val/token_accuracy", "rewards/accuracies", "eval_rewards/accuracies"),
    ),
    ("reward margin", ("rewards/margins", "eval_rewards/margins")),
)


def _series(rows: list[dict], prefix: str) -> dict[str, tuple[list[int], list[float]]]:
    """key -> (steps, values) of `prefix` (an exact key, or with a trailing "/" every
    `.../mean@n` key under it)."""

    def wanted(key: str) -> bool:
        if prefix.endswith("/"):
            return key.startswith(prefix) and "/mean@" in key
        return key == prefix

    out: dict[str, tuple[list[int], list[float]]] = {}
    for row in rows:
        step = row.get("training/global_step")
        for key, value in row.items():
            if wanted(key) and isinstance(value, int | float):
                xs, ys = out.setdefault(key, ([], []))
                xs.append(step)
                ys.append(value)
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path | None:
    """Write the curves of `run_dir` to a PNG; returns its path (None without metrics)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        return None
    panels = [p for p in PANELS if any(_series(rows, prefix) for prefix in p[1])] or PANELS[:1]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
    for ax, (title, prefixes) in zip(axes[0], panels, strict=True):
        drawn = False
        for prefix in prefixes:
            for key, (xs, ys) in _series(rows, prefix).items():
                ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=key)
                drawn = True
        ax.set_title(title)
        ax.set_xlabel("step")
        if drawn:
            ax.legend(fontsize=6)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    path = Path(out) if out is not None else Path(run_dir) / "curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxrl.plot", description=__doc__)
    parser.add_argument("run_dir", type=Path, help="a run directory (holds metrics.jsonl)")
    parser.add_argument("--out", type=Path, help="PNG path; default RUN_DIR/curves.png")
    args = parser.parse_args(argv)
    if not (args.run_dir / "metrics.jsonl").is_file():
        print(
            f"error: {args.run_dir}/metrics.jsonl not found: not a run directory", file=sys.stderr
        )
        return 2
    print(plot_run(args.run_dir, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
