"""Property tests of the built-in scorers: any response text gets a finite score, and a
ground truth of the wrong type is a `TypeError` that names the data source and the column."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from jaxrl.rewards.scorers import (
    GSM8K_SOURCES,
    MATH_DAPO_SOURCES,
    MATH_SOURCES,
    SEARCH_R1_SOURCES,
    default_compute_score,
    ground_truth_problem,
)

SOURCES = [
    *GSM8K_SOURCES,
    *MATH_SOURCES,
    *MATH_DAPO_SOURCES,
    "aime24",
    *SEARCH_R1_SOURCES,
    "jaxrl/synthetic_repeat",
    "jaxrl/synthetic_reverse",
]
# Pieces the extractors look for, so random text reaches their parsing branches.
PIECES = st.sampled_from(
    ["\\boxed{", "}", "{", "####", "Answer:", "<answer>", "</answer>", "\\frac{1}{2}", "$",
     "\\", "\\sqrt", "1,000", "-", ".", "e+9", "\\text{", "\\left(", "\\right)", "^", "%",
     "\\dfrac", "\\!", "\\infty", "<|im_end|>", "\x00", "9" * 300]
)  # fmt: skip
RESPONSE = st.one_of(
    st.text(max_size=200),
    st.lists(st.one_of(PIECES, st.text(max_size=5)), max_size=30).map("".join),
)
ANSWER = st.one_of(st.text(max_size=30), st.integers(-(10**6), 10**6).map(str))
GROUND_TRUTH = st.one_of(
    ANSWER,
    st.integers(),
    st.none(),
    st.lists(ANSWER, max_size=3),
    st.fixed_dictionaries({"target": st.one_of(ANSWER, st.lists(ANSWER, max_size=3))}),
)


def score_of(result) -> float:
    return result["score"] if isinstance(result, dict) else result


@given(st.sampled_from(SOURCES), RESPONSE, GROUND_TRUTH)
def test_any_response_scores_finite_or_names_a_bad_ground_truth(data_source, response, truth):
    problem = ground_truth_problem(data_source, truth)
    try:
        score = score_of(default_compute_score(data_source, response, truth))
    except TypeError as e:
        assert problem is not None and str(e) == problem
        assert f"data_source {data_source!r}" in problem and "reward_model.ground_truth" in problem
    else:
        assert problem is None and math.isfinite(score)


def test_an_int_ground_truth_is_refused_not_scored_zero():
    # gsm8k compares strings: an int 72 never equals the extracted "72" (a silent zero).
    assert "needs reward_model.ground_truth to be a string, got 72" in ground_truth_problem(
        "openai/gsm8k", 72
    )
    assert ground_truth_problem("nope", "1").startswith("no rule-based scorer")
