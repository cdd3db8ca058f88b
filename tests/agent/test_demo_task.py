"""The tool demo's pieces: the `add` rows, their scorer (the call's pieces credited position
by position, `acc` only for the exact sum after a tool answer), and the format prior's
demonstrations (the loss mask on the assistant's tokens only)."""

import re

import numpy as np
import pytest

from jaxrl.assets_tools import demonstrations
from jaxrl.data import load_tokenizer, synthetic
from jaxrl.rewards.scorers import default_compute_score

SOURCE = "jaxrl/synthetic_add"
CALL = f"<tool_call>{synthetic.CALL_OPEN}123+456{synthetic.CALL_CLOSE}</tool_call>"


def score(text):
    return default_compute_score(SOURCE, text, "579", {"expression": "123+456"})


def test_add_rows():
    rows = synthetic.make_records(50, task="add", seed=3)
    for row in rows:
        a, b = map(int, row["extra_info"]["expression"].split("+"))
        assert a >= 100 and b >= 100 and a + b <= 999
        assert row["reward_model"]["ground_truth"] == str(a + b)
        assert row["prompt"][0]["content"] == f"add: {a} + {b}"
        assert row["agent_name"] == "tool_agent"


@pytest.mark.parametrize(
    "text, expected",
    [(CALL + "user<tool_response>579</tool_response>assistant579", (1.0, 1.0, 1.0)),
     (CALL + "user<tool_response>579</tool_response>assistant529", (0.5, 0.0, 1.0)),
     (CALL, (0.5, 0.0, 1.0)),  # no tool answer: no answer credit
     ("579", (0.0, 0.0, 0.0)),  # the sum written directly: no call, no tool answer
     (CALL.replace("456", "457") + "user<tool_response>580</tool_response>assistant580",
      (0.5 * 6 / 7, 0.0, 6 / 7)),
     (CALL + "assistant579", (0.5 * 7 / 8, 0.0, 7 / 8))],  # no tool answer: part of the call
)  # fmt: skip
def test_the_add_scorer(text, expected):
    out = score(text)
    # float64 fractions such as 0.5 * 6 / 7, the scorer's in another order: ~1e-16 relative,
    # so numpy's default rtol 1e-7 (a wrong credit is off by > 1e-2)
    np.testing.assert_allclose([out["score"], out["acc"], out["call"]], expected)


def test_the_demonstrations_mask_the_assistant_tokens(tmp_path):
    synthetic.write_tokenizer(tmp_path, tools=True)
    tokenizer = load_tokenizer(str(tmp_path))
    ids, attention, loss = demonstrations(tokenizer, 16, copy_operands=1.0, copy_answer=1.0)
    for row, att, mask in zip(ids, attention, loss, strict=True):
        assert set(np.flatnonzero(mask)) <= set(np.flatnonzero(att))
        text = tokenizer.decode(row[mask > 0])
        a, b = map(int, re.search(r"add:(\d+)\+(\d+)", tokenizer.decode(row)).groups())
        assert text == f"<tool_call>{synthetic.CALL_OPEN}{a}+{b}{synthetic.CALL_CLOSE}</tool_call>"\
            f"<|im_end|>{a + b}<|im_end|>"  # fmt: skip
