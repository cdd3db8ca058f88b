"""DAPO's dynamic sampling (`jaxrl.trainer.dynamic_sampling`) against verl's DAPO recipe.

The recipe's filter lives in `recipe/dapo/dapo_ray_trainer.py` (`RayDAPOTrainer.fit`), which the
verl wheel does not ship, so `recipe_step` restates it here on plain arrays: per generation
batch, group the metric values by uid, keep uids with `np.std(values) > 0 or len == 1` in
first-appearance order, keep their rows in row order, append to the batch, and once
`train_batch_size` prompts are kept cut it to `train_batch_size * n` rows; past
`max_num_gen_batches` (if > 0) raise.
"""

from collections import defaultdict

import jax
import numpy as np
import pytest

import jaxrl.trainer.dynamic_sampling as dynamic_sampling
from jaxrl.data.batch import PromptBatch
from jaxrl.rollout.streaming import GroupRollout, StreamStats
from jaxrl.trainer.dynamic_sampling import (
    DynamicSamplingError,
    GroupJudge,
    GroupPool,
    KeptGroup,
    assemble,
    kept_rows,
    metric_values,
    stream_metrics,
)


def recipe_step(gen_batches, train_batch_size, n, max_num_gen_batches):
    """The recipe's accumulation over generation batches [(uids, values, row labels)]:
    (row labels trained on, num_gen_batches)."""
    batch, num_prompts, num_gen_batches = [], 0, 0
    for uids, values, labels in gen_batches:
        num_gen_batches += 1
        by_uid = defaultdict(list)
        for uid, value in zip(uids, values, strict=True):
            by_uid[uid].append(value)
        kept = [u for u, v in by_uid.items() if np.std(v) > 0 or len(v) == 1]
        num_prompts += len(kept)
        batch += [label for uid, label in zip(uids, labels, strict=True) if uid in kept]
        if num_prompts < train_batch_size:
            if max_num_gen_batches <= 0 or num_gen_batches < max_num_gen_batches:
                continue
            raise ValueError(f"{num_gen_batches=} >= {max_num_gen_batches=}.")
        return batch[: train_batch_size * n], num_gen_batches
    raise AssertionError("ran out of generation batches")


def gen_batch(seed, prompts=4, n=3, tie_rate=0.5):
    """One generation batch: interleaved groups of n responses, values with whole-group ties
    (all equal), NaNs and mixed groups; rows labelled (seed, row)."""
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 2, (prompts, n)).astype(np.float64)
    values[rng.random(prompts) < tie_rate] = 1.0
    if seed % 2:
        values[0, 0] = np.nan  # a NaN std: dropped
    uids = np.repeat([f"{seed}-{p}" for p in range(prompts)], n)
    group_ids = np.repeat(np.arange(prompts), n)
    return uids, group_ids, values.ravel(), [(seed, i) for i in range(prompts * n)]


def masked(rows):
    """`rows` with the prompt mask every step's rows have (one prompt token) if they lack it."""
    return {"prompt_mask": np.ones((len(rows["group_ids"]), 1), np.int32), **rows}


def jaxrl_step(batches, train_batch_size, n, max_num_gen_batches):
    """The trainer's loop (`PPOTrainer._dynamic_sampling`) over fixed generation batches."""
    pool = GroupPool()
    for _, group_ids, values, labels in batches:
        rows = masked({"group_ids": group_ids, "label": np.asarray(labels),
                       "response_mask": np.ones((len(group_ids), 2), np.int32)})  # fmt: skip
        pool.add(rows, {"value": list(values)}, None, values)
        if pool.full(train_batch_size, max_num_gen_batches):
            kept = pool.take(train_batch_size)
            return [tuple(x) for x in kept.rows["label"]], pool, kept.rows, kept.extra
    raise AssertionError("ran out of generation batches")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("train_batch_size", [1, 3, 5])
