"""The request scheduler over the engine's slots: requests with their own sampling settings
share one engine (more of them than slots) and each gets the turn it gets decoded alone;
tokens stream chunk by chunk; groups of copies, kept-open conversations with appended tokens,
abort, weights versions, batch requests on either path, and bad calls."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl.rollout import RolloutEngine, SamplingParams
from jaxrl.rollout.scheduler import Scheduler
from jaxrl.testing.numerics import LOG_PROB_ATOL

GREEDY = dict(do_sample=False, temperature=0.0, ignore_eos=True)
# Tokens are compared exactly; log-probs from another program (another prompt padding, other
# companions) at LOG_PROB_ATOL (its reason: jaxrl.testing.numerics).


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("llama_gqa_bias_llama3")[1:]


def engine(config, params, version=None, **kw):
    eng = RolloutEngine(config, None, **(dict(max_num_seqs=4, max_model_len=64) | kw))
    eng.load_weights(params, version=version)
    return eng


def alone(config, params, prompt, sampling, key, appended=None, second=None):
    """The turn (tokens, log-probs) a fresh engine decodes for one prompt; with `appended`
    and `second` (sampling, key), the turn after those tokens are appended."""
    eng = engine(config, params)
    slot = eng.start(np.asarray([prompt]), np.ones((1, len(prompt)), np.int32))
    turn = eng.decode(slot, sampling, key[None])
    if appended is not None:
        eng.append(slot, [appended])
        turn = eng.decode(slot, second[0], second[1][None])
    return turn.tokens[0], turn.log_probs[0]


def assert_turn(handle, want):
    np.testing.assert_array_equal(handle.tokens, want[0], err_msg=str(handle.sampling))
    np.testing.assert_allclose(handle.log_probs, want[1], atol=LOG_PROB_ATOL)


def test_requests_with_their_own_settings_share_the_engine(tiny):
    """Six requests of different prompts and settings on four slots: the last two wait for
    free slots; each turn streams in chunks and equals the one decoded alone; each records
    the weights version (per token: a turn running over a push has both) and frees its
    slot."""
    config, params = tiny
    rng = np.random.RandomState(0)
    prompts = [rng.randint(2, 97, n).tolist() for n in (7, 4, 9, 5, 7, 3)]
    settings = [
        SamplingParams(max_tokens=6, **GREEDY),
        SamplingParams(max_tokens=9, temperature=0.7, top_k=5, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=1.2, top_p=0.8, ignore_eos=True),
        SamplingParams(max_tokens=13, temperature=1.0, ignore_eos=True),
        SamplingParams(max_tokens=3, **GREEDY),
        SamplingParams(max_tokens=8, temperature=0.9, top_k=3, top_p=0.9, ignore_eos=True),
    ]
    keys = [jax.random.key(10 + i) for i in range(6)]
    eng = engine(config, params, version=7)
    scheduler = Scheduler(eng, chunk=4)
    requests = zip(prompts, settings, keys, strict=True)
    handles = [scheduler.submit(p, sp, k)[0] for p, sp, k in requests]
    seen = []  # request 3's tokens after each step: it streams, 4 at a time
    while scheduler.busy:
        scheduler.step()
        assert eng.free_slots + len(scheduler._running) == 4
        seen.append(len(handles[3].tokens))
        if len(seen) == 2:  # a push (the same weights) with turns in flight: they go on
            eng.load_weights(params, version=8)
    assert seen[:4] == [4, 8, 12, 13] and handles[3].finish_reason == "length"
    assert handles[3].versions == handles[3].record.versions == [7] * 8 + [8] * 5
    assert handles[0].versions == [7] * 6 and handles[5].versions == [8] * 8  # before, after
    for h, p, sp, k in zip(handles, prompts, settings, keys, strict=True):
        assert_turn(h, alone(config, params, p, sp, jax.random.fold_in(k, 0)))  # copy 0
        assert len(h.tokens) == sp.max_tokens and h.done and h.version == h.versions[0]
        assert set(h.versions) <= {7, 8} and h.versions == sorted(h.versions)
        assert h.slot is None and h.record.prompt == p and h.record.response == h.tokens
    assert eng.free_slots == 4


def test_few_running_slots_decode_as_a_batch_of_their_own(tiny):
    """An engine of 40 slots with 3 turns running decodes them as a batch of 16 rows (their
    cache rows gathered and put back, `conversation.decode_rows`): each turn equals the one
    a 4-slot engine decodes alone (all its slots' rows), the other slots untouched."""
    config, params = tiny
    rng = np.random.RandomState(1)
    prompts = [rng.randint(2, 97, n).tolist() for n in (6, 3, 8)]
    sp = SamplingParams(max_tokens=7, temperature=1.0, ignore_eos=True)
    keys = [jax.random.key(20 + i) for i in range(3)]
    eng = engine(config, params, max_num_seqs=40)
    scheduler = Scheduler(eng, chunk=3)
    handles = [scheduler.submit(p, sp, k)[0] for p, k in zip(prompts, keys, strict=True)]
    scheduler.run(handles)
    for h, p, k in zip(handles, prompts, keys, strict=True):
        assert_turn(h, alone(config, params, p, sp, jax.random.fold_in(k, 0)))
    assert eng.free_slots == 40


def test_groups_conversations_and_abort(tiny):
    config, params = tiny
    prompt = [5, 9, 13, 2, 40, 41, 7]
    sp = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    key = jax.random.key(3)
    eng = engine(config, params)
    scheduler = Scheduler(eng, chunk=None)

    # A group: copy j samples with fold_in(key, j), its prompt prefilled once.
    group = scheduler.run(scheduler.submit(prompt, sp, key, copies=3))
    for j, h in enumerate(group):
        assert_turn(h, alone(config, params, prompt, sp, jax.random.fold_in(key, j)))
    assert len({tuple(h.tokens) for h in group}) > 1

    # A conversation kept open: a turn, a tool's output appended, the next turn.
    greedy = SamplingParams(max_tokens=5, **GREEDY)
    [first] = scheduler.run(scheduler.submit(prompt, greedy, key, keep_open=True))
    assert first.slot is not None and eng.free_slots == 3
    second = scheduler.resume(first, [20, 21, 22], sp, jax.random.key(4))
    scheduler.run([second])
    want = alone(config, params, prompt, greedy, key, [20, 21, 22], (sp, jax.random.key(4)))
    assert_turn(second, want)
    record = scheduler.close(second)
    assert record.response == [*first.tokens, 20, 21, 22, *second.tokens]
    assert record.sampled == [1] * 5 + [0] * 3 + [1] * 6 and eng.free_slots == 4
    with pytest.raises(ValueError, match="keep_open"):
        scheduler.resume(second, [1], sp, key)

    # Abort: a running turn (its slot freed at once) and a queued one (never admitted).
    scheduler = Scheduler(eng, chunk=2)
    long = SamplingParams(max_tokens=40, **GREEDY)
    running = [scheduler.submit(prompt, long, key)[0] for _ in range(4)]
    [queued] = scheduler.submit(prompt, long, key)
    scheduler.step()
    assert len(running[0].tokens) == 2 and queued.slot is None
    scheduler.abort(running[0])
    scheduler.abort(queued)
    assert running[0].finish_reason == queued.finish_reason == "abort"
    assert eng.free_slots == 1 and running[0].slot is None
    scheduler.step()
    assert queued.slot is None and len(running[1].tokens) == 4
    for h in running[1:]:
        scheduler.abort(h)
    assert not scheduler.busy and eng.free_slots == 4


def test_a_batch_takes_the_fixed_batch_path_when_idle_and_the_slots_otherwise(tiny):
    """Batch generation is a request too: idle, the engine's fixed-batch loop (exactly its
    rows); beside a running request, each prompt's copies as requests on the slots (each row
    the turn decoded alone with the documented key), right-padded like the fixed batch."""
    config, params = tiny
    ids = np.asarray([[0, 0, 5, 9, 13], [7, 8, 2, 40, 41]], np.int32)
    mask = np.asarray([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.int32)
    sp = SamplingParams(n=2, max_tokens=6, temperature=1.0)
    key = jax.random.key(5)
    eng = engine(config, params, version=3, max_num_seqs=8)
    scheduler = Scheduler(eng, chunk=4)

    out = scheduler.generate(ids, mask, sp, key)
    want = eng.generate(ids, mask, sp, key)
    assert out.fixed_batch and out.version == 3
    for got, ref in ((out.responses, want.responses), (out.response_mask, want.response_mask)):
        np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(out.log_probs, want.log_probs)

    [other] = scheduler.submit([3, 4, 5], SamplingParams(max_tokens=30, **GREEDY), key)
    scheduler.step()
    with pytest.raises(ValueError, match="fast=True"):
        scheduler.generate(ids, mask, sp, key, fast=True)
    out = scheduler.generate(ids, mask, sp, key)
    assert not out.fixed_batch and out.version == 3 and out.responses.shape == (4, 6)
    one = SamplingParams(max_tokens=6, temperature=1.0)
    for row in range(4):
        i, j = divmod(row, 2)
        prompt = ids[i][mask[i] > 0].tolist()
        tokens, log_probs = alone(
            config, params, prompt, one, jax.random.fold_in(jax.random.fold_in(key, i), j)
        )
        n = len(tokens)
        np.testing.assert_array_equal(out.responses[row, :n], tokens)
        np.testing.assert_allclose(out.log_probs[row, :n], log_probs, atol=LOG_PROB_ATOL)
        assert out.response_mask[row].tolist() == [1] * n + [0] * (6 - n)
        assert (out.log_probs[row, n:] == 0).all()
    assert not other.done and eng.free_slots == 7  # the other request still runs
    with pytest.raises(ValueError, match="over_sample_rate"):
        scheduler.generate(ids, mask, dataclasses.replace(sp, over_sample_rate=0.5), key)
    bad = ids.copy()
    bad[1, 2] = 10**6
    with pytest.raises(ValueError, match="outside the vocabulary"):
        scheduler.generate(bad, mask, sp, key)
    assert scheduler.free_slots == eng.free_slots == 7  # row 0's copies were not left queued


def test_legacy_keys_sample_what_typed_keys_sample(tiny):
    """jax.random.PRNGKey(s), what most JAX code passes, is accepted wherever a key enters
    (batch generation, the engine's decode, a request, a resumed turn) and samples exactly
    what jax.random.key(s) samples."""
    config, params = tiny
    ids = np.asarray([[0, 5, 9, 13], [7, 8, 2, 40]], np.int32)
    mask = (ids > 0).astype(np.int32)
    sp = SamplingParams(n=2, max_tokens=5, temperature=1.0, ignore_eos=True)
    one = SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True)
    eng = engine(config, params)
    runs = {}
    for kind, make in (("typed", jax.random.key), ("legacy", jax.random.PRNGKey)):
        scheduler = Scheduler(eng, chunk=None)
        batch = scheduler.generate(ids, mask, sp, make(3))
        [first] = scheduler.run(scheduler.submit([5, 9, 13], one, make(4), keep_open=True))
        second = scheduler.run([scheduler.resume(first, [20, 21], one, make(5))])[0]
        scheduler.close(second)
        slots = eng.start(ids, mask)
        turn = eng.decode(slots, one, make(6))
        eng.end(slots)
        runs[kind] = (np.asarray(batch.responses), first.tokens, second.tokens, turn.tokens)
    for typed, legacy in zip(runs["typed"], runs["legacy"], strict=True):
        np.testing.assert_array_equal(np.asarray(typed), np.asarray(legacy))
    assert len({tuple(r) for r in runs["typed"][0]}) > 1  # sampled, not all alike
    with pytest.raises(ValueError, match=r"decode\(rng=...\): expected a PRNG key"):
        eng.decode(eng.start(ids, mask), one, np.int32(3))


def test_bad_requests_are_named(tiny):
    config, params = tiny
    scheduler = Scheduler(engine(config, params))
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="copies=n"):
        scheduler.submit([3, 4], SamplingParams(n=2), key)
    with pytest.raises(ValueError, match="4 slots"):
        scheduler.submit([3, 4], SamplingParams(), key, copies=5)
    with pytest.raises(ValueError, match="flat, non-empty"):
        scheduler.submit([], SamplingParams(), key)
    with pytest.raises(ValueError, match=r"submit\(\): expected a PRNG key.*float32"):
        scheduler.submit([3, 4], SamplingParams(), np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="one key, not"):
        scheduler.submit([3, 4], SamplingParams(), jax.random.split(key, 2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        scheduler.submit([3, 10**6], SamplingParams(), key)
    [open_] = scheduler.run(
        scheduler.submit([3, 4], SamplingParams(max_tokens=2), key, keep_open=True)
    )
    with pytest.raises(ValueError, match="outside the vocabulary"):
        scheduler.resume(open_, [-1], SamplingParams(), key)
    with pytest.raises(ValueError, match="chunk"):
        Scheduler(scheduler.engine, chunk=0)
