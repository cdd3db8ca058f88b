"""The rollout engine's conversations: a conversation that decodes, appends a tool's output
and decodes again equals one `generate` over the concatenated prompt (one device and a
dp=2 x tp=2 mesh), `extend` equals a prefill, idle slots are left alone, stop tokens and stop
strings, records, and bad input."""

import dataclasses

import jax
import numpy as np
import pytest

import jaxrl.models as M
from jaxrl.data import bucket
from jaxrl.models.cached import extend, init_cache, prefill
from jaxrl.models.params import param_shardings
from jaxrl.models.transformer import positions_from_mask
from jaxrl.rollout import RolloutEngine, SamplingParams, generate
from jaxrl.rollout.backends import XlaBackend, choose_backend
from jaxrl.sharding import ROLLOUT_RULES, Layout, rollout_mesh
from jaxrl.testing.numerics import LOG_PROB_ATOL, assert_close_to_scale
from jaxrl.trainer.compiles import compile_totals, compiles_since

GREEDY = dict(do_sample=False, temperature=0.0, ignore_eos=True)
# Tokens are compared exactly; log-probs from another program at LOG_PROB_ATOL (its reason:
# jaxrl.testing.numerics).


@pytest.fixture(scope="module", params=["qwen2_sliding_yarn", "llama_gqa_bias_llama3"])
def tiny(request, tiny_model):
    return tiny_model(request.param)[1:]


def prompts(b=3, p=7, seed=0):
    rng = np.random.RandomState(seed)
    ids = rng.randint(2, 97, (b, p))
    mask = np.ones_like(ids)
    mask[1:2, :3] = 0  # a shorter, left-padded prompt
    return ids * mask, mask


def engine(config, params, layout=None, **kw):
    kw = dict(max_num_seqs=4, max_model_len=64) | kw
    eng = RolloutEngine(config, layout, **kw)
    eng.load_weights(params)
    return eng


def generate_after(config, params, record, sp, layout=None):
    """One `generate` over a record's whole sequence so far (the concatenated prompt)."""
    full = np.asarray(record.prompt + record.response)[None]
    out = generate(config, params, full, np.ones_like(full), sp, layout=layout)
    return np.asarray(out.responses)[0], np.asarray(out.log_probs)[0]


@pytest.mark.parametrize("mesh", ["one device", "dp2_tp2"])
def test_decode_append_decode_equals_generate_over_the_concatenation(tiny, mesh):
    config, params = tiny
    layout = None
    if mesh == "dp2_tp2":
        layout = Layout.create(rollout_mesh(2, jax.devices()[:4]), ROLLOUT_RULES)
        params = jax.device_put(params, param_shardings(config, layout))
    ids, mask = prompts()
    sp = SamplingParams(max_tokens=6, **GREEDY)
    eng = engine(config, params, layout)
    slots = eng.start(ids, mask)
    first = eng.decode(slots, sp)
    want = generate(config, params, ids, mask, sp, layout=layout)
    np.testing.assert_array_equal(np.stack(first.tokens), want.responses)
    np.testing.assert_allclose(np.stack(first.log_probs), want.log_probs, atol=LOG_PROB_ATOL)
    tool = [np.random.RandomState(i).randint(2, 97, 7) for i in range(3)]
    eng.append(slots, tool)
    second = eng.decode(slots, sp)
    for i, slot in enumerate(slots):
        record = eng.conversation(slot)
        before = record.response[:-6]
        assert before == first.tokens[i].tolist() + tool[i].tolist()
        record = dataclasses.replace(record, response=before)
        tokens, log_probs = generate_after(config, params, record, sp, layout)
        np.testing.assert_array_equal(second.tokens[i], tokens)
        np.testing.assert_allclose(second.log_probs[i], log_probs, atol=LOG_PROB_ATOL)
    record = eng.conversation(slots[0])
    assert record.sampled == [1] * 6 + [0] * 7 + [1] * 6
    assert record.log_probs[6:13] == [0.0] * 7
    assert first.finish_reasons == ["length"] * 3