def test_kept_rows_equal_the_recipes(seed, train_batch_size):
    n = 3
    batches = [gen_batch(seed * 10 + k, n=n) for k in range(12)]
    want, num_gen_batches = recipe_step(
        [(u, v, lab) for u, _, v, lab in batches], train_batch_size, n, 0
    )
    got, pool, rows, extra = jaxrl_step(batches, train_batch_size, n, 0)
    assert got == want
    assert pool.metrics(train_batch_size)["train/num_gen_batches"] == num_gen_batches
    # group ids: 0, 1, ... per kept group in order, n rows each; extra info follows the rows
    np.testing.assert_array_equal(rows["group_ids"], np.repeat(np.arange(train_batch_size), n))
    labels = {lab: v for _, _, vals, labs in batches for lab, v in zip(labs, vals, strict=True)}
    np.testing.assert_array_equal(extra["value"], [labels[x] for x in got])


def test_singletons_are_kept_and_nan_groups_dropped():
    group_ids = np.array([0, 0, 1, 2, 2, 3, 3])
    values = np.array([1.0, 1.0, 0.0, 0.0, 1.0, np.nan, 1.0])
    rows, kept = kept_rows(group_ids, values)
    np.testing.assert_array_equal(rows, [2, 3, 4])
    assert kept == 2


def test_a_tied_group_of_non_dyadic_scores_is_dropped_unlike_the_float32_recipe():
    """The one documented difference from verl's recipe: it takes np.std of the float32
    summed scores, where six responses all scoring 0.6 have std 6e-8 (the float32 mean is
    off by an ulp), so the recipe keeps a group whose GRPO advantages are 0; jaxrl's float64
    std is 0 and drops it."""
    group_ids = np.zeros(6, np.int64)
    scores = np.full(6, 0.6, np.float32)  # the recipe's values: float32 token sums
    assert np.std(list(scores)) > 0  # the recipe's rule keeps it
    rows, kept = kept_rows(group_ids, scores)
    assert kept == 0 and rows.size == 0


def test_cap_raises_verls_error_after_the_capth_batch():
    batches = [gen_batch(k, tie_rate=1.0) for k in range(1, 4)]  # every group tied: none kept
    for batch in batches:
        batch[2][:] = 1.0
    with pytest.raises(ValueError, match="num_gen_batches=2 >= max_num_gen_batches=2"):
        recipe_step([(u, v, lab) for u, _, v, lab in batches], 2, 3, 2)
    with pytest.raises(DynamicSamplingError, match="num_gen_batches=2 >= max_num_gen_batches=2"):
        jaxrl_step(batches, 2, 3, 2)


def test_surplus_and_eviction_counts():
    pool = GroupPool()
    group_ids = np.repeat(np.arange(4), 2)
    values = np.array([0, 1, 1, 1, 0, 1, 0, 1], np.float64)  # group 1 tied
    lengths = np.array([1, 2, 3, 3, 1, 1, 2, 2])  # 15 tokens, every group's
    mask = (np.arange(3) < lengths[:, None]).astype(np.int32)
    pool.add(masked({"group_ids": group_ids, "response_mask": mask}), {},
             [{"i": i} for i in range(8)], values)  # fmt: skip
    kept = pool.take(2)
    np.testing.assert_array_equal(kept.rows["group_ids"], [0, 0, 1, 1])
    np.testing.assert_array_equal(kept.lengths[1], [1, 2, 1, 1])
    assert kept.owners is None  # one process: the rows are the batch
    assert pool.metrics(2) == {
        "train/num_gen_batches": 1.0,
        "training/filter_groups/evicted_samples": 1.0,
        "training/filter_groups/discarded_surplus_samples": 1.0,
        "training/filter_groups/sampled_tokens_per_group": 15 / 2,  # over the trained groups
    }
    assert [c["i"] for c in kept.conversations] == [0, 1, 4, 5]


def test_extra_info_keys_missing_in_a_batch_are_none():
    pool = GroupPool()
    two = masked({"group_ids": np.array([0, 0]), "response_mask": np.ones((2, 1), np.int32)})
    pool.add(two, {"acc": [0, 1]}, None, np.array([0.0, 1.0]))
    pool.add(dict(two), {"pred": ["a", "b"]}, None, np.array([0.0, 1.0]))
    assert pool.take(2).extra == {"acc": [0, 1, None, None], "pred": [None, None, "a", "b"]}


