"""Rule-based scorers chosen by `data_source`, as verl 0.9.1's `default_compute_score` does.

| data_source                                                   | scorer                 |
|---------------------------------------------------------------|------------------------|
| `openai/gsm8k`                                                | `gsm8k` (strict)       |
| `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`,       | `math_reward` (MATH)   |
| `HuggingFaceH4/MATH-500`                                      |                        |
| `math_dapo`, `math`, `math_dapo_reasoning`, `aime*`           | `math_dapo` (dict)     |
| `searchR1_nq`, `searchR1_triviaqa`, ... (7 sources)           | `qa_em`                |
| `jaxrl/synthetic_{repeat,copy,reverse}` (jaxrl's own task)    | `synthetic`            |

verl's remaining sources (`numina_*` via prime_math, code contests via a sandbox or prime_code,
`hiyouga/geometry3k` via mathruler) are not ported: they raise `NotImplementedError` that says
to point `custom_reward_function.path` at a scorer (verl's own function works there).
"""

from __future__ import annotations

from typing import Any

from jaxrl.rewards.scorers import gsm8k, math_dapo, math_reward, qa_em, synthetic

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
MATH_DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")  # and every "aime*"
SEARCH_R1_SOURCES = tuple(
    "searchR1_" + s
    for s in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
)
SYNTHETIC_PREFIX = synthetic.DATA_SOURCE_PREFIX
NOT_PORTED = {
    **dict.fromkeys(
        (
            "numina_aops_forum",
            "numina_synthetic_math",
            "numina_amc_aime",
            "numina_synthetic_amc",
            "numina_cn_k12",
            "numina_olympiads",
        ),
        "prime_math",
    ),
    **dict.fromkeys(("codecontests", "apps", "codeforces", "taco"), "sandbox_fusion/prime_code"),
    "hiyouga/geometry3k": "geo3k",
}


def _select(data_source: str):
    if data_source in GSM8K_SOURCES:
        return gsm8k.compute_score
    if data_source in MATH_SOURCES:
        return math_reward.compute_score
    if data_source in MATH_DAPO_SOURCES or data_source.startswith("aime"):
        return math_dapo.compute_score
    if data_source in SEARCH_R1_SOURCES:
        return qa_em.compute_score
    if synthetic.is_synthetic(data_source):
        return synthetic.compute_score
    if data_source in NOT_PORTED:
        raise NotImplementedError(
            f"data_source {data_source!r} uses verl's {NOT_PORTED[data_source]} scorer, which "
            "jaxrl does not port; set custom_reward_function.path to a file whose function "
            "scores it (e.g. one that calls verl.utils.reward_score.default_compute_score)"
        )
    raise NotImplementedError(
        f"no rule-based scorer for data_source={data_source!r}; built in: "
        f"{[*GSM8K_SOURCES, *MATH_SOURCES, *MATH_DAPO_SOURCES, 'aime*', *SEARCH_R1_SOURCES]} "
        "and jaxrl/synthetic_*. "
        "Set custom_reward_function.path/name to score it with your own function"
    )


def _is_text_or_texts(x: Any) -> bool:
    return isinstance(x, str) or (
        isinstance(x, list | tuple) and all(isinstance(t, str) for t in x)
    )


def _type_problem(data_source: str, ground_truth: Any) -> str | None:
    if data_source in SEARCH_R1_SOURCES:
        if isinstance(ground_truth, dict) and _is_text_or_texts(ground_truth.get("target")):
            return None
        expected = "{'target': str or list of str}"
    elif data_source.startswith(SYNTHETIC_PREFIX) or isinstance(ground_truth, str):
        return None
    else:
        expected = "a string"
    return (
        f"data_source {data_source!r} needs reward_model.ground_truth to be {expected}, "
        f"got {ground_truth!r}"
    )


def ground_truth_problem(data_source: str, ground_truth: Any) -> str | None:
    """Why the built-in scorers cannot score `data_source` against `ground_truth`, or None.

    The math and gsm8k scorers compare strings (an int `72` would never equal the extracted
    "72": a silent zero reward), and Search-R1's read `ground_truth["target"]`, a string or a
    list of them. An unknown `data_source` is a problem too (no scorer).
    """
    try:
        _select(data_source)
    except NotImplementedError as e:
        return str(e)
    return _type_problem(data_source, ground_truth)


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float | dict[str, Any]:
    """Score one completion with the built-in scorer of its `data_source`.

    Args:
        data_source: The dataset name (the `data.reward_fn_key` column) that picks the scorer.
        solution_str: The decoded response.
        ground_truth: The reference answer (`reward_model.ground_truth` of the row).
        extra_info: The row's `extra_info` (read by the synthetic `add` task only).
        **kwargs: Accepted for verl's signature (sandbox settings); unused.

    Returns:
        A float, or a dict with a "score" key and extra entries (math_dapo's "acc", "pred").

    Raises:
        NotImplementedError: For a data source without a built-in scorer.
        TypeError: For a ground truth of the wrong type (`ground_truth_problem`).
    """
    del kwargs
    scorer = _select(data_source)
    if (problem := _type_problem(data_source, ground_truth)) is not None:
        raise TypeError(problem)
    if synthetic.is_synthetic(data_source):
        res = scorer(solution_str, ground_truth, data_source=data_source, extra_info=extra_info)
    else:
        res = scorer(solution_str, ground_truth)
    if isinstance(res, dict):
        return res
    if isinstance(res, int | float | bool):
        return float(res)
    return float(res[0])


__all__ = [
    "default_compute_score",
    "ground_truth_problem",
    "gsm8k",
    "math_dapo",
    "math_reward",
    "qa_em",
]