def test_extend_equals_a_prefill(tiny):
    """Rows prefilled to different lengths (5 and 3 tokens) and extended by 4 tokens each,
    at their own offsets, hold the cache and the hidden states of prefills of 9 and 7."""
    config, params = tiny
    ids, _ = prompts(b=2, p=9)
    cache = init_cache(config, 2, 16)
    for row, start in enumerate((5, 3)):
        one = np.ones((1, start), np.int32)
        _, k, v, _ = prefill(
            config, params, ids[row : row + 1, :start], positions_from_mask(one), one
        )
        cache = cache.write(np.array([row]), k, v, one)
    index = np.stack([5 + np.arange(4), 3 + np.arange(4)])
    new_ids = np.stack([ids[0, 5:9], ids[1, 3:7]])
    h, cache, _ = jax.jit(extend, static_argnums=0)(config, params, new_ids, index, cache, index)
    for row, total in enumerate((9, 7)):
        one = np.ones((1, total), np.int32)
        h_all, k_all, v_all, _ = prefill(
            config, params, ids[row : row + 1, :total], positions_from_mask(one), one
        )
        # one float32 forward in two pieces against one piece: ~1e-6 of the scale apart
        assert_close_to_scale(h[row], h_all[0, total - 4 :], rtol=1e-5)
        assert_close_to_scale(
            cache.k[:, row, ..., :total], k_all[:, 0].transpose(0, 2, 3, 1), rtol=1e-5
        )
        assert_close_to_scale(
            cache.v[:, row, :, :total], v_all[:, 0].transpose(0, 2, 1, 3), rtol=1e-5
        )
        np.testing.assert_array_equal(cache.segments[row, :total], 1)
        np.testing.assert_array_equal(cache.segments[row, total:], 0)


def test_a_turn_over_a_weight_push_continues_on_the_new_weights(tiny):
    """A partial rollout: a sampled turn decoded for 4 tokens with weights A (version 1),
    then, after a push of weights B (version 2), to its end, keeps its cache. Its record
    says version 1 for the first 4 tokens and 2 for the rest, and its log-probs are the
    teacher-forced ones of that mix: the prompt and the first 3 tokens in the cache under
    A, the 4th token (fed at the first step after the push) and the later ones under B.
    All-A log-probs for the last tokens differ (the check can fail)."""
    config, params = tiny
    pushed = jax.tree.map(lambda x: (x * 0.9).astype(x.dtype), params)
    ids, mask = prompts(b=1)
    sp = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    eng = RolloutEngine(config, None, max_num_seqs=2, max_model_len=32)
    eng.load_weights(params, version=1)
    [slot] = eng.start(ids, mask)
    first = eng.decode([slot], sp, jax.random.key(5)[None], max_steps=4)
    eng.load_weights(pushed, version=2)
    last = eng.decode([slot], sp, max_steps=None)
    assert first.versions == [[1] * 4] and last.versions == [[1] * 4 + [2] * 6]
    record = eng.conversation(slot)
    assert record.versions == [1] * 4 + [2] * 6 and len(record.response) == 10
    prompt, tokens = np.asarray(record.prompt), np.asarray(record.response)
    p = len(prompt)

    def chosen(logits, picked):
        return np.take_along_axis(jax.nn.log_softmax(logits, -1), picked[:, None], -1)[:, 0]

    seen = np.concatenate([prompt, tokens[:3]])[None]
    one = np.ones_like(seen)
    h, k, v, _ = prefill(config, params, seen, positions_from_mask(one), one)
    under_a = chosen(M.lm_logits(config, params, h)[0, p - 1 :], tokens[:4])
    cache = init_cache(config, 1, 32).write(np.array([0]), k, v, one)
    index = (p + 3 + np.arange(6))[None]
    h, _, _ = jax.jit(extend, static_argnums=0)(config, pushed, tokens[None, 3:9], index, cache,
                                             index)  # fmt: skip
    under_b = chosen(M.lm_logits(config, pushed, h)[0], tokens[4:])
    np.testing.assert_allclose(record.log_probs, np.concatenate([under_a, under_b]),
                               atol=LOG_PROB_ATOL)  # fmt: skip
    whole = np.concatenate([prompt, tokens[:9]])[None]
    ones = np.ones_like(whole)
    h, _, _, _ = prefill(config, params, whole, positions_from_mask(ones), ones)
    all_a = chosen(M.lm_logits(config, params, h)[0, p + 3 :], tokens[4:])
    assert np.abs(all_a - under_b).max() > 100 * LOG_PROB_ATOL


