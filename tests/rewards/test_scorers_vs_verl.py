"""The rule-based scorers return exactly what verl 0.9.1's `verl.utils.reward_score` returns.

Equality, not closeness: a reward is a discrete decision. The corpus holds hand-written tricky
completions (thousands separators, `$`, signs and decimals, several `####`, nested braces in
`\\boxed{}`, `\\frac` forms, text after the answer, very long outputs) crossed with tricky
ground truths, plus a seeded fuzz of strings assembled from the same tricky pieces.
"""

import contextlib
import io
import random

import pytest

from jaxrl.rewards.scorers import (
    NOT_PORTED,
    default_compute_score,
    gsm8k,
    math_dapo,
    math_reward,
    qa_em,
)
from jaxrl.testing import import_reference

LONG = "Let me think step by step. " * 400  # ~10k characters

GSM8K_COMPLETIONS = [
    "#### 72",
    "The answer is #### 72",
    "#### 1,000",
    "#### 1,000,000.",
    "#### $1,000",
    "#### -5",
    "#### - 5",
    "#### 3.50",
    "#### 3.5",
    "#### .5",
    "#### 0.5",
    "#### 72\n#### 18",
    "#### 18 #### 72 dollars",
    "####72",
    "#### 18 dollars. Hope that helps!",
    "#### .",
    "#### ,",
    "#### 5.",
    "no answer here",
    "",
    "The total is 1,234 and then 56.",
    "Costs $12.50 each, so 3 cost $37.50.",
    "numbers: . , .. 7",
    LONG + "#### 72",
    "#### 72 " + LONG,
    LONG[:290] + "#### 1,000",
    "x" * 297 + "#### 72",
    "-.5 and -,3",
]
GSM8K_TRUTHS = ["72", "1000", "-5", "3.5", "3.50", "18", "0.5", "5", "37.50", "1000000."]

MATH_COMPLETIONS = [
    "So the answer is $\\boxed{\\frac{1}{2}}$.",
    "\\boxed{\\frac12}",
    "\\boxed{\\tfrac{1}{2}}",
    "\\boxed{\\dfrac12}",
    "\\boxed{0.5}",
    "\\boxed{.5}",
    "\\boxed{1/2}",
    "\\boxed{01/2}",
    "\\boxed{3/4} and also \\boxed{1/2}",
    "\\boxed{\\sqrt{2}^{3}}",
    "\\boxed{\\sqrt2^{3}}",
    "\\boxed{\\left( 1, 2 \\right)}",
    "\\boxed{(1,2)}",
    "\\boxed{x = 5}",
    "\\boxed{xyz = 5}",
    "\\boxed 5$ is it",
    "\\boxed 5",
    "\\fbox{5}",
    "\\boxed{5 \\text{ cm}}",
    "\\boxed{5 \\text{ cm} \\text{ m}}",
    "\\boxed{10\\%}",
    "\\boxed{90^\\circ}",
    "\\boxed{90^{\\circ}}",
    "\\boxed{\\$1000}",
    "\\boxed{1,000}",
    "\\boxed{1000}",
    "\\boxed{\\sqrt}",
    "\\boxed{\\frac}",
    "\\boxed{\\frac1}",
    "\\boxed{5",
    "\\boxed{{5}}",
    "\\boxed{\\frac{\\sqrt{3}}{2}}",
    "\\boxed{\\frac{{1}}{2}}",
    "\\boxed{5}\nThat is all, thanks for asking.",
    "\\boxed{}",
    "\\boxed{a\\!b}",
    "no box at all",
    LONG + "\\boxed{\\frac{1}{2}}",
    "\\boxed{5} " + LONG,
]
MATH_TRUTHS = [
    "\\frac{1}{2}",
    "\\frac12",
    "5",
    "\\sqrt{2}^{3}",
    "(1,2)",
    "10",
    "90",
    "0.5",
    "1000",
    "5 \\text{ cm}",
    "\\sqrt",
]

DAPO_COMPLETIONS = [
    "Answer: 42",
    "answer : 42\nsome more",
    "ANSWER:42",
    "Answer: $\\frac{1}{2}$",
    "Answer: \\frac12",
    "Answer: \\dfrac{1}{2}",
    "Answer: 1,000",
    "Answer: 1,000.5",
    "Answer: x = 5",
    "Answer: 5 dollars",
    "Answer: 5.",
    "Answer: \\boxed{5}",
    "Answer: \\text{(A)}",
    "Answer: \\textbf{A}",
    "Answer: 0.50",
    "Answer: -3",
    "Answer: a 5",
    "Answer: 3\nAnswer: 42",
    "Answer: 90^\\circ",
    "Answer: $1$ and $2$",
    "The final result is \\boxed{42}",
    "The final result is \\boxed{\\frac{1}{2}} ok",
    "\\boxed{42}" + "." * 150,
    "\\boxed{4{2}}",
    "nothing",
    "",
    LONG + "Answer: 42",
    "Answer: 42\n" + LONG,
    LONG + "\\boxed{42}",
]
DAPO_TRUTHS = ["42", "\\frac{1}{2}", "1000", "5", "A", "0.5", "-3", "4{2}", "[INVALID]"]


