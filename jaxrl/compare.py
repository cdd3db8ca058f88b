"""`python -m jaxrl.compare RUN_A RUN_B`: the first step where two runs differ.

Reads both runs' `metrics.jsonl` and compares, step by step, the determinism fingerprints
(`fingerprint/inputs`: the step's prompts, responses, masks and scores; `fingerprint/actor`,
`fingerprint/critic`: the parameters after the step). With `--metrics`, every other metric
except timings and throughput must be equal too. Prints where they first differ (or that they
agree) and exits 0 when they agree on every step both have, 1 when they differ, 2 when a run
directory has no metrics or there is nothing to compare.

    python -m jaxrl.compare checkpoints/p/straight checkpoints/p/resumed
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrl.trainer.loggers import read_metrics

# wall-time based, and the programs a process compiles (a resumed run compiles them again)
VOLATILE = (
    "timing", "perf/time", "perf/throughput", "perf/mfu", "perf/compile", "async/trainer/",
    "async/rollout/",
)  # fmt: skip


def by_step(run_dir: Path) -> dict[int, dict[str, Any]]:
    """A run's metrics by step (rows of one step merged)."""
    if not (run_dir / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (pass a run directory)")
    steps: dict[int, dict[str, Any]] = {}
    for row in read_metrics(run_dir):
        steps.setdefault(int(row["training/global_step"]), {}).update(row)
    return steps


def first_difference(
    a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], keys: list[str]
) -> tuple[int, str, Any, Any] | None:
    """(step, key, value in a, value in b) of the first difference in `keys` on the common
    steps (a key missing from one row differs)."""
    for step in sorted(set(a) & set(b)):
        for key in keys:
            if a[step].get(key) != b[step].get(key):
                return step, key, a[step].get(key), b[step].get(key)
    return None


def keys_to_compare(
    a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], metrics: bool, only: list[str]
) -> tuple[list[str], list[str]]:
    """(fingerprint keys, other metric keys) of the common steps."""
    common = set(a) & set(b)
    seen = {k for s in common for k in a[s].keys() | b[s].keys()}
    prints = sorted(k for k in seen if k.startswith("fingerprint/"))
    if only:
        prints = [k for k in prints if k.removeprefix("fingerprint/") in only]
    shared = {k for s in common for k in a[s].keys() & b[s].keys()}
    others = sorted(k for k in shared if not k.startswith(("fingerprint/", *VOLATILE)))
    return prints, (others if metrics else [])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxrl.compare", description=__doc__)
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--metrics", action="store_true", help="compare every metric too")
    parser.add_argument(
        "--only",
        nargs="+",
        default=[],
        choices=("inputs", "actor", "critic"),
        help="compare only these fingerprints",
    )
    args = parser.parse_args(argv)
    try:
        a, b = by_step(args.run_a), by_step(args.run_b)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    common = sorted(set(a) & set(b))
    if not common:
        print(f"no common steps ({args.run_a}: {len(a)} steps, {args.run_b}: {len(b)} steps)")
        return 1
    prints, others = keys_to_compare(a, b, args.metrics, args.only)
    if not prints and not others:
        print(
            f"error: nothing to compare: no {'/'.join(args.only) or ''} fingerprints in these "
            "runs (written since jaxrl kept them); add --metrics to compare the metrics",
            file=sys.stderr,
        )
        return 2
    for key in prints:  # each fingerprint on its own: inputs may agree where parameters do not
        found = first_difference(a, b, [key])
        agree = f"agrees on steps {common[0]}-{common[-1]}"
        print(f"{key}: " + (agree if found is None else f"first differs at step {found[0]}"))
    found = first_difference(a, b, prints + others)
    only = sorted(set(a) ^ set(b))
    if only:
        print(f"steps in one run only: {only}")
    if found is not None:
        step, key, value_a, value_b = found
        print(f"first difference at step {step}: {key} = {value_a} in {args.run_a}, "
              f"{value_b} in {args.run_b}")  # fmt: skip
        return 1
    print(
        f"{args.run_a} and {args.run_b} agree on steps {common[0]}-{common[-1]} "
        f"({', '.join(prints) or 'no fingerprints'}{' and every metric' if others else ''})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
