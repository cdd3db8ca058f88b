r"""MATH (Hendrycks): the last `\boxed{...}` against the reference after string normalisation
(verl 0.9.1's `reward_score.math_reward`, from EleutherAI's lm-evaluation-harness).

    answer = contents of the last \boxed{...} (braces balanced) or of "\boxed X$"
    score  = 1.0 if strip_string(answer) == strip_string(ground_truth) else 0.0

`strip_string` drops line breaks, `\!`, `\left`/`\right`, degrees, `\$`, `%`, spaces and a
right-hand `\text{ unit}`, rewrites `tfrac`/`dfrac` to `frac`, `\frac12` to `\frac{1}{2}`,
`\sqrt3` to `\sqrt{3}`, `0.5` and `a/b` (integers) to `\frac{.}{.}`, and a short `k = ` prefix
away. Where a normalisation step fails (verl's code raises on e.g. two `\text{ ` units or a
trailing `\sqrt`), the raw strings are compared instead; any other failure scores 0. These
quirks are kept on purpose: scores must equal verl's.
"""

from __future__ import annotations

from jaxrl.data.braces import balanced_from

_BOXED = "\\boxed"
_BOXED_SPACE = "\\boxed "
_BOXED_BRACE = "\\boxed{"


class _NotBoxed(ValueError):
    """The extracted span is not `\\boxed{...}` / `\\boxed ...` (e.g. an `\\fbox{...}`)."""


def last_boxed_only_string(string: str) -> str | None:
    r"""The last `\boxed{...}` (or `\fbox{...}`) with balanced braces, or `\boxed X` up to `$`.

    A `\boxed ` with a space anywhere takes precedence: everything after the last one up to
    the next `$` is the answer. Otherwise the scan starts at the last `\boxed` (or `\fbox`)
    and ends at the brace that closes the first one opened.
    """
    if _BOXED_SPACE in string:
        return _BOXED_SPACE + string.split(_BOXED_SPACE)[-1].split("$")[0]
    start = string.rfind(_BOXED)
    if start < 0:
        start = string.rfind("\\fbox")
        if start < 0:
            return None
    return balanced_from(string, start)


def remove_boxed(s: str) -> str:
    r"""The inside of `\boxed{...}` or what follows `\boxed `."""
    if _BOXED_SPACE in s:
        if not s.startswith(_BOXED_SPACE):
            raise _NotBoxed(s)
        return s[len(_BOXED_SPACE) :]
    if not (s.startswith(_BOXED_BRACE) and s.endswith("}")):
        raise _NotBoxed(s)
    return s[len(_BOXED_BRACE) : -1]


def _fix_fracs(string: str) -> str:
    r"""`\frac12` -> `\frac{1}{2}`, `\frac1{7}` -> `\frac{1}{7}`; `\frac{..` is kept.

    Raises IndexError on a `\frac` that ends the string (as verl's does).
    """
    head, *rest = string.split("\\frac")
    out = [head]
    for part in rest:
        out.append("\\frac")
        if part[0] == "{":
            out.append(part)
            continue
        if len(part) < 2:
            return string
        a, b, tail = part[0], part[1], part[2:]
        out.append("{" + a + "}" + (b if b == "{" else "{" + b + "}") + tail)
    return "".join(out)


def _fix_a_slash_b(string: str) -> str:
    r"""`3/4` -> `\frac{3}{4}` when both sides are plain integers."""
    parts = string.split("/")
    if len(parts) != 2:
        return string
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return string
    if string != f"{a}/{b}":
        return string
    return "\\frac{" + str(a) + "}{" + str(b) + "}"


def _remove_right_units(string: str) -> str:
    r"""Drop a right-hand `\text{ unit}`; two of them raise (as verl's assertion does)."""
    if "\\text{ " not in string:
        return string
    parts = string.split("\\text{ ")
    if len(parts) != 2:
        raise ValueError(f"more than one '\\text{{ ' unit in {string!r}")
    return parts[0]


def _fix_sqrt(string: str) -> str:
    r"""`\sqrt3` -> `\sqrt{3}`; raises IndexError on a `\sqrt` that ends the string."""
    if "\\sqrt" not in string:
        return string
    head, *rest = string.split("\\sqrt")
    out = [head]
    for part in rest:
        out.append("\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:]))
    return "".join(out)


# Plain substring replacements applied in order before the structural fixes.
_REPLACE_FIRST = (
    ("\n", ""),
    ("\\!", ""),
    ("\\\\", "\\"),
    ("tfrac", "frac"),
    ("dfrac", "frac"),
    ("\\left", ""),
    ("\\right", ""),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\$", ""),
)
_REPLACE_PERCENT = (("\\\\%", ""), ("\\%", ""), (" .", " 0."), ("{.", "{0."))


def strip_string(string: str) -> str:
    """Normalise a MATH answer (see the module docstring); may raise on malformed input."""
    for old, new in _REPLACE_FIRST:
        string = string.replace(old, new)
    string = _remove_right_units(string)
    for old, new in _REPLACE_PERCENT:
        string = string.replace(old, new)
    if not string:
        return string
    if string[0] == ".":
        string = "0" + string
    sides = string.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        string = sides[1]
    string = _fix_sqrt(string)
    string = string.replace(" ", "")
    string = _fix_fracs(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    return _fix_a_slash_b(string)


def is_equiv(str1: str | None, str2: str | None) -> bool:
    """Equal after `strip_string`; the raw strings are compared when normalising fails."""
    if str1 is None or str2 is None:
        return str1 is None and str2 is None
    try:
        return strip_string(str1) == strip_string(str2)
    except Exception:
        return str1 == str2


def compute_score(solution_str: str, ground_truth: str) -> float:
    r"""1.0 if the last `\boxed{}` answer is equivalent to `ground_truth`, else 0.0."""
    try:
        boxed = last_boxed_only_string(solution_str)
        if boxed is not None and is_equiv(remove_boxed(boxed), ground_truth):
            return 1.0
    except Exception:  # verl prints and scores 0 (e.g. an `\fbox{}` answer)
        pass
    return 0.0
