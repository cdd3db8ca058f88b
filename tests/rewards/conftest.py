"""Shared fixtures: a character tokenizer and a file of custom scorers (raising, hanging,
dying, dict-valued, batch, async), written once per session."""

import textwrap

import numpy as np
import pytest

SCORERS_PY = textwrap.dedent(
    """
    import os
    import time


    def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        if data_source == "boom":
            raise ValueError("scorer exploded")
        if data_source == "hang":
            time.sleep(600)
        if data_source == "die":
            os._exit(3)
        if data_source == "nan_type":
            return "not a number"
        if data_source == "dict":
            return {"score": float(solution_str == ground_truth) + bonus, "pred": solution_str}
        return float(solution_str == ground_truth) + bonus


    def batch_score(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
        if "boom" in data_sources:
            raise RuntimeError("batch scorer exploded")
        return [scale * float(s == g) for s, g in zip(solution_strs, ground_truths)]


    async def async_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 2.0 * (solution_str == ground_truth), "index": extra_info["index"]}


    NOT_A_FUNCTION = 3
    """
)


class CharTokenizer:
    """Id i+2 is the i-th printable ASCII character; 0 is the pad, 1 the eos `<|end|>`.

    Like tokenizers whose eos is not a registered special token, `decode` keeps the eos text
    even with `skip_special_tokens=True` (so dapo's eos stripping is exercised); pads are
    always dropped.
    """

    pad_token_id, eos_token_id, eos_token = 0, 1, "<|end|>"
    chars = [chr(c) for c in range(32, 127)] + ["\n"]

    def encode(self, text: str) -> list[int]:
        return [self.chars.index(ch) + 2 for ch in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == 1:
                out.append(self.eos_token)
            elif i >= 2:
                out.append(self.chars[i - 2])
        return "".join(out)

    def right_pad(self, texts: list[str], width: int, eos: bool = False):
        """(ids [B, width], mask [B, width]) of `texts` (+ eos), right-padded with 0."""
        ids = np.zeros((len(texts), width), np.int64)
        for b, t in enumerate(texts):
            row = self.encode(t) + ([1] if eos else [])
            ids[b, : len(row)] = row
        return ids, (ids != 0).astype(np.int64)


@pytest.fixture(scope="session")
def char_tokenizer():
    return CharTokenizer()


@pytest.fixture(scope="session")
def scorers_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("custom") / "my_scorers.py"
    path.write_text(SCORERS_PY)
    return path
