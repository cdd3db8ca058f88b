"""The `prime` manager: a raising, a hanging and a dying scorer score 0 and are counted; the
hung worker is killed and replaced; no worker process outlives the manager."""

import os
import time

import numpy as np
import pytest

from jaxrl.rewards import ParallelRewardManager, RewardInputs, load_custom_reward_fn
from jaxrl.rewards.managers import NaiveRewardManager
from jaxrl.rewards.parallel import ScoringPool

TIMEOUT_S = 1.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split()[2] != "Z"


def wait_gone(pids, seconds=5.0):
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def inputs_for(sources, responses, truths):
    b = len(sources)
    return RewardInputs(
        response_mask=np.ones((b, 3), np.int64),
        data_sources=sources,
        ground_truths=truths,
        responses=responses,
        extra_infos=[{"index": i} for i in range(b)],
    )


@pytest.fixture(scope="module")
def manager(scorers_file):
    fn = load_custom_reward_fn(scorers_file, "compute_score", {"bonus": 0.25})
    m = ParallelRewardManager(compute_score=fn, num_workers=2, timeout_s=TIMEOUT_S)
    yield m
    m.close()


def test_failures_are_counted_not_fatal(manager):
    sources = ["plain", "hang", "boom", "dict", "die", "plain", "nan_type", "plain"]
    responses = ["a", "a", "a", "a", "a", "b", "a", "a"]
    inputs = inputs_for(sources, responses, ["a"] * 8)
    start = time.monotonic()
    out = manager.submit(inputs).result(timeout=60)
    assert time.monotonic() - start < 30
    np.testing.assert_array_equal(out.reward_tensor[:, -1], [1.25, 0, 0, 1.25, 0, 0.25, 0, 1.25])
    assert out.metrics == {"reward/errors": 4.0, "reward/timeouts": 1.0}
    assert out.reward_extra_info["pred"] == [None, None, None, "a", None, None, None, None]


def test_same_scores_as_in_process(manager, scorers_file):
    sources = ["plain", "dict", "plain"] * 3
    inputs = inputs_for(sources, ["a", "b", "c"] * 3, ["a", "b", "x"] * 3)
    ours = manager(inputs)
    fn = load_custom_reward_fn(scorers_file, "compute_score", {"bonus": 0.25})
    ref = NaiveRewardManager(compute_score=fn)(inputs)
    np.testing.assert_array_equal(ours.reward_tensor, ref.reward_tensor)
    assert ours.reward_extra_info == ref.reward_extra_info
    assert ours.metrics["reward/errors"] == 0


def test_built_in_scorer_and_no_leaked_processes():
    inputs = inputs_for(["openai/gsm8k", "math_dapo"], ["#### 1,000", "Answer: 3"], ["1000", "4"])
    with ParallelRewardManager(num_workers=2, timeout_s=30) as m:
        out = m(inputs)
        pids = m.pool.pids
        assert len(pids) == 2 and all(alive(p) for p in pids)
    np.testing.assert_array_equal(out.reward_tensor[:, -1], [1.0, -1.0])
    assert wait_gone(pids) == []


def test_hung_worker_is_killed_on_close(scorers_file):
    fn = load_custom_reward_fn(scorers_file, "compute_score")
    pool = ScoringPool(fn, num_workers=1, timeout_s=TIMEOUT_S)
    call = dict(data_source="hang", solution_str="", ground_truth="", extra_info={})
    (result,) = pool.map([call])
    assert result.timed_out and "timed out" in result.error
    pids = pool.pids  # the replacement worker
    pool.close()
    assert wait_gone(pids) == []


def test_unpicklable_scorer_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot be pickled"):
        ParallelRewardManager(compute_score=lambda **kw: 1.0)