def test_idle_slots_are_left_alone(tiny):
    """Decoding one conversation while another waits (with a tool output appended in
    between) changes nothing for the waiting one."""
    config, params = tiny
    ids, mask = prompts()
    sp = SamplingParams(max_tokens=5, **GREEDY)
    together = engine(config, params)
    slots = together.start(ids, mask)
    both = together.decode(slots, sp)
    apart = engine(config, params)
    slots = apart.start(ids, mask)
    alone = [apart.decode([s], sp).tokens[0] for s in slots[::-1]]
    apart.append(slots[:1], [[5, 6, 7]])
    apart.decode(slots[:1], sp)
    for s, tokens in zip(slots[::-1], alone, strict=True):
        np.testing.assert_array_equal(tokens, both.tokens[int(s)])
    np.testing.assert_array_equal(
        apart.decode(slots[1:], sp).tokens, together.decode(slots[1:], sp).tokens
    )


def test_sampled_turns_do_not_depend_on_chunks_or_companions(tiny):
    """A sampled turn drawn with its own key is the same token for token whether it is
    decoded alone in one call or in `max_steps` chunks alongside other slots (the agent
    loop's continuous batching across turns), and a chunked turn reports None until over."""
    config, params = tiny
    ids, mask = prompts()
    sp = SamplingParams(max_tokens=9, temperature=1.0, ignore_eos=True)
    keys = jax.random.split(jax.random.key(3), 3)
    whole = engine(config, params)
    slots = whole.start(ids, mask)
    alone = [whole.decode([s], sp, keys[i][None]) for i, s in enumerate(slots)]
    chunked = engine(config, params)
    slots = chunked.start(ids, mask)
    first = chunked.decode(slots[:2], sp, keys[:2], max_steps=4)
    assert first.finish_reasons == [None, None] and len(first.tokens[0]) == 4
    chunked.decode(slots[2:], sp, keys[2:], max_steps=2)  # a third joins mid-way
    last = chunked.decode(slots, sp, max_steps=20)  # running turns keep their keys
    for i, s in enumerate(slots):
        np.testing.assert_array_equal(last.tokens[i], alone[i].tokens[0])
        np.testing.assert_allclose(last.log_probs[i], alone[i].log_probs[0], atol=LOG_PROB_ATOL)
        assert chunked.conversation(s).response == whole.conversation(s).response
    chunked.decode(slots[:1], sp, keys[:1], max_steps=1)
    with pytest.raises(ValueError, match="middle of a turn"):
        chunked.append(slots[:1], [[5]])
    greedy = SamplingParams(max_tokens=9, **GREEDY)
    with pytest.raises(ValueError, match="other sampling parameters"):
        chunked.decode(slots, greedy, max_steps=1)  # slot 0's turn is sampled
    assert chunked.decode(slots[1:], greedy, max_steps=1).finish_reasons == [None, None]


