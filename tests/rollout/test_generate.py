"""The rollout engine against HF generate, the model's own log-probs, and the exact
top-k / top-p distribution; n, EOS, ignore_eos, sharding and bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats

import jaxrl.models as M
from jaxrl.data import bucket
from jaxrl.kernels import attention, decode_attention
from jaxrl.models.params import param_shardings
from jaxrl.rollout import SamplingParams, compile_generate, generate, idle_fraction, sample
from jaxrl.rollout.generation import _compiled
from jaxrl.rollout.sampling import END_ID_WIDTH, RowSampling, is_end_row, sample_rows
from jaxrl.sharding import ROLLOUT_RULES, Layout, rollout_mesh
from jaxrl.testing.numerics import LOG_PROB_ATOL
from jaxrl.testing.tiny import tiny_decoder

GREEDY = dict(do_sample=False, temperature=0.0)
# Tokens are compared exactly. The same log-prob from another program (slots, blocks, a mesh,
# shared prefixes) at LOG_PROB_ATOL (its reason: jaxrl.testing.numerics). Against the float64
# numpy reference over the model's float32 forward, the forward's own rounding (~1e-6 of
# logits of scale ~10, through the temperature) is compared: 1e-4 absolute.
FAMILIES = [
    "llama_gqa_bias_llama3",
    "qwen2_sliding_yarn",
    "qwen3_bias_mqa_sliding",
    "mistral_sliding",
]


def prompts(b=4, p=7, seed=0, vocab=97):
    rng = np.random.RandomState(seed)
    ids = rng.randint(2, vocab, (b, p))
    lengths = np.array([p, p - 2, 2, p - 1][:b])
    mask = (np.arange(p)[None] >= (p - lengths)[:, None]).astype(np.int64)
    return np.where(mask, ids, 0), mask


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tiny_model):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def one_model(tiny_model):
    """The sampling tests' model: sliding windows and yarn rope (the fiddliest cache path)."""
    return tiny_model("qwen2_sliding_yarn")


def hf_greedy(folder, ids, mask, max_new, eos):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=0,
        )
    out = out[:, ids.shape[1] :].numpy()
    return np.pad(out, ((0, 0), (0, max_new - out.shape[1])))


def test_greedy_matches_hf_generate_with_and_without_eos(tiny):
    folder, config, params = tiny
    ids, mask = prompts()
    free_run = generate(config, params, ids, mask, SamplingParams(max_tokens=10, **GREEDY))
    # Pick as EOS a token row 0 emits mid-way, so rows stop at different steps.
    eos = int(free_run.responses[0, 4])
    for eos_ids in [(96,), (eos,)]:
        out = generate(
            config,
            params,
            ids,
            mask,
            SamplingParams(max_tokens=10, eos_token_ids=eos_ids, **GREEDY),
        )
        ref = hf_greedy(folder, ids, mask, 10, eos_ids[0])
        np.testing.assert_array_equal(out.responses, ref)
    stops = np.asarray(out.lengths)
    assert stops[0] <= 5 and (stops <= 10).all()
    for row, n in enumerate(stops):
        assert out.responses[row, n - 1] == eos or n == 10
        assert (np.asarray(out.response_mask[row]) == (np.arange(10) < n)).all()


def test_log_probs_are_the_processed_distribution(one_model):
    _, config, params = one_model
    ids, mask = prompts(seed=1)
    for sp in [
        SamplingParams(max_tokens=6, temperature=0.7),
        SamplingParams(max_tokens=6, temperature=1.3, top_k=5),
        SamplingParams(max_tokens=6, temperature=1.0, top_p=0.6),
        SamplingParams(max_tokens=6, temperature=0.9, top_k=7, top_p=0.8),
    ]:
        out = generate(config, params, ids, mask, sp, jax.random.key(3), max_prompt_length=7)
        full_ids = np.concatenate([ids, np.asarray(out.responses)], axis=1)
        full_mask = np.concatenate([mask, np.asarray(out.response_mask)], axis=1)
        logits = np.asarray(M.forward(config, params, full_ids, full_mask), np.float64)
        z = logits[:, ids.shape[1] - 1 : -1] / sp.temperature  # position t predicts t + 1
        expected = reference_log_probs(z, np.asarray(out.responses), sp.top_k, sp.top_p)
        valid = np.asarray(out.response_mask) > 0
        np.testing.assert_allclose(np.asarray(out.log_probs)[valid], expected[valid], atol=1e-4)


