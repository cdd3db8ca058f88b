"""The scorer of jaxrl's synthetic digit tasks (`jaxrl.data.synthetic` makes their rows).

Partial credit, so that even a random policy sees reward differences within a GRPO group: the
digits of the response are compared position by position with the answer's,

    score = #{i : response_digit[i] == answer_digit[i]} / max(len(answer digits), len(response
            digits))

which is 1.0 exactly when the response's digits are the answer (other tokens are ignored), and
0.0 without digits.
"""

from __future__ import annotations

import re
from typing import Any

from jaxrl.data.synthetic import DATA_SOURCE_PREFIX, DATA_SOURCES

__all__ = ["DATA_SOURCE_PREFIX", "compute_score", "is_synthetic"]

_DIGITS = re.compile(r"\d")


def is_synthetic(data_source: str) -> bool:
    """Whether `data_source` names one of the synthetic tasks."""
    return data_source in DATA_SOURCES


def compute_score(solution_str: str, ground_truth: str, **_: Any) -> float:
    """Partial-credit digit match in [0, 1] (see the module doc); 1.0 iff the response's digits
    are exactly the answer's."""
    want = _DIGITS.findall(str(ground_truth))
    got = _DIGITS.findall(solution_str)
    if not got or not want:
        return float(got == want)
    hits = sum(a == b for a, b in zip(got, want, strict=False))
    return hits / max(len(want), len(got))
