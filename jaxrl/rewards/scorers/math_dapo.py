r"""DAPO math: `Answer: X` (Minerva normalisation), else the last `\boxed{}` verbatim
(verl 0.9.1's `reward_score.math_dapo`, used for `math_dapo`, `math`, `aime*`).

Only the last 300 characters of the completion are read. Then

    pred  = normalize(last match of (?i)Answer\s*:\s*([^\n]+))
    score = +1.0 if pred == normalize(ground_truth) else -1.0

and when no `Answer:` line exists, the last `\boxed{...}` among the final 100 characters is
compared with the ground truth *without* normalisation. The result is a dict
`{"score": ±1.0, "acc": bool, "pred": str | None}` (`pred` is "[INVALID]" when nothing was found).
"""

from __future__ import annotations

import re
from typing import Any

from jaxrl.data.braces import balanced_from

CLIP_CHARS = 300
STRICT_BOX_CHARS = 100
INVALID = "[INVALID]"
ANSWER_PATTERN = r"(?i)Answer\s*:\s*([^\n]+)"

# Applied in order (substring replacements, then removals), as in Minerva's normaliser.
SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
REMOVED_EXPRESSIONS = (
    *("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units"),
    *("\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm"),
    *("pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples"),
    *("\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}"),
    *("\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots"),
)
# (pattern, replacement) rewrites after the substitutions, in order.
_REWRITES = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),  # keep the first $...$ span
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),  # \fracab -> \frac{a}{b}
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),  # \sqrta -> \sqrt{a}
)


def last_boxed_only_string(string: str) -> str | None:
    r"""The last `\boxed{...}` with balanced braces, or None (no `\fbox`, no `\boxed `)."""
    start = string.rfind("\\boxed{")
    if start < 0:
        return None
    return balanced_from(string, start)


def remove_boxed(s: str) -> str:
    r"""The inside of `\boxed{...}`."""
    if not (s.startswith("\\boxed{") and s.endswith("}")):
        raise ValueError(f"box error: {s}")
    return s[len("\\boxed{") : -1]


def normalize_final_answer(final_answer: str) -> str:
    """Minerva's normalisation of a final answer (the right side of its last `=`)."""
    final_answer = final_answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        final_answer = final_answer.replace(expr, "")
    for pattern, repl in _REWRITES:
        final_answer = pattern.sub(repl, final_answer)
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


def is_correct_minerva(
    solution_str: str, gt: str, answer_pattern: str = ANSWER_PATTERN
) -> tuple[bool, str]:
    """(normalised last `Answer:` == normalised gt, the normalised prediction)."""
    found = re.findall(answer_pattern, solution_str)
    pred = normalize_final_answer(found[-1] if found else INVALID)
    return pred == normalize_final_answer(gt), pred


def is_correct_strict_box(
    pred: str, gt: str, pause_tokens_index: list[int] | None = None
) -> tuple[int, str | None]:
    r"""(1 if the last `\boxed{}` in the tail equals gt verbatim else -1, its content)."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index needs 4 entries, got {pause_tokens_index}")
        pred = pred[pause_tokens_index[-1] - STRICT_BOX_CHARS :]
    else:
        pred = pred[-STRICT_BOX_CHARS:]
    boxed = last_boxed_only_string(pred)
    extracted = remove_boxed(boxed) if boxed is not None else None
    return (1 if extracted == gt else -1), extracted


def verify(
    solution_str: str,
    answer: str,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> tuple[bool, str | None]:
    r"""Minerva's `Answer:` first; the strict `\boxed{}` check when there is none (or always,
    with `strict_box_verify`)."""
    if strict_box_verify:
        correct, pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
        return correct == 1, pred
    correct, pred = is_correct_minerva(solution_str, answer)
    if pred != INVALID:
        return correct, pred
    box_correct, box_pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
    if box_pred is not None:
        return box_correct == 1, box_pred
    return correct, pred


def compute_score(
    solution_str: str,
    ground_truth: str,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> dict[str, Any]:
    """`{"score": +1.0 / -1.0, "acc": bool, "pred": str | None}` (see the module docstring)."""
    correct, pred = verify(
        solution_str[-CLIP_CHARS:], ground_truth, strict_box_verify, pause_tokens_index
    )
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