def test_metric_values():
    scores = np.array([[0.0, 1.0], [0.5, 0.0]], np.float32)
    np.testing.assert_array_equal(metric_values("seq_reward", scores, {}), [1.0, 0.5])
    np.testing.assert_array_equal(metric_values("reward", scores, {}), [1.0, 0.5])
    np.testing.assert_array_equal(metric_values("acc", scores, {"acc": [True, False]}), [1, 0])
    with pytest.raises(DynamicSamplingError, match=r"metric='score'.*\['acc'\]"):
        metric_values("score", scores, {"acc": [1, 0]})


def test_rows_of_different_widths_concatenate_with_their_padding():
    pool = GroupPool()
    a = {"prompts": np.array([[0, 5], [0, 6]]), "prompt_mask": np.array([[0, 1], [0, 1]]),
         "responses": np.array([[7], [8]]), "response_mask": np.array([[1], [1]]),
         "group_ids": np.array([0, 0])}  # fmt: skip
    b = {"prompts": np.array([[9], [9]]), "prompt_mask": np.array([[1], [1]]),
         "responses": np.array([[1, 2], [3, 0]]), "response_mask": np.array([[1, 1], [1, 0]]),
         "group_ids": np.array([0, 0])}  # fmt: skip
    pool.add(a, {}, None, np.array([0.0, 1.0]))
    pool.add(b, {}, None, np.array([1.0, 0.0]))
    rows = pool.take(2).rows
    np.testing.assert_array_equal(rows["prompts"], [[0, 5], [0, 6], [0, 9], [0, 9]])
    np.testing.assert_array_equal(rows["responses"], [[7, 0], [8, 0], [1, 2], [3, 0]])
    np.testing.assert_array_equal(rows["group_ids"], [0, 0, 1, 1])


def prompt_batch(width, rows=3, offset=0):
    ids = np.arange(offset, offset + rows * width).reshape(rows, width) + 2
    obj = np.empty(rows, object)
    return PromptBatch(
        input_ids=ids, attention_mask=np.ones_like(ids), group_ids=np.arange(rows),
        uid=obj, row_ids=np.arange(rows), data_source=obj, ground_truth=np.arange(rows) + offset,
        ability=obj, extra_info=obj, raw_prompt=obj, is_padding=np.zeros(rows, bool),
    )  # fmt: skip


