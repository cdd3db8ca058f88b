"""GSM8K: the number after the last `#### ` (verl 0.9.1's `reward_score.gsm8k`).

Only the last 300 characters of the completion are searched (the answer ends it; regexes on
very long strings are slow). Scores:

    strict:   last match of  `#### (-?[0-9.,]+)`, commas removed   == ground_truth -> score
    flexible: last match of  `(-?[0-9.,]+)` that is not "" or "."  == ground_truth -> score
    no answer found -> 0;  an answer that differs -> format_score

The comparison is of strings: "1,000" and "1000" agree in strict mode (commas are stripped) but
"3.0" and "3" do not, exactly as in verl.
"""

from __future__ import annotations

import re
from typing import Literal

CLIP_CHARS = 300

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_solution(
    solution_str: str, method: Literal["strict", "flexible"] = "strict"
) -> str | None:
    """The answer string in the last `CLIP_CHARS` characters, or None."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _NUMBER.findall(tail)
    if not found:
        return None
    valid = [s for s in found if s not in ("", ".")]
    # verl's loop leaves its variable on the first match when no match is valid.
    return valid[-1] if valid else found[0]


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: Literal["strict", "flexible"] = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` if the extracted answer equals `ground_truth`, `format_score` if it differs, 0 if
    there is none."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score
