"""The scorer of jaxrl's synthetic digit tasks (`jaxrl.data.synthetic` makes their rows).

Partial credit, so that even a random policy sees reward differences within a GRPO group: the
digits of the response are compared position by position with the answer's,

    score = #{i : response_digit[i] == answer_digit[i]} / max(len(answer digits), len(response
            digits))

which is 1.0 exactly when the response's digits are the answer (other tokens are ignored), and
0.0 without digits.

The tool task `add` (`compute_add_score`) scores a whole multi-turn response: half for its
first turn's tool call, compared piece by piece (tags, JSON pieces, numbers, `+`) with the
ideal calculator call on the row's expression (the fraction that agrees, position by
position), and half for `acc`: 1.0 exactly when the number after the last tool answer is the
sum (an answer written without a tool answer before it earns nothing).
"""

from __future__ import annotations

import re
from typing import Any

from jaxrl.data.synthetic import CALL_CLOSE, CALL_OPEN, DATA_SOURCE_PREFIX, DATA_SOURCES

__all__ = ["DATA_SOURCE_PREFIX", "compute_score", "is_synthetic"]

_DIGITS = re.compile(r"\d")
_CALL_PIECES = re.compile(
    "|".join(re.escape(p) for p in ("<tool_call>", "</tool_call>", CALL_OPEN, CALL_CLOSE))
    + r"|\d+|\+"
)


def is_synthetic(data_source: str) -> bool:
    """Whether `data_source` names one of the synthetic tasks."""
    return data_source in DATA_SOURCES


def compute_score(
    solution_str: str, ground_truth: str, data_source: str = "", extra_info: Any = None, **_: Any
) -> float | dict[str, float]:
    """Partial-credit digit match in [0, 1] (see the module doc); 1.0 iff the response's digits
    are exactly the answer's. The `add` task: `compute_add_score`."""
    if data_source == DATA_SOURCE_PREFIX + "add":
        return compute_add_score(solution_str, ground_truth, extra_info)
    return _match(_DIGITS.findall(solution_str), _DIGITS.findall(str(ground_truth)))


def _match(got: list[str], want: list[str]) -> float:
    """Position-by-position agreement of two piece lists, over the longer one's length."""
    if not got or not want:
        return float(got == want)
    hits = sum(a == b for a, b in zip(got, want, strict=False))
    return hits / max(len(want), len(got))


def compute_add_score(solution_str: str, ground_truth: str, extra_info: Any) -> dict[str, float]:
    """{"score", "acc", "call"} of an `add` response (see the module doc)."""
    expression = (extra_info or {}).get("expression")
    if not expression:
        raise ValueError("an add row's extra_info needs its expression (e.g. '123+456')")
    ideal = _CALL_PIECES.findall(f"<tool_call>{CALL_OPEN}{expression}{CALL_CLOSE}</tool_call>")
    first_turn = solution_str.split("<tool_response>")[0]
    call = _match(_CALL_PIECES.findall(first_turn), ideal)
    want = _DIGITS.findall(str(ground_truth))
    digits: list[str] = []
    if "</tool_response>" in solution_str:  # an answer after the tool's
        digits = _DIGITS.findall(solution_str.rsplit("</tool_response>", 1)[-1])
    acc = float(digits == want)
    return {"score": 0.5 * call + 0.5 * acc, "acc": acc, "call": call}