def test_group_judge_scores_keeps_and_concatenates():
    """The stream's judge: each group scored with its own prompt's row (the batch it came
    from), kept when its metric varies, rows in the order kept (prompts of another width
    left-padded) with the trainer's host fields of their prompts (a distillation teacher's
    route), reward metrics summed, scoring time under `reward`."""
    calls = []

    def reward_fn(prompts, responses, mask):
        calls.append(prompts.ground_truth.tolist())
        scores = np.zeros(mask.shape, np.float32)
        scores[:, 0] = responses[:, 0] % 2  # odd first token: 1
        return scores, {"reward/errors": 1.0}, {"first": responses[:, 0].tolist()}

    timing = {}
    routes = lambda prompts: {"teacher_route": prompts.ground_truth.astype(np.int32)}  # noqa: E731
    judge = GroupJudge(reward_fn, "seq_reward", timing, routes)
    stream = judge.batches(prompt_batch(2), iter([prompt_batch(3, offset=10)]))
    first_ids, _ = next(stream)
    second_ids, _ = next(stream)
    assert first_ids.shape == (3, 2) and second_ids.shape == (3, 3)

    def group(batch, row, firsts):  # batches of 3 prompts: prompt 3 * batch + row
        responses = np.array([[f, 5] for f in firsts], np.int32)
        mask = np.ones_like(responses)
        zeros = np.zeros(mask.shape, np.float32)
        return GroupRollout(batch, row, 3 * batch + row, responses, mask, zeros)

    assert judge([group(1, 2, [3, 4])]) == [True]  # scores 1, 0: kept
    # one round, groups of two batches: a reward call per batch, verdicts in order
    assert judge([group(0, 1, [2, 4]), group(1, 0, [7, 7]), group(0, 0, [5, 6])]) == [
        False,  # both 0: dropped
        False,  # both 1
        True,
    ]
    # each group's own prompt, n times; batch 0's groups scored together
    assert calls == [[12, 12], [1, 1, 0, 0], [10, 10]]
    kept = judge.take(None, whole_fields=("teacher_route",))  # prompt order: 0, then 5
    rows, extra, metrics = kept.rows, kept.extra, kept.metrics
    np.testing.assert_array_equal(rows["group_ids"], [0, 0, 1, 1])
    np.testing.assert_array_equal(rows["prompts"][0], np.concatenate([[0], first_ids[0]]))
    np.testing.assert_array_equal(rows["prompts"][2], second_ids[2])
    np.testing.assert_array_equal(rows["token_level_scores"][:, 0], [1, 0, 1, 0])
    np.testing.assert_array_equal(rows["teacher_route"], [0, 0, 12, 12])  # each group's prompt
    np.testing.assert_array_equal(kept.whole["teacher_route"], rows["teacher_route"])
    assert extra == {"first": [5, 6, 3, 4]}
    assert metrics == {"reward/errors": 3.0} and timing["reward"] > 0
    one = judge.take(1).rows  # the kept before the cut only: a surplus past it is dropped
    np.testing.assert_array_equal(one["responses"], rows["responses"][:2])


class _Loader:
    """A prompt source with a loader's state (its position)."""

    def __init__(self):
        self.position = 0

    def __next__(self):
        self.position += 1
        return prompt_batch(2, offset=10 * self.position)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_group_judge_settles_the_loader_at_the_cut():
    """Batches drawn past the stream's cut go back to the loader; batches before the cut
    that this process never reached (another process's prompts decided it) are drawn."""
    loader = _Loader()
    judge = GroupJudge(None, "acc", {})
    stream = judge.batches(prompt_batch(2), loader)
    for _ in range(3):  # the first batch and 2 from the loader
        next(stream)
    judge.settle(2)  # the cut in batch 1: batch 2 goes back
    assert loader.position == 1
    loader, judge = _Loader(), GroupJudge(None, "acc", {})
    next(judge.batches(prompt_batch(2), loader))
    judge.settle(3)  # the cut in batch 2, never reached here
    assert loader.position == 2


def test_group_judge_without_more_prompts_names_the_fix():
    stream = GroupJudge(None, "acc", {}).batches(prompt_batch(2), None)
    next(stream)
    with pytest.raises(ValueError, match="prompt_source"):
        next(stream)


def test_stream_metrics():
    stats = StreamStats(batches=3, started=9, finished=7, kept=4, dropped=2, surplus=1,
                        aborted=2, sampled_tokens=60)  # fmt: skip
    assert stream_metrics(stats, 4) == {
        "train/num_gen_batches": 3.0,
        "training/filter_groups/evicted_samples": 2.0,  # dropped by the filter
        "training/filter_groups/discarded_surplus_samples": 1.0,
        "training/filter_groups/aborted_groups": 2.0,
        "training/filter_groups/sampled_tokens_per_group": 15.0,
    }


def random_group(rng, key):
    """A kept group of 1-4 rows with random column widths, extra info and conversations."""
    size, p, r = rng.integers(1, 5, 3)
    rows = {
        "prompts": rng.integers(2, 99, (size, p)), "prompt_mask": rng.integers(0, 2, (size, p)),
        "responses": rng.integers(2, 99, (size, r)), "response_mask": rng.integers(0, 2, (size, r)),
        "token_level_scores": rng.random((size, r)).astype(np.float32),
        "teacher_route": rng.integers(0, 3, size).astype(np.int32),
        "group_ids": np.zeros(size, np.int32),
    }  # fmt: skip
    extra = {
        k: [f"{k}{key}{i}" for i in range(size)] for k in ("acc", "pred") if rng.random() < 0.7
    }
    return KeptGroup(key, rows, extra, [{"row": (key, i)} for i in range(size)])