def test_slots_with_different_settings_decode_together(tiny):
    """A server's requests: slots with different temperatures, top-k / top-p, max_tokens, end
    tokens and seeds decode in one call of one compiled program, and each slot's turn is the
    one it decodes alone with its own settings; other settings of the same length bucket
    compile nothing new."""
    config, params = tiny
    ids, mask = prompts(b=4)
    ids[3], mask[3] = ids[0], mask[0]  # slot 3: slot 0's prompt, ended by a stop token
    settings = [
        SamplingParams(max_tokens=7, **GREEDY),
        SamplingParams(max_tokens=9, temperature=0.7, top_k=5, ignore_eos=True, seed=3),
        SamplingParams(max_tokens=4, temperature=1.2, top_p=0.8, ignore_eos=True, seed=4),
    ]
    apart = engine(config, params)
    slots = apart.start(ids, mask)
    key = [jax.random.fold_in(jax.random.key(sp.seed or 0), i) for i, sp in enumerate(settings)]
    alone = [apart.decode([s], sp, k[None]) for s, sp, k in zip(slots, settings, key, strict=False)]
    greedy = alone[0].tokens[0].tolist()
    stop = greedy[max(i for i, t in enumerate(greedy) if greedy.index(t) == i)]  # a new token
    settings.append(SamplingParams(max_tokens=7, stop_token_ids=(stop,), **GREEDY))
    alone.append(apart.decode(slots[3:], settings[3]))
    assert alone[3].tokens[0].tolist() == greedy[: greedy.index(stop) + 1]

    together = engine(config, params)
    slots = together.start(ids, mask)
    start = compile_totals()
    both = together.decode(slots, settings)  # rng None: each slot's own seed, folded with i
    for i, turn in enumerate(alone):
        np.testing.assert_array_equal(both.tokens[i], turn.tokens[0], err_msg=str(settings[i]))
        np.testing.assert_allclose(both.log_probs[i], turn.log_probs[0], atol=LOG_PROB_ATOL)
    assert [len(t) for t in both.tokens[:3]] == [7, 9, 4]
    assert both.finish_reasons == ["length", "length", "length", "stop"]
    assert compiles_since(start)["perf/compiles"] <= 1
    start = compile_totals()
    mixes = [(0.3, -1, 0.5, 1), (1.5, 2, 1.0, 2), (1.0, -1, 1.0, 3), (0.9, 9, 0.95, 4)]
    other = [
        SamplingParams(max_tokens=12, temperature=t, top_k=k, top_p=p, ignore_eos=True, seed=s)
        for t, k, p, s in mixes
    ]
    again = together.decode(slots, other)
    assert compiles_since(start)["perf/compiles"] == 0  # settings are data of one program
    assert [len(t) for t in again.tokens] == [12] * 4
    assert set(again.tokens[1].tolist()) != set(again.tokens[2].tolist())


class CharTokenizer:
    """Token t is the letter 'a' + t % 26 (enough to place stop strings)."""

    def decode(self, tokens):
        return "".join(chr(ord("a") + int(t) % 26) for t in tokens)


def test_stop_tokens_and_stop_strings_end_a_turn(tiny):
    config, params = tiny
    sp = SamplingParams(max_tokens=12, **GREEDY)
    for seed in range(10):  # a prompt whose greedy run does not repeat one token
        ids, mask = prompts(b=1, seed=seed)
        free_run = engine(config, params)
        free = free_run.decode(free_run.start(ids, mask), sp)
        tokens, free_log_probs = free.tokens[0], free.log_probs[0]
        if len(set(tokens[:7].tolist())) > 2:
            break
    else:
        pytest.fail("no prompt of 10 gives a varied greedy run: the test would test nothing")

    # A stop token: the turn ends at its first occurrence (kept), in decode and generate.
    stop_token = int(tokens[4])
    first = tokens.tolist().index(stop_token)
    with_stop = dict(GREEDY, stop_token_ids=(stop_token,))
    eng = engine(config, params)
    turn = eng.decode(eng.start(ids, mask), SamplingParams(max_tokens=12, **with_stop))
    np.testing.assert_array_equal(turn.tokens[0], tokens[: first + 1])
    assert turn.finish_reasons == ["stop"]
    out = generate(config, params, ids, mask, SamplingParams(max_tokens=12, **with_stop))
    assert int(out.lengths[0]) == first + 1

    # A stop string completed by token 6: the turn keeps tokens 0..6, and the slot continues
    # from there as if nothing had been sampled after them.
    text = CharTokenizer().decode(tokens)
    stop = text[5:7]
    cut = text.index(stop) + len(stop)
    eng = engine(config, params, tokenizer=CharTokenizer(), stop_check_tokens=4)
    slot = eng.start(ids, mask)
    turn = eng.decode(slot, SamplingParams(max_tokens=12, stop=(stop,), **GREEDY))
    np.testing.assert_array_equal(turn.tokens[0], tokens[:cut])
    np.testing.assert_allclose(turn.log_probs[0], free_log_probs[:cut], atol=LOG_PROB_ATOL)
    assert turn.finish_reasons == ["stop"]
    record = eng.conversation(int(slot[0]))
    assert len(record.response) == len(record.log_probs) == len(record.sampled) == cut
    sp = SamplingParams(max_tokens=4, **GREEDY)
    after = eng.decode(slot, sp)
    record = eng.conversation(int(slot[0]))
    record = dataclasses.replace(record, response=record.response[:cut])
    np.testing.assert_array_equal(after.tokens[0], generate_after(config, params, record, sp)[0])


