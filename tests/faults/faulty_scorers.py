"""Scoring functions that fail on purpose (loaded by path as `custom_reward_function.path`).

`compute_score(..., fault=...)`: every call scores 1.0 except
    raise   every 10th call in this process raises
    nan     every 4th call returns NaN; every 5th returns inf
    hang    the first call (across processes: the one that creates `marker`) sleeps an hour
`compute_score_batch`: returns one score fewer than it was given.
"""

from __future__ import annotations

import math
import os
import time

_calls = [0]


def compute_score(data_source, solution_str, ground_truth, extra_info=None, fault="", marker=""):
    _calls[0] += 1
    n = _calls[0]
    if fault == "raise" and n % 10 == 0:
        raise ValueError(f"scorer failed on call {n}")
    if fault == "nan" and n % 4 == 0:
        return math.nan
    if fault == "nan" and n % 5 == 0:
        return math.inf
    if fault == "hang":
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return 1.0
        time.sleep(3600)
    return 1.0


def compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    return [1.0] * (len(solution_strs) - 1)