class _Captured(Exception):
    pass


def assemble_on_processes(monkeypatch, own, limit, widths, metrics, **kw):
    """`assemble` on each of len(own) simulated processes (`own[p]`: process p's groups,
    `widths[p]`, `metrics[p]` its arguments), with its all-gather answered by every process's
    payload: each process's result."""
    payloads = []

    def call(p, gather):
        monkeypatch.setattr(jax, "process_index", lambda: p)
        monkeypatch.setattr(dynamic_sampling, "allgather_objects", gather)
        return assemble(own[p], limit, widths=widths[p], metrics=metrics[p], **kw)

    def capture(obj):
        payloads.append(obj)
        raise _Captured

    monkeypatch.setattr(jax, "process_count", lambda: len(own))
    for p in range(len(own)):
        with pytest.raises(_Captured):
            call(p, capture)
    got = [call(p, lambda obj: list(payloads)) for p in range(len(own))]
    monkeypatch.undo()
    return got


def test_kept_groups_of_several_processes_assemble_to_the_one_process_batch(monkeypatch):
    """Property: kept groups of random sizes, widths and extra keys, spread at random over 2
    or 3 (simulated) processes. Each process's `assemble` keeps only its own rows, and those
    rows put at `owners`' places are the one process's batch (padding included); the extra
    info, lengths, teachers, conversations and summed metrics every process gets are the one
    process's too."""
    rng = np.random.default_rng(0)
    kw = {"whole_fields": ("teacher_route",), "conversations": True}
    for _ in range(25):
        processes = int(rng.integers(2, 4))
        keys = sorted({(int(rng.integers(0, 3)), int(rng.integers(0, 40))) for _ in range(8)})
        groups = [random_group(rng, tuple(key)) for key in rng.permutation(np.array(keys))]
        owner = rng.integers(0, processes, len(groups))
        limit = int(rng.integers(1, len(groups) + 1))
        widths = [{"responses": int(rng.integers(0, 6))} for _ in range(processes)]
        metrics = [{"reward/errors": float(p + 1)} for p in range(processes)]
        widest = {"responses": max(w["responses"] for w in widths)}
        total = {"reward/errors": float(sum(range(1, processes + 1)))}
        want = assemble(groups, limit, widths=widest, metrics=total, **kw)
        own = [[g for g, o in zip(groups, owner, strict=True) if o == p] for p in range(processes)]
        got = assemble_on_processes(monkeypatch, own, limit, widths, metrics, **kw)
        owners = got[0].owners
        assert len(owners.owner) == len(want.rows["responses"])
        for name, value in want.rows.items():
            batch = [got[p].rows[name][i] for p, i in zip(owners.owner, owners.local, strict=True)]
            np.testing.assert_array_equal(np.stack(batch), value, err_msg=name)
        # where the devices cannot place them, every process gathers the rows (the same batch)
        monkeypatch.setattr(jax, "process_count", lambda processes=processes: processes)
        every = {k: np.concatenate([part.rows[k] for part in got]) for k in want.rows}
        monkeypatch.setattr(dynamic_sampling, "gather_rows", lambda rows, every=every: every)
        gathered = got[1].batch_rows()
        monkeypatch.undo()
        for name, value in want.rows.items():
            np.testing.assert_array_equal(gathered[name], value, err_msg=name)
        for p in range(processes):  # the rows a process holds are its own groups' only
            assert len(got[p].rows["responses"]) == (owners.owner == p).sum()
            assert got[p].extra == want.extra and got[p].conversations == want.conversations
            assert got[p].metrics == want.metrics
            np.testing.assert_array_equal(got[p].owners.owner, owners.owner)
            for j in (0, 1):
                np.testing.assert_array_equal(got[p].lengths[j], want.lengths[j])
            np.testing.assert_array_equal(got[p].whole["teacher_route"],
                                          want.whole["teacher_route"])  # fmt: skip
