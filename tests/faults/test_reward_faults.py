"""Scoring functions that raise, hang, return NaN / inf, or return the wrong number of scores:
each row is named in a warning (the first three, then a count), counted in `reward/errors` /
`reward/timeouts`, scored `reward_model.error_score`, and never stalls a step beyond its
timeout."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest

from jaxrl.rewards import RewardInputs
from jaxrl.rewards.custom import load_custom_reward_fn
from jaxrl.rewards.managers import BatchRewardManager, NaiveRewardManager
from jaxrl.rewards.parallel import ParallelRewardManager

pytestmark = pytest.mark.faults

SCORERS = str(Path(__file__).with_name("faulty_scorers.py"))


def inputs(rows: int) -> RewardInputs:
    return RewardInputs(
        response_mask=np.ones((rows, 2)),
        data_sources=["s"] * rows,
        ground_truths=["x"] * rows,
        responses=["x"] * rows,
    )


def scores(out) -> np.ndarray:
    return out.reward_tensor[:, -1]


@pytest.mark.fault(
    fault="A scoring function that raises for 1 in 10 samples",
    outcome=(
        "Those rows score `reward_model.error_score`, are counted in `reward/errors`, the first "
        "three named in a warning and the rest summed up in one line"
    ),
    lost="Those rows' rewards",
)
def test_raising_one_in_ten_is_counted_named_and_summarised(caplog):
    fn = load_custom_reward_fn(SCORERS, "compute_score", {"fault": "raise"})
    manager = NaiveRewardManager(compute_score=fn, error_score=-1.0)
    with caplog.at_level(logging.WARNING):
        out = manager(inputs(50))
    expected = np.where(np.arange(1, 51) % 10 == 0, -1.0, 1.0)
    np.testing.assert_array_equal(scores(out), expected)
    assert out.metrics == {"reward/errors": 5.0, "reward/timeouts": 0.0}
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("scored -1: ValueError: scorer failed" in w for w in warnings) == 3
    assert any("and 2 more rows (reward/errors=5 of 50 rows" in w for w in warnings)


@pytest.mark.fault(
    fault="A scoring function that returns NaN or inf",
    outcome=(
        "Counted as errors and scored `reward_model.error_score`; no non-finite reward reaches "
        "the advantages"
    ),
    lost="Those rows' rewards",
)
def test_nan_and_inf_scores_get_the_error_score():
    fn = load_custom_reward_fn(SCORERS, "compute_score", {"fault": "nan"})
    out = NaiveRewardManager(compute_score=fn, error_score=0.25)(inputs(20))
    calls = np.arange(1, 21)
    bad = (calls % 4 == 0) | (calls % 5 == 0)
    np.testing.assert_array_equal(scores(out), np.where(bad, 0.25, 1.0))
    assert np.isfinite(out.reward_tensor).all()
    assert out.metrics["reward/errors"] == float(bad.sum())


@pytest.mark.fault(
    fault="A batch scoring function that returns the wrong number of scores",
    outcome="Every row of the batch is an error with the counts in the message",
    lost="That batch's rewards",
)
def test_wrong_number_of_batch_scores():
    fn = load_custom_reward_fn(SCORERS, "compute_score_batch")
    out = BatchRewardManager(compute_score=fn, error_score=-2.0)(inputs(6))
    np.testing.assert_array_equal(scores(out), -2.0)
    assert out.metrics["reward/errors"] == 6.0


@pytest.mark.fault(
    fault=(
        "A scoring function that hangs (naive manager with `compute_score_timeout`, prime manager"
        " with `timeout_s`)"
    ),
    outcome=(
        "The row times out (the prime worker is killed and replaced), is counted in "
        "`reward/timeouts`, and the step goes on"
    ),
    lost="That row's reward and the timeout's seconds",
)
def test_a_hanging_scorer_costs_its_timeout_and_no_more(tmp_path):
    kwargs = {"fault": "hang", "marker": str(tmp_path / "hung")}
    fn = load_custom_reward_fn(SCORERS, "compute_score", kwargs)
    started = time.monotonic()
    out = NaiveRewardManager(compute_score=fn, compute_score_timeout=1.0)(inputs(4))
    assert time.monotonic() - started < 10
    np.testing.assert_array_equal(scores(out), [0.0, 1.0, 1.0, 1.0])
    assert out.metrics == {"reward/errors": 1.0, "reward/timeouts": 1.0}
    (tmp_path / "hung").unlink()
    started = time.monotonic()
    with ParallelRewardManager(compute_score=fn, num_workers=2, timeout_s=2.0) as prime:
        out = prime(inputs(8))
    assert time.monotonic() - started < 15
    assert out.metrics == {"reward/errors": 1.0, "reward/timeouts": 1.0}
    assert sorted(scores(out)) == [0.0] + [1.0] * 7