def reference_log_probs(z, tokens, top_k, top_p):
    """log p(token) renormalised over the top-k / top-p kept set, in numpy float64."""
    out = np.zeros(tokens.shape)
    for i in np.ndindex(tokens.shape):
        logits = z[i]
        keep = np.ones(logits.shape, bool)
        if top_k > 0:
            keep &= logits >= np.sort(logits)[-top_k]
        if top_p < 1:
            kept = np.where(keep, logits, -np.inf)
            probs = np.exp(kept - kept.max())
            probs /= probs.sum()
            order = np.argsort(probs)  # ascending
            cumulative = np.cumsum(probs[order])
            removed = cumulative <= 1 - top_p
            removed[-1] = False
            keep[order[removed]] = False
        kept = np.where(keep, logits, -np.inf)
        assert keep[tokens[i]], "sampled a filtered token"
        out[i] = kept[tokens[i]] - (kept.max() + np.log(np.exp(kept - kept.max()).sum()))
    return out


@pytest.mark.parametrize("top_k, top_p", [(-1, 1.0), (3, 1.0), (-1, 0.7), (4, 0.9)])
def test_sampling_follows_the_filtered_distribution(top_k, top_p):
    logits = jnp.asarray([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    sp = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
    draws = 20000
    keys = jax.random.split(jax.random.key(0), draws)
    tokens = np.asarray(jax.jit(jax.vmap(lambda k: sample(logits, sp, k)[0][0]))(keys))
    z = np.asarray(logits[0], np.float64) / 0.8
    probs = exact_probs(z, top_k, top_p)
    counts = np.bincount(tokens, minlength=8)
    assert counts[probs == 0].sum() == 0  # never a filtered token
    kept = probs > 0
    chi2 = ((counts[kept] - draws * probs[kept]) ** 2 / (draws * probs[kept])).sum()
    assert chi2 < stats.chi2.ppf(0.999, kept.sum() - 1), (counts, draws * probs)


def exact_probs(z, top_k, top_p):
    keep = np.ones(z.shape, bool)
    if top_k > 0:
        keep &= z >= np.sort(z)[-top_k]
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(p)
        removed = np.cumsum(p[order]) <= 1 - top_p
        removed[-1] = False
        p[order[removed]] = 0.0
        p /= p.sum()
    return p


def test_n_interleaves_and_rngs_are_fresh(one_model):
    _, config, params = one_model
    ids, mask = prompts(b=2)
    greedy = generate(config, params, ids, mask, SamplingParams(max_tokens=5, n=3, **GREEDY))
    assert greedy.responses.shape == (6, 5)
    r = np.asarray(greedy.responses)
    assert (r[0] == r[1]).all() and (r[1] == r[2]).all() and (r[3] == r[5]).all()
    sp = SamplingParams(max_tokens=8, n=4, temperature=1.5)
    a = generate(config, params, ids, mask, sp, jax.random.key(1))
    b = generate(config, params, ids, mask, sp, jax.random.key(1))
    c = generate(config, params, ids, mask, sp, jax.random.key(2))
    np.testing.assert_array_equal(a.responses, b.responses)
    assert (np.asarray(a.responses) != np.asarray(c.responses)).any()
    assert len({tuple(row) for row in np.asarray(a.responses)[:4]}) > 1  # copies differ


def test_ignore_eos_keeps_generating(one_model):
    _, config, params = one_model
    ids, mask = prompts()
    free_run = generate(config, params, ids, mask, SamplingParams(max_tokens=8, **GREEDY))
    eos = (int(free_run.responses[0, 1]),)
    stopped = generate(
        config, params, ids, mask, SamplingParams(max_tokens=8, eos_token_ids=eos, **GREEDY)
    )
    ignored = generate(
        config,
        params,
        ids,
        mask,
        SamplingParams(max_tokens=8, eos_token_ids=eos, ignore_eos=True, **GREEDY),
    )
    first_eos = int(np.argmax(np.asarray(free_run.responses[0]) == eos[0]))
    assert int(stopped.lengths[0]) == first_eos + 1 <= 2
    assert (np.asarray(ignored.lengths) == 8).all() and int(ignored.response_mask.sum()) == 32
    np.testing.assert_array_equal(ignored.responses, free_run.responses)


def test_sharded_generation_equals_single_device(tiny):
    _, config, params = tiny
    ids, mask = prompts()
    sp = SamplingParams(max_tokens=8, n=2, **GREEDY)
    ref = generate(config, params, ids, mask, sp)
    layout = Layout.create(rollout_mesh(2), ROLLOUT_RULES)
    sharded_params = jax.device_put(params, param_shardings(config, layout))
    out = generate(config, sharded_params, ids, mask, sp, layout=layout)
    np.testing.assert_array_equal(out.responses, ref.responses)
    np.testing.assert_allclose(out.log_probs, ref.log_probs, atol=LOG_PROB_ATOL)


def test_bad_input_is_named():
    folder_config = tiny_decoder(rope=M.RopeConfig(max_position_embeddings=32))
    params = M.init_params(folder_config, jax.random.key(0))
    ids, mask = np.ones((1, 10), np.int32), np.ones((1, 10), np.int32)
    with pytest.raises(ValueError, match="max_prompt_length=8"):
        generate(
            folder_config, params, ids, mask, SamplingParams(max_tokens=4), max_prompt_length=8
        )
    with pytest.raises(ValueError, match=r"max_tokens=30 .* must be <= 22"):
        generate(folder_config, params, ids, mask, SamplingParams(max_tokens=30))
    for kwargs, text in [
        (dict(temperature=-1.0), "temperature=-1.0 must be >= 0"),
        (dict(top_p=0.0), "top_p=0.0 must be in (0, 1]"),
        (dict(top_p=1.5), "top_p=1.5 must be in (0, 1]"),
        (dict(top_k=0), "top_k=0 must be -1 (off) or >= 1"),
        (dict(n=0), "n=0 must be >= 1"),
        (dict(temperature=0.0), "temperature=0 means greedy"),
    ]:
        with pytest.raises(ValueError) as info:
            SamplingParams(**kwargs)
        assert text in str(info.value)


def test_buckets_bound_the_number_of_programs():
    assert [bucket(n) for n in (1, 8, 9, 12, 13, 17, 25, 100)] == [8, 8, 12, 12, 16, 24, 32, 128]
    config = tiny_decoder()
    params = M.init_params(config, jax.random.key(0))
    sp = SamplingParams(max_tokens=3, **GREEDY)
    before = _compiled.cache_info().misses
    for p in (3, 5, 8):  # all in the 8-token prompt bucket, batch bucket 2
        generate(config, params, np.ones((2, p), np.int32), np.ones((2, p), np.int32), sp)
    assert _compiled.cache_info().misses - before == 1


def test_two_level_sampler_across_blocks():
    """Vocabulary of 600 (three 256-blocks, the last padded): the kept tokens sit in different
    blocks; only they are drawn, with their exact probabilities."""
    rng = np.random.RandomState(5)
    z = rng.randn(600) * 0.1
    z[[3, 300, 599]] = [2.0, 2.5, 1.5]  # the top 3 spread over all three blocks
    sp = SamplingParams(temperature=1.0, top_k=3)
    draws = 12000
    keys = jax.random.split(jax.random.key(1), draws)
    logits = jnp.asarray(z[None], jnp.float32)
    tokens = np.asarray(jax.jit(jax.vmap(lambda k: sample(logits, sp, k)[0][0]))(keys))
    assert set(np.unique(tokens)) <= {3, 300, 599}
    probs = exact_probs(z, 3, 1.0)[[3, 300, 599]]
    counts = np.array([(tokens == t).sum() for t in (3, 300, 599)])
    chi2 = ((counts - draws * probs) ** 2 / (draws * probs)).sum()
    assert chi2 < stats.chi2.ppf(0.999, 2), counts


ROW_SETTINGS = [
    SamplingParams(**GREEDY),
    SamplingParams(temperature=0.8, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=0.8, top_k=4, top_p=0.9),
    SamplingParams(temperature=1.3),
    SamplingParams(temperature=1.0, top_k=700),  # k beyond the vocabulary: off
    SamplingParams(do_sample=False, temperature=0.7, top_p=0.5),  # greedy, tempered log-prob
]


def test_row_sampling_draws_what_sample_draws():
    """Rows with different settings in one program (`sample_rows`, the settings as data) draw,
    key for key, the token `sample` draws for each row with its settings compiled in, with
    its log-prob; and a batch of rows none of which filters skips the sort."""
    rng = np.random.RandomState(7)
    logits = jnp.asarray(rng.randn(len(ROW_SETTINGS), 600) * 2, jnp.float32)
    rows = RowSampling.of(ROW_SETTINGS, ())
    draws = 300
    keys = jax.random.split(jax.random.key(2), (draws, len(ROW_SETTINGS)))
    tokens, log_probs = jax.jit(jax.vmap(lambda k: sample_rows(logits, rows, k)))(keys)
    for i, sp in enumerate(ROW_SETTINGS):
        one = jax.jit(jax.vmap(lambda k, i=i, sp=sp: sample(logits[i : i + 1], sp, k[None])))
        want_tokens, want_log_probs = one(keys[:, i])
        np.testing.assert_array_equal(tokens[:, i], want_tokens[:, 0], err_msg=str(sp))
        # the same float32 operations on one row or on seven
        np.testing.assert_allclose(log_probs[:, i], want_log_probs[:, 0], rtol=1e-6, atol=1e-6)
    assert len(np.unique(tokens[:, 4])) > 10  # the sampled rows do draw
    plain = RowSampling.of([SamplingParams(temperature=t) for t in (0.5, 1.0, 2.0)], ())
    jaxpr = jax.make_jaxpr(lambda z: sample_rows(z, plain, keys[0, :3]))(logits[:3]).jaxpr
    top = [e.primitive.name for e in jaxpr.eqns]  # the sort only inside a branch of a cond
    assert "sort" not in top and "cond" in top and "sort" in str(jaxpr)
    tokens, _ = sample_rows(logits[:3], plain, keys[0, :3])
    for i, t in enumerate((0.5, 1.0, 2.0)):
        want = sample(logits[i : i + 1], SamplingParams(temperature=t), keys[0, i : i + 1])[0]
        assert int(tokens[i]) == int(want[0])


def test_row_sampling_end_tokens_are_each_rows_own():
    rows = RowSampling.of(
        [
            SamplingParams(),  # the model's EOS
            SamplingParams(stop_token_ids=(5,)),  # EOS and 5
            SamplingParams(ignore_eos=True),  # nothing ends it
            SamplingParams(eos_token_ids=(7,), stop_token_ids=(9,)),
        ],
        model_eos=(2,),
    )
    assert rows.end_ids[1, :2].tolist() == [2, 5] and (rows.end_ids[2] == -1).all()
    tokens = jnp.asarray([[2, 5, 2, 7], [5, 2, 7, 9], [9, 9, 2, 2]])
    ended = np.asarray(jax.vmap(lambda t: is_end_row(t, rows.end_ids))(tokens))
    np.testing.assert_array_equal(
        ended, [[True, True, False, True], [False, True, False, True], [False, False, False, False]]
    )
    with pytest.raises(ValueError, match=f"at most {END_ID_WIDTH}"):
        RowSampling.of([SamplingParams(stop_token_ids=tuple(range(3, 12)))], (2,))


def test_sampling_params_from_config():
    from jaxrl.config import load_config
    from jaxrl.rollout import GenerationOutput

    cfg = load_config(
        None,
        [
            "actor_rollout_ref.model.path=/m",
            "actor_rollout_ref.rollout.n=5",
            "actor_rollout_ref.rollout.top_p=0.9",
            "data.max_response_length=64",
        ],
    )
    train = SamplingParams.from_config(cfg.actor_rollout_ref.rollout)
    assert (train.n, train.top_p, train.max_tokens, train.do_sample) == (5, 0.9, 64, True)
    val = SamplingParams.from_config(cfg.actor_rollout_ref.rollout, validation=True)
    assert (val.n, val.do_sample, val.temperature, val.max_tokens) == (1, False, 0.0, 64)
    lengths = jnp.array([4, 2, 4, 1])
    steps = jnp.int32(3)  # static batching: the longest row's decode steps
    out = GenerationOutput(lengths[:, None], lengths[:, None], lengths[:, None], lengths, steps, 4)
    assert idle_fraction(out) == pytest.approx((0 + 2 + 0 + 3) / 12)  # float64 of small integers


def test_continuous_batching_equals_static_batching(one_model):
    """Two slots for eight rows of different lengths (EOS stops): each finished row's slot is
    refilled, and every row comes out as with one slot per row."""
    _, config, params = one_model
    ids, mask = prompts()
    free_run = generate(config, params, ids, mask, SamplingParams(max_tokens=10, **GREEDY))
    eos = (int(free_run.responses[1, 2]), int(free_run.responses[3, 0]))
    sp = SamplingParams(max_tokens=10, n=2, eos_token_ids=eos, **GREEDY)
    static = generate(config, params, ids, mask, sp)
    lengths = np.asarray(static.lengths)
    assert len(set(lengths.tolist())) > 2, lengths  # a real long tail
    for slots in (2, 3):
        cb = generate(config, params, ids, mask, sp, max_num_seqs=slots)
        assert cb.slots == slots
        np.testing.assert_array_equal(cb.responses, static.responses)
        np.testing.assert_array_equal(cb.lengths, static.lengths)
        np.testing.assert_allclose(cb.log_probs, static.log_probs, atol=LOG_PROB_ATOL)
        produced = int((lengths - 1).sum())
        assert -(-produced // slots) <= int(cb.decode_steps) <= produced
    assert idle_fraction(cb) < idle_fraction(static)
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        generate(config, params, ids, mask, sp, max_num_seqs=0)


def test_continuous_batching_sampled_and_sharded(one_model):
    """Sampled rows under refills keep exact log-probs; sharded slots equal one device."""
    _, config, params = one_model
    ids, mask = prompts()
    sp = SamplingParams(max_tokens=6, n=3, temperature=0.8, top_k=20, eos_token_ids=(5, 7, 11))
    out = generate(config, params, ids, mask, sp, jax.random.key(3), max_num_seqs=4)
    assert int(out.decode_steps) < 6 * 3  # slots were refilled: fewer steps than 12 rows / 4
    full_ids = np.concatenate([np.repeat(ids, 3, axis=0), np.asarray(out.responses)], axis=1)
    full_mask = np.concatenate([np.repeat(mask, 3, axis=0), np.asarray(out.response_mask)], 1)
    logits = np.asarray(M.forward(config, params, full_ids, full_mask), np.float64)
    z = logits[:, ids.shape[1] - 1 : -1] / sp.temperature
    expected = reference_log_probs(z, np.asarray(out.responses), sp.top_k, sp.top_p)
    valid = np.asarray(out.response_mask) > 0
    np.testing.assert_allclose(np.asarray(out.log_probs)[valid], expected[valid], atol=1e-4)
    layout = Layout.create(rollout_mesh(2), ROLLOUT_RULES)
    greedy = SamplingParams(max_tokens=6, n=3, eos_token_ids=(5, 7, 11), **GREEDY)
    sharded_params = jax.device_put(params, param_shardings(config, layout))
    sharded = generate(config, sharded_params, ids, mask, greedy, layout=layout, max_num_seqs=4)
    single = generate(config, params, ids, mask, greedy)
    np.testing.assert_array_equal(sharded.responses, single.responses)


@pytest.mark.parametrize("slots", [None, 5])
def test_prefix_sharing_changes_no_output(one_model, slots):
    """n = 4 copies per prompt, prefilled once each and copied into their slots, give the
    same greedy and sampled outputs (fixed keys) as prefilling every copy; with 5 slots the
    refills start mid-group (a prompt's copies split over two refills). The shared program
    does less work: its prefill runs one row per prompt, not per copy."""
    _, config, params = one_model
    ids, mask = prompts()
    key = jax.random.key(7)
    for sp in (
        SamplingParams(max_tokens=5, n=4, eos_token_ids=(5, 7, 11), **GREEDY),
        SamplingParams(max_tokens=5, n=4, temperature=0.9, top_p=0.9, eos_token_ids=(5, 7, 11)),
    ):
        outs = [
            generate(config, params, ids, mask, sp, key, max_num_seqs=slots, prefix_sharing=on)
            for on in (True, False)
        ]
        np.testing.assert_array_equal(outs[0].responses, outs[1].responses)
        np.testing.assert_array_equal(outs[0].lengths, outs[1].lengths)
        np.testing.assert_allclose(outs[0].log_probs, outs[1].log_probs, atol=LOG_PROB_ATOL)
    flops = [
        compile_generate(config, params, ids, mask, sp, prefix_sharing=on).cost_analysis()["flops"]
        for on in (True, False)
    ]
    assert flops[0] < 0.5 * flops[1], flops


def test_long_cache_is_read_in_blocks_with_the_same_result(one_model, monkeypatch):
    """A cache longer than `whole` entries is read in blocks up to the live prefix (here
    48 entries in 16-key blocks); tokens and log-probs equal the whole-cache read's."""
    from jaxrl.rollout import generation as engine

    _, config, params = one_model
    ids, mask = prompts()
    sp = SamplingParams(max_tokens=40, **GREEDY)
    whole = generate(config, params, ids, mask, sp)
    blocked_geometry = functools.partial(engine.cache_geometry, block=16, whole=16)
    monkeypatch.setattr(engine, "cache_geometry", blocked_geometry)
    _compiled.cache_clear()
    try:
        blocked = generate(config, params, ids, mask, sp)
    finally:
        _compiled.cache_clear()
    assert blocked_geometry(8, 40) == (48, 16)
    np.testing.assert_array_equal(blocked.responses, whole.responses)
    np.testing.assert_allclose(blocked.log_probs, whole.log_probs, atol=LOG_PROB_ATOL)


def test_decode_attention_equals_dense_reference():
    """Rows at different cache indices, holes (left padding), sliding windows, several blocks,
    a `live` bound that skips the cache's unwritten tail, and the whole cache as one block."""
    rng = np.random.RandomState(0)
    b, s, n, kv, h = 3, 64, 4, 2, 8
    k = jnp.asarray(rng.randn(b, s, kv, h), jnp.float32)
    v = jnp.asarray(rng.randn(b, s, kv, h), jnp.float32)
    q = jnp.asarray(rng.randn(b, 1, n, h), jnp.float32)
    query_index = jnp.array([5, 40, 23])
    valid = np.arange(s)[None] <= np.asarray(query_index)[:, None]
    valid[1, :7] = False  # left padding
    valid = jnp.asarray(valid)
    kv_segments = valid.astype(jnp.int32)
    k_bkhc, v_bkch = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
    for window, block in [(None, 16), (9, 16), (None, s), (9, s)]:
        got = decode_attention(
            q, k_bkhc, v_bkch, valid, query_index, live=41, sliding_window=window, block=block
        )
        for row in range(b):
            i = int(query_index[row])
            want = attention(
                q[row : row + 1],
                k[row : row + 1, : i + 1],
                v[row : row + 1, : i + 1],
                causal=True,
                segment_ids=(jnp.ones((1, 1), jnp.int32), kv_segments[row : row + 1, : i + 1]),
                sliding_window=window,
                q_offset=i,
            )
            # averages of N(0, 1) values (|out| < 4), the softmax in blocks: ~1e-6 apart
            np.testing.assert_allclose(got[row], want[0], atol=LOG_PROB_ATOL)
        # the same layer read out of stacked caches [L, ...] (as the decode step's scan does)
        stacked = decode_attention(
            q,
            jnp.stack([-k_bkhc, k_bkhc, 2 * k_bkhc]),
            jnp.stack([-v_bkch, v_bkch, 2 * v_bkch]),
            valid,
            query_index,
            live=41,
            sliding_window=window,
            block=block,
            layer=jnp.int32(1),
        )
        np.testing.assert_array_equal(stacked, got)


@pytest.mark.parametrize("slots", [None, 3])
def test_over_sample_rate_aborts_the_slowest_rows(one_model, slots):
    """verl's early abort (`over_sample_rate`): the call stops once int(rows x (1 - rate))
    rows have finished; those come out exactly as in the full call (same key), the rest
    (the slowest, and with 3 slots any still queued) are empty. With a slot per row the
    aborted rows are the longest ones of the full call."""
    _, config, params = one_model
    ids, mask = prompts()
    key = jax.random.key(4)
    free = np.asarray(generate(config, params, ids, mask, SamplingParams(max_tokens=10, n=2),
                               key).responses)  # fmt: skip
    eos = tuple(int(t) for t in (free[1, 2], free[3, 0], free[6, 5]))
    base = dict(max_tokens=10, n=2, temperature=1.0, eos_token_ids=eos)
    full = generate(config, params, ids, mask, SamplingParams(**base), key, max_num_seqs=slots)
    lengths = np.asarray(full.lengths)
    assert len(set(lengths.tolist())) > 2, lengths  # a long tail to cut
    rate = 0.4
    out = generate(config, params, ids, mask, SamplingParams(**base, over_sample_rate=rate), key,
                   max_num_seqs=slots)  # fmt: skip
    kept = np.asarray(out.lengths) > 0
    target = int(8 * (1 - rate))
    assert target <= kept.sum() < 8
    np.testing.assert_array_equal(np.asarray(out.lengths)[kept], lengths[kept])
    np.testing.assert_array_equal(np.asarray(out.responses)[kept], np.asarray(full.responses)[kept])
    assert (np.asarray(out.response_mask)[~kept] == 0).all()
    assert (np.asarray(out.log_probs)[~kept] == 0).all()
    if slots is None:
        assert lengths[~kept].min() >= lengths[kept].max()
    with pytest.raises(ValueError, match=r"over_sample_rate=1\.0"):
        SamplingParams(over_sample_rate=1.0)
