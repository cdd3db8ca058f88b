"""Dynamic sampling, verl's batch-at-a-time filter against jaxrl's stream, on one task.

    python benchmarks/dynamic_sampling.py [--steps 20] [--slots 256] [--config ...] [k=v ...]

Runs `configs/dapo_quickstart.yaml` (the quickstart's repeat task with DAPO's recipe: batches
of 32 prompts, 16 responses each, until 16 groups whose scores differ) for `--steps` steps
three times from the same initial weights and seed: with
`algorithm.filter_groups.streaming=false` (verl's: whole generation batches, filtered
afterwards, the surplus thrown away), once with the config's generation batches of 32 prompts
(`batches`) and once with batches of the 16 a step trains on (`batches_of_train_size`:
`data.gen_batch_size=null`), and with `=true` (`streaming`, jaxrl's: groups through `--slots`
engine slots, judged as they end, stopped at 16 kept).
Both runs learn, so their policies drift apart over the steps; each step's figures are its
own. JSON on the last line, per mode: the mean over steps of the response tokens sampled per
trained group (`training/filter_groups/sampled_tokens_per_group`), generation batches drawn,
the groups dropped, the score, and the seconds of generation + scoring per step, the median
and the mean over the steps after the first (the mean counts the later steps' compiles: the
stream starts a varying number of groups, and each new row bucket of `engine.start` compiles
once); and the ratios of each batch mode to streaming (tokens, median seconds).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import emit, machine

FIGURES = {
    "tokens_per_group": "training/filter_groups/sampled_tokens_per_group",
    "gen_batches": "train/num_gen_batches",
    "dropped_groups": "training/filter_groups/evicted_samples",
    "score": "critic/score/mean",
}


def run(config: str, overrides: list[str], folder: Path) -> dict[str, float]:
    """One training run; the mean of each figure over its steps."""
    import jax

    from jaxrl.config import load_config
    from jaxrl.trainer.fit import fit
    from jaxrl.trainer.loggers import read_metrics

    cfg = load_config(config, [*overrides, f"trainer.default_local_dir={folder}"],
                      num_devices=jax.device_count())  # fmt: skip
    fit(cfg)
    rows = [r for r in read_metrics(folder) if "train/num_gen_batches" in r]
    out = {name: statistics.mean(r[key] for r in rows) for name, key in FIGURES.items()}
    seconds = [r["timing_s/gen"] + r.get("timing_s/reward", 0.0) for r in rows[1:]]
    out["gen_and_reward_s"] = statistics.median(seconds) if seconds else float("nan")
    out["gen_and_reward_mean_s"] = statistics.mean(seconds) if seconds else float("nan")
    out["steps"] = len(rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/dapo_quickstart.yaml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    common = [
        f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.resume_mode=disable",
        "trainer.logger=[]", "algorithm.filter_groups.max_num_gen_batches=0",
        *args.overrides,
    ]  # fmt: skip
    result = {"benchmark": "dynamic_sampling", "config": args.config, "steps": args.steps}
    modes = {
        "batches": ["algorithm.filter_groups.streaming=false"],
        "batches_of_train_size": ["algorithm.filter_groups.streaming=false",
                                  "data.gen_batch_size=null"],
        "streaming": ["algorithm.filter_groups.streaming=true",
                      f"actor_rollout_ref.rollout.max_num_seqs={args.slots}"],
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for mode, extra in modes.items():
            result[mode] = run(args.config, [*common, *extra], Path(tmp) / mode)
    for mode in ("batches", "batches_of_train_size"):
        for name in ("tokens_per_group", "gen_and_reward_s"):
            result[f"{name}_{mode}_over_streaming"] = result[mode][name] / result["streaming"][name]
    result["slots"] = args.slots
    emit({**result, **machine()})


if __name__ == "__main__":
    main()
