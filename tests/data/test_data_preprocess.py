"""Preprocessing GSM8K / MATH local copies into verl-format parquet (verl's wording)."""

import json
import subprocess
import sys

import pytest

from jaxrl.data import DataError, read_rows
from jaxrl.data.preprocess import (
    GSM8K_INSTRUCTION,
    MATH_INSTRUCTION,
    gsm8k_answer,
    last_boxed,
    main,
    math_answer,
    split_name,
    strip_boxed,
)
from jaxrl.data.rows import write_parquet
from jaxrl.testing import import_reference

GSM8K = [
    {"question": "Tom has 3 apples and buys 1,200 more. How many?", "answer": "3+1200\n#### 1,203"},
    {"question": "What is 5 - 7?", "answer": "5-7=-2\n#### -2"},
]
MATH = [
    {"problem": "Compute $1+1$.", "solution": "It is $\\boxed{2}$.", "level": "Level 1"},
    {"problem": "Simplify.", "solution": "So $\\frac{a}{b}$ is $\\boxed{\\frac{1}{2}}$."},
]


def _jsonl(path, examples):
    path.write_text("\n".join(json.dumps(e) for e in examples) + "\n")
    return str(path)


def test_gsm8k_rows_have_verls_wording(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", GSM8K)
    test = write_parquet(GSM8K[:1], tmp_path / "test-00000-of-00001.parquet")
    assert main(["gsm8k", "--input", train, test, "--output", str(tmp_path / "out")]) == 0
    rows, _ = read_rows(str(tmp_path / "out" / "train.parquet"))
    assert [r.ground_truth for r in rows] == ["1203", "-2"]
    r = rows[0]
    assert r.data_source == "openai/gsm8k" and r.ability == "math"
    assert r.messages == (
        {"role": "user", "content": GSM8K[0]["question"] + " " + GSM8K_INSTRUCTION},
    )
    assert (
        GSM8K_INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'
    )
    assert r.reward_model == {"style": "rule", "ground_truth": "1203"}
    assert r.extra_info == {
        "split": "train", "index": 0, "answer": GSM8K[0]["answer"], "question": GSM8K[0]["question"]
    }  # fmt: skip
    (t,), _ = read_rows(str(tmp_path / "out" / "test.parquet"))
    assert t.extra_info["split"] == "test"


def test_math_rows_and_boxed_answers_match_verl(tmp_path):
    src = _jsonl(tmp_path / "math.jsonl", MATH)
    main(["math", "--input", src, "--split", "test", "--output", str(tmp_path)])
    rows, _ = read_rows(str(tmp_path / "test.parquet"))
    assert [r.ground_truth for r in rows] == ["2", "\\frac{1}{2}"]
    assert rows[0].data_source == "DigitalLearningGmbH/MATH-lighteval"
    assert rows[0].messages[0]["content"] == "Compute $1+1$. " + MATH_INSTRUCTION
    assert rows[0].extra_info == {"split": "test", "index": 0}
    ref = import_reference("verl.utils.reward_score.math_reward")
    for text in [
        "a \\boxed{1} b \\boxed{x^{2}} c",
        "\\boxed 5$ and \\boxed{6}",
        "no box",
        "\\boxed{unclosed",
        "\\fbox{3} then \\boxed{4}",
    ]:
        assert last_boxed(text) == ref.last_boxed_only_string(text)
        if last_boxed(text) and "fbox" not in last_boxed(text):
            assert strip_boxed(last_boxed(text)) == ref.remove_boxed(last_boxed(text))
    assert math_answer("only \\fbox{7}") == "7"  # verl's remove_boxed fails on \fbox


def test_gsm8k_answer_matches_verl():
    gsm8k = import_reference("verl.utils.reward_score.gsm8k")
    for text in ["x\n#### 1,234", "#### -3.5", "a #### 12.0 b"]:
        assert gsm8k_answer(text) == gsm8k.extract_solution(text, method="strict")
    # verl's preprocessing script takes the first "#### " (its scorer takes the last).
    assert gsm8k_answer("#### 7 and #### 8") == "7" and gsm8k_answer("none") is None


def test_bad_input_names_file_and_row(tmp_path):
    bad = _jsonl(tmp_path / "train.jsonl", [GSM8K[0], {"question": "q", "answer": "no final"}])
    with pytest.raises(DataError, match=r"train\.jsonl: row 1: column 'answer' has no"):
        main(["gsm8k", "--input", bad, "--output", str(tmp_path)])
    missing = _jsonl(tmp_path / "test.jsonl", [{"problem": "p"}])
    with pytest.raises(DataError, match=r"test\.jsonl: row 0: column 'solution' is missing"):
        main(["math", "--input", missing, "--output", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        main(["gsm8k", "--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path)])


def test_math_folder_of_json_files(tmp_path):
    folder = tmp_path / "MATH" / "train" / "algebra"
    folder.mkdir(parents=True)
    for i, e in enumerate(MATH):
        (folder / f"{i}.json").write_text(json.dumps(e))
    main(["math", "--input", str(tmp_path / "MATH" / "train"), "--output", str(tmp_path / "o")])
    rows, _ = read_rows(str(tmp_path / "o" / "train.parquet"))
    assert len(rows) == 2


def test_split_names():
    assert split_name("data/train-00000-of-00001.parquet") == "train"
    assert split_name("gsm8k/test.jsonl") == "test"
    assert split_name("mine.jsonl") == "mine"


def test_module_entry_point(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "jaxrl.data.preprocess", "synthetic", "--output", str(tmp_path),
         "--train-size", "8", "--test-size", "4"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "train: 8 rows" in out.stdout and (tmp_path / "test.parquet").is_file()
