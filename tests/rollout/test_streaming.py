"""Groups streamed through the engine's slots (`jaxrl.rollout.streaming`): greedy groups equal
`generate`'s rows, sampling and the kept set do not depend on the chunking or on which groups
finish first (the first kept in prompt order), the admission rule starts no more groups than
needed, and the stop, the group bound and the slot check."""

import itertools

import jax
import numpy as np
import pytest

from jaxrl.rollout import RolloutEngine, SamplingParams, generate
from jaxrl.rollout.streaming import stream_groups
from jaxrl.testing.numerics import LOG_PROB_ATOL


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("qwen2_sliding_yarn")[1:]


def batches(b=4, p=6, seed=0):
    """Endless left-padded prompt batches [b, p] (row 1 of each is shorter)."""
    for k in itertools.count():
        rng = np.random.RandomState(seed + k)
        ids = rng.randint(2, 97, (b, p))
        mask = np.ones_like(ids)
        mask[1, :2] = 0
        yield ids * mask, mask


def engine(tiny, slots=8):
    config, params = tiny
    eng = RolloutEngine(config, max_num_seqs=slots, max_model_len=32)
    eng.load_weights(params)
    return eng


def every(rule):
    """A judge that applies `rule` to each group of a round."""
    return lambda groups: [rule(g) for g in groups]


def sampling(**kw):
    return SamplingParams(**{"n": 2, "max_tokens": 6, "temperature": 1.0} | kw)


def test_greedy_groups_equal_generate(tiny):
    config, params = tiny
    sp = sampling(do_sample=False, temperature=0.0)
    result = stream_groups(engine(tiny), batches(), sp, jax.random.key(0), every(lambda g: True),
                           target=4)  # fmt: skip
    ids, mask = next(batches())
    out = generate(config, params, ids, mask, sp, jax.random.key(0))
    assert [(g.batch, g.row) for g in sorted(result.kept, key=lambda g: g.row)] == [
        (0, r) for r in range(4)
    ]
    for g in result.kept:
        rows = slice(2 * g.row, 2 * g.row + 2)
        np.testing.assert_array_equal(g.responses, np.asarray(out.responses)[rows])
        np.testing.assert_array_equal(g.response_mask, np.asarray(out.response_mask)[rows])
        # the same decode programs in another batch (jaxrl.testing.numerics.LOG_PROB_ATOL)
        np.testing.assert_allclose(g.log_probs, np.asarray(out.log_probs)[rows], atol=LOG_PROB_ATOL)
    stats = result.stats
    # every group kept: exactly the target started, nothing aborted
    assert (stats.started, stats.finished, stats.kept, stats.aborted) == (4, 4, 4, 0)
    assert (
        stats.sampled_tokens
        == stats.kept_tokens
        == sum(int(g.response_mask.sum()) for g in result.kept)
    )


def test_sampling_does_not_depend_on_chunks_or_slots(tiny):
    sp, key = sampling(), jax.random.key(3)

    def run(slots, chunk):
        eng = engine(tiny, slots)
        result = stream_groups(eng, batches(), sp, key, every(lambda g: g.sequence % 2 == 0),
                               target=3, chunk=chunk)  # fmt: skip
        assert eng.free_slots == eng.slots
        return {g.sequence: g.responses for g in result.kept}, result.stats

    (a, sa), (b, sb) = run(8, 2), run(4, 5)
    assert list(a) == list(b) == [0, 2, 4]  # the first three kept, in prompt order
    for seq in a:
        np.testing.assert_array_equal(a[seq], b[seq])
    assert sa.kept == sb.kept == 3 and sa.finished >= 5


def test_admission_follows_the_keep_rate_and_the_stop_aborts(tiny):
    # half of the groups are kept: after the first verdicts, twice the missing groups run
    eng = engine(tiny, slots=16)
    judged = []

    def judge(groups):
        judged.extend(groups)
        return [g.sequence % 2 == 1 for g in groups]

    result = stream_groups(eng, batches(b=3), sampling(), jax.random.key(1), judge, target=4)
    s = result.stats
    # the kept set: the first 4 kept prompts in order (1, 3, 5, 7), whichever ended first
    assert s.kept == 4 and [g.sequence for g in result.kept] == [1, 3, 5, 7]
    assert result.cut == 8 and s.dropped == 4  # 0, 2, 4, 6 judged and dropped
    assert s.started == s.finished + s.aborted and s.finished == len(judged)
    # every group the judge kept is trained on or surplus (kept past the cut)
    assert s.kept + s.surplus == sum(g.sequence % 2 for g in judged)
    assert s.batches == 3  # the batches of 3 prompts up to the cut
    assert s.sampled_tokens >= s.kept_tokens > 0
    assert eng.free_slots == eng.slots  # aborted groups' slots are free again


def test_max_groups_stops_short(tiny):
    result = stream_groups(engine(tiny), batches(), sampling(), jax.random.key(0),
                           every(lambda g: False), target=2, max_groups=5)  # fmt: skip
    assert result.kept == [] and result.cut is None
    assert result.stats.started == result.stats.finished == 5


def test_a_group_must_fit_the_slots(tiny):
    with pytest.raises(ValueError, match="max_num_seqs"):
        stream_groups(engine(tiny, slots=2), batches(), sampling(n=4), jax.random.key(0),
                      every(lambda g: True), target=1)  # fmt: skip
