"""Search-R1 exact match: the last `<answer>...</answer>` against a list of golden answers
(verl 0.9.1's `reward_score.search_r1_like_qa_em`, used for the `searchR1_*` sources).

Both sides are normalised (lower case, punctuation and articles removed, whitespace collapsed).

    no <answer> tag -> 0;  match -> score (score / 4 with more than 10 opening or closing tags);
    no match -> format_score

`ground_truth` is a mapping with key "target" (a string or a list of strings). verl also prints
one sample in 64 at random; jaxrl does not.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)
MAX_TAGS = 10


def normalize_answer(s: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def _targets(golden_answers: str | Sequence[str]) -> list[str]:
    return [golden_answers] if isinstance(golden_answers, str) else list(golden_answers)


def em_check(prediction: str, golden_answers: str | Sequence[str]) -> int:
    """1 if the normalised prediction equals a normalised golden answer."""
    pred = normalize_answer(prediction)
    return int(any(normalize_answer(g) == pred for g in _targets(golden_answers)))


def subem_check(prediction: str, golden_answers: str | Sequence[str]) -> int:
    """1 if a normalised golden answer is a substring of the normalised prediction."""
    pred = normalize_answer(prediction)
    return int(any(normalize_answer(g) in pred for g in _targets(golden_answers)))


def extract_solution(solution_str: str) -> str | None:
    """The stripped content of the last `<answer>...</answer>`, or None."""
    found = _ANSWER.findall(solution_str)
    return found[-1].strip() if found else None


def compute_score(
    solution_str: str,
    ground_truth: Mapping[str, Any],
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """Exact match of the last answer tag (see the module docstring)."""
    del method  # accepted for verl's signature; unused there too
    answer = extract_solution(solution_str)
    if answer is None:
        return 0
    if not em_check(answer, ground_truth["target"]):
        return format_score
    if solution_str.count("<answer>") > MAX_TAGS or solution_str.count("</answer>") > MAX_TAGS:
        return score / 4
    return score


def compute_score_subem(
    solution_str: str,
    ground_truth: Mapping[str, Any],
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """Substring match of the last answer tag against the golden answers."""
    del method
    answer = extract_solution(solution_str)
    if answer is None:
        return 0
    return score if subem_check(answer, ground_truth["target"]) else format_score