def test_a_full_cache_ends_the_turn_and_append_refuses(tiny):
    config, params = tiny
    ids, mask = prompts(b=1)
    eng = engine(config, params, max_model_len=16)
    slot = eng.start(ids, mask)
    turn = eng.decode(slot, SamplingParams(max_tokens=50, **GREEDY))
    # 16 cells: the prompt bucket's (its padding included), then one per sampled token but
    # the last (pending: it would need a 17th cell when fed)
    assert len(turn.tokens[0]) == 16 - bucket(7) and turn.finish_reasons == ["length"]
    with pytest.raises(ValueError, match="max_model_len"):
        eng.append(slot, [[3]])
    assert eng.decode(slot, SamplingParams(max_tokens=5, **GREEDY)).tokens[0].size == 0


def test_slots_are_reused_and_bad_calls_are_named(tiny):
    config, params = tiny
    ids, mask = prompts(b=3)
    eng = engine(config, params, max_num_seqs=4)
    slots = eng.start(ids, mask)
    assert eng.free_slots == 1
    with pytest.raises(ValueError, match="free slots"):
        eng.start(ids[:2], mask[:2])
    records = eng.end(slots[:2])
    assert [r.prompt for r in records] == [ids[0].tolist(), ids[1, 3:].tolist()]
    assert eng.free_slots == 3
    with pytest.raises(ValueError, match="hold no conversation"):
        eng.decode(slots[:1], SamplingParams(max_tokens=2, **GREEDY))
    with pytest.raises(ValueError, match="tokenizer"):
        eng.decode(slots[2:], SamplingParams(max_tokens=2, stop=("x",), **GREEDY))
    with pytest.raises(ValueError, match="n=2"):
        eng.decode(slots[2:], SamplingParams(max_tokens=2, n=2, **GREEDY))
    with pytest.raises(ValueError, match="not left-padded"):
        eng.start(ids[:1], np.pad(mask[:1, 1:], ((0, 0), (0, 1))))
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine(config, params, max_num_seqs=None).start(ids, mask)
    with pytest.raises(ValueError, match="stop_token_ids"):
        generate(config, params, ids, mask, SamplingParams(stop=("x",)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.append(slots[2:], [[3, config.vocab_size]])
    with pytest.raises(ValueError, match="flat list"):
        eng.append(slots[2:], [[[3, 4]]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.start(np.full_like(ids[:1], -1), mask[:1])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        RolloutEngine(config, max_num_seqs=4, max_model_len=config.rope.max_position_embeddings + 1)
    assert eng.free_slots == 3  # the refused calls opened nothing
    # A slot ended and started again holds only its new conversation.
    again = eng.start(ids[2:], mask[2:])
    sp = SamplingParams(max_tokens=4, **GREEDY)
    np.testing.assert_array_equal(
        eng.decode(again, sp).tokens[0], eng.decode(slots[2:], sp).tokens[0]
    )


def test_the_engine_copies_the_weights_it_is_given(tiny):
    """On one device too, the engine's weights are its own: releasing them leaves the
    caller's arrays alive."""
    config, params = tiny
    eng = engine(config, params)
    eng.release()
    assert not any(x.is_deleted() for x in jax.tree.leaves(params))


def test_backend_names_are_checked():
    config = M.DecoderConfig(
        model_type="llama",
        vocab_size=32,
        hidden_size=24,
        intermediate_size=48,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        head_dim=12,
    )
    with pytest.raises(ValueError, match="one of"):
        choose_backend("pallas", config, None)
    with pytest.raises(ValueError, match="head_dim=12"):
        choose_backend("cpu_kernels", config, None)
    assert choose_backend("auto", config, None) == XlaBackend()
    with pytest.raises(ValueError, match="float32"):
        choose_backend("cpu_kernels", config.replace(dtype="bfloat16", head_dim=16), None)


def test_the_xla_rollout_holds_its_layers_apart(tiny):
    """With the `xla` decode step the rollout's copy is per layer (no weight sliced out of a
    stack at each step): generation equals the stacked parameters', `copy_of` describes the
    copy, and the stacks' buffers are gone."""
    config, params = tiny
    eng = engine(config, params, decode_backend="xla")
    layers = eng.params["layers"]
    assert isinstance(layers, tuple) and len(layers) == config.num_layers
    np.testing.assert_array_equal(
        np.asarray(layers[1]["attn"]["w_q_dnh"]),
        np.asarray(params["layers"]["attn"]["w_q_dnh"][1]).astype(config.param_dtype),
    )
    copy = eng.copy_of(params)
    assert jax.tree.structure(copy) == jax.tree.structure(eng.params)
    for a, b in zip(jax.tree.leaves(copy), jax.tree.leaves(eng.params), strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        assert a.sharding.is_equivalent_to(b.sharding, len(a.shape))
    ids, mask = prompts()
    sp = SamplingParams(n=2, max_tokens=6, temperature=1.0)
    ours = eng.generate(ids, mask, sp, jax.random.key(1))
    ref = generate(config, params, ids, mask, sp, jax.random.key(1), decode_backend="xla",
                   max_num_seqs=eng.max_num_seqs)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(ours.responses), np.asarray(ref.responses))
    # the same decode program over the same per-layer weights: rounding of the copy only
    np.testing.assert_allclose(np.asarray(ours.log_probs), np.asarray(ref.log_probs), atol=1e-6)
    kernels = choose_backend("auto", config, None)
    if kernels.name == "cpu_kernels":  # the kernels cut panels from the stacks: kept stacked
        assert isinstance(engine(config, params).params["layers"], dict)


def test_copies_share_one_prefill_and_equal_repeated_prompts(tiny):
    """`start(copies=3)` (each prompt prefilled once, its keys and values in 3 slots) decodes
    as the prompts repeated 3 times do."""
    config, params = tiny
    ids, mask = prompts()
    sp = SamplingParams(max_tokens=5, **GREEDY)
    a, b = engine(config, params, max_num_seqs=12), engine(config, params, max_num_seqs=12)
    shared = a.start(ids, mask, copies=3)
    repeated = b.start(np.repeat(ids, 3, axis=0), np.repeat(mask, 3, axis=0))
    np.testing.assert_array_equal(shared, repeated)
    ta, tb = a.decode(shared, sp), b.decode(repeated, sp)
    for x, y in zip(ta.tokens, tb.tokens, strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(ta.log_probs, tb.log_probs, strict=True):
        np.testing.assert_allclose(x, y, atol=LOG_PROB_ATOL)  # the same programs (above)
    assert [a.conversation(s).prompt for s in shared] == [
        b.conversation(s).prompt for s in repeated
    ]
    with pytest.raises(ValueError, match="3 prompts x 2 copies but 3 free slots"):
        a.start(ids, mask, copies=2)