@contextlib.contextmanager
def quiet():
    """verl's math scorer prints its exceptions."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


@pytest.fixture(scope="module")
def verl_scores():
    return import_reference("verl.utils.reward_score")


@pytest.fixture(scope="module")
def verl_modules():
    return {
        name: import_reference(f"verl.utils.reward_score.{name}")
        for name in ("gsm8k", "math_reward", "math_dapo", "search_r1_like_qa_em")
    }


def fuzz(pieces, n, seed):
    rng = random.Random(seed)
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 14))) for _ in range(n)]


PIECES = [
    "\\boxed{", "\\boxed ", "\\fbox{", "{", "}", "\\frac", "\\dfrac", "\\sqrt", "\\text{ ",
    "\\text{", "\\left", "\\right", "\\!", "\\%", "^\\circ", "\\$", "$", "#### ", "####",
    "Answer:", "answer :", "\n", " ", "=", "/", ",", ".", "-", "1", "2", "5", "0", "42", "1,000",
    "x", "a ", "cm", "<answer>", "</answer>", "the ", "Paris",
]  # fmt: skip


def test_gsm8k_matches_verl(verl_modules):
    ref = verl_modules["gsm8k"]
    for method in ("strict", "flexible"):
        for c in GSM8K_COMPLETIONS + fuzz(PIECES, 1500, 0):
            assert gsm8k.extract_solution(c, method) == ref.extract_solution(c, method), c
            for gt in GSM8K_TRUTHS:
                kw = dict(method=method, format_score=0.1, score=1.0)
                assert gsm8k.compute_score(c, gt, **kw) == ref.compute_score(c, gt, **kw), (c, gt)


def test_math_matches_verl(verl_modules):
    ref = verl_modules["math_reward"]
    completions = MATH_COMPLETIONS + fuzz(PIECES, 1500, 1)
    with quiet():
        for c in completions:
            assert math_reward.last_boxed_only_string(c) == ref.last_boxed_only_string(c), c
            for gt in MATH_TRUTHS:
                assert math_reward.compute_score(c, gt) == ref.compute_score(c, gt), (c, gt)
        # The normaliser on its own, including the inputs on which verl's raises.
        for s in MATH_TRUTHS + completions:
            try:
                expected = ref.strip_string(s)
            except Exception:
                with pytest.raises(Exception):  # noqa: B017 - verl raises assorted types
                    math_reward.strip_string(s)
            else:
                assert math_reward.strip_string(s) == expected, s


def test_math_dapo_matches_verl(verl_modules):
    ref = verl_modules["math_dapo"]
    assert list(math_dapo.SUBSTITUTIONS) == ref.SUBSTITUTIONS
    assert list(math_dapo.REMOVED_EXPRESSIONS) == ref.REMOVED_EXPRESSIONS
    for c in DAPO_COMPLETIONS + fuzz(PIECES, 1500, 2):
        assert math_dapo.normalize_final_answer(c) == ref.normalize_final_answer(c), c
        for gt in DAPO_TRUTHS:
            assert math_dapo.compute_score(c, gt) == ref.compute_score(c, gt), (c, gt)
            kw = dict(strict_box_verify=True)
            assert math_dapo.compute_score(c, gt, **kw) == ref.compute_score(c, gt, **kw)


def test_qa_em_matches_verl(verl_modules):
    ref = verl_modules["search_r1_like_qa_em"]
    completions = [
        "<answer>Paris</answer>",
        "<answer> the  Paris! </answer>",
        "<answer>London</answer> then <answer>paris</answer>",
        "<answer>\nThe Eiffel, Tower\n</answer>",
        "<answer>Paris</answer>" * 11,
        "<answer>Paris</answer>" + "</answer>" * 11,
        "no tags",
        "<answer>unclosed",
        *fuzz(PIECES, 500, 3),
    ]
    truths = [{"target": "Paris"}, {"target": ["London", "paris"]}, {"target": ["Eiffel Tower"]}]
    with quiet():
        for c in completions:
            for gt in truths:
                assert qa_em.compute_score(c, gt) == ref.compute_score(c, gt), (c, gt)
                assert qa_em.compute_score_subem(c, gt) == ref.compute_score_subem(c, gt)


SOURCES = [
    ("openai/gsm8k", GSM8K_COMPLETIONS, GSM8K_TRUTHS),
    ("lighteval/MATH", MATH_COMPLETIONS, MATH_TRUTHS),
    ("DigitalLearningGmbH/MATH-lighteval", MATH_COMPLETIONS[:8], MATH_TRUTHS[:3]),
    ("HuggingFaceH4/MATH-500", MATH_COMPLETIONS[:8], MATH_TRUTHS[:3]),
    ("math_dapo", DAPO_COMPLETIONS, DAPO_TRUTHS),
    ("math", DAPO_COMPLETIONS[:8], DAPO_TRUTHS[:3]),
    ("math_dapo_reasoning", DAPO_COMPLETIONS[:8], DAPO_TRUTHS[:3]),
    ("aime2024", DAPO_COMPLETIONS, DAPO_TRUTHS),
    ("searchR1_nq", ["<answer>Paris</answer>", "x"], [{"target": ["paris"]}]),
    ("searchR1_bamboogle", ["<answer>Rome</answer>"], [{"target": "rome"}]),
]


@pytest.mark.parametrize("source", [s[0] for s in SOURCES])
def test_default_compute_score_matches_verl(verl_scores, source):
    _, completions, truths = next(s for s in SOURCES if s[0] == source)
    with quiet():
        for c in completions:
            for gt in truths:
                ours = default_compute_score(source, c, gt, extra_info={"index": 0})
                ref = verl_scores.default_compute_score(source, c, gt, extra_info={"index": 0})
                assert ours == ref and type(ours) is type(ref), (c, gt, ours, ref)


@pytest.mark.parametrize("source", ["unknown/source", *sorted(NOT_PORTED)[:2]])
def test_unsupported_source_is_a_clear_error(verl_scores, source):
    with pytest.raises(NotImplementedError, match="custom_reward_function"):
        default_compute_score(source, "#### 1", "1")
    if source == "unknown/source":
        with pytest.raises(NotImplementedError):
            verl_scores.default_compute_score(source, "#### 1", "1")
