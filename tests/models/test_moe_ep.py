"""`jaxrl.models.moe_ep` on 8 fake CPU devices (tests/conftest.py), mesh (dp, ep), tokens over
both: the gather dispatch equals `experts_sorted` in values and gradients for ep = 1, 2, 4, 8;
the all-to-all dispatch too when the capacity drops nothing; with a small capacity it drops
exactly the pairs a numpy count of the policy drops (per device, per expert the first C valid
pairs in token order) and equals `experts_sorted` with those pairs' weights zeroed."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models.moe import experts_sorted
from jaxrl.models.moe_ep import capacity, experts_parallel
from jaxrl.sharding import make_mesh
from jaxrl.testing.numerics import assert_close_to_scale

T, D, F, E, K = 32, 16, 24, 8, 2
DEVICES = 8
TOKEN_AXES = ("dp", "ep")
# The same float32 sums in another order (the psum over ep of the experts' shares, float32
# accumulation): measured <= 2.1e-7 of the scale for the values, 1e-5 leaves 50x; <= 3.5e-7
# for the gradients (three matmuls and the collectives' transposes), COMPOSITE_RTOL (1e-4).
VALUE_RTOL = 1e-5


def _inputs(t=T, skew=0.0, seed=0):
    """Random tokens, experts and routing: k distinct experts per token, drawn with logits
    `skew * (E - 1 - e)` (0: uniform; larger: the low experts crowd)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(t, D)).astype(np.float32)
    moe = {"w_gate_edf": rng.normal(size=(E, D, F)) * 0.3,
           "w_up_edf": rng.normal(size=(E, D, F)) * 0.3,
           "w_down_efd": rng.normal(size=(E, F, D)) * 0.3}  # fmt: skip
    gumbel = rng.gumbel(size=(t, E)) + skew * np.arange(E - 1, -1, -1)
    experts = np.argsort(-gumbel, axis=-1)[:, :K].astype(np.int32)  # top-k: distinct
    weights = rng.random((t, K)).astype(np.float32)
    moe = {name: jnp.asarray(w, jnp.float32) for name, w in moe.items()}
    return jnp.asarray(x), moe, jnp.asarray(weights), jnp.asarray(experts)


def _value_and_grads(path, x, moe, weights, experts, probe):
    """y and the gradients of sum(y * probe) w.r.t. x, the expert weights and the weights."""

    def loss(x, moe, weights):
        y = path(x, moe, weights, experts)
        return jnp.sum(y * probe), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(x, moe, weights)
    return y, grads


def _parallel(mesh, **kw):
    def path(x, moe, weights, experts):
        return experts_parallel(x, moe, weights, experts, mesh=mesh, token_axes=TOKEN_AXES,
                                **kw)[0]  # fmt: skip

    return path


def _assert_equal_to_reference(ours, ref):
    (y, (dx, dmoe, dw)), (ry, (rdx, rmoe, rdw)) = ours, ref
    assert_close_to_scale(y, ry, rtol=VALUE_RTOL, what="y")
    assert_close_to_scale(dx, rdx, what="dx")
    assert_close_to_scale(dw, rdw, what="dweights")
    for name in dmoe:
        assert_close_to_scale(dmoe[name], rmoe[name], what=f"d{name}")


def _probe(t=T):
    return jnp.asarray(np.random.default_rng(9).normal(size=(t, D)), jnp.float32)


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_gather_dispatch_equals_sorted(ep):
    mesh = make_mesh({"dp": DEVICES // ep, "ep": ep})
    x, moe, weights, experts = _inputs()
    ours = _value_and_grads(_parallel(mesh), x, moe, weights, experts, _probe())
    _assert_equal_to_reference(ours, _value_and_grads(experts_sorted, x, moe, weights, experts,
                                                      _probe()))  # fmt: skip
    _, dropped = jax.jit(_parallel_with_count(mesh))(x, moe, weights, experts)
    assert int(dropped) == 0


def _parallel_with_count(mesh, **kw):
    def run(x, moe, weights, experts, valid=None):
        return experts_parallel(x, moe, weights, experts, mesh=mesh, token_axes=TOKEN_AXES,
                                valid_t=valid, **kw)  # fmt: skip

    return run


@pytest.mark.parametrize("ep", [2, 8])
def test_all_to_all_without_drops_equals_sorted(ep):
    mesh = make_mesh({"dp": DEVICES // ep, "ep": ep})
    x, moe, weights, experts = _inputs()
    # An expert gets at most T_l pairs of a device (the k choices are distinct): C = T_l.
    factor = E / K
    assert capacity(factor, T // DEVICES, K, E) == T // DEVICES
    ours = _value_and_grads(_parallel(mesh, capacity_factor=factor), x, moe, weights, experts,
                            _probe())  # fmt: skip
    _assert_equal_to_reference(ours, _value_and_grads(experts_sorted, x, moe, weights, experts,
                                                      _probe()))  # fmt: skip


def _numpy_keep(experts, valid, shards, cap):
    """The drop policy in plain loops: per device shard, in token order, an expert keeps the
    first `cap` pairs of valid tokens; padding neither counts nor takes capacity."""
    keep = np.zeros(experts.shape, bool)
    t_local = experts.shape[0] // shards
    for s in range(shards):
        taken = np.zeros(E, int)
        for t in range(s * t_local, (s + 1) * t_local):
            for j in range(K):
                e = experts[t, j]
                if valid[t] and taken[e] < cap:
                    keep[t, j] = True
                    taken[e] += 1
    return keep


@pytest.mark.parametrize("ep", [2, 8])
def test_all_to_all_drops_over_capacity_pairs(ep):
    t = 64  # 8 tokens per device: C = ceil(1.0 * 8 * 2 / 8) = 2
    mesh = make_mesh({"dp": DEVICES // ep, "ep": ep})
    x, moe, weights, experts = _inputs(t, skew=0.7, seed=ep)
    valid = np.random.default_rng(ep).random(t) > 0.25
    cap = capacity(1.0, t // DEVICES, K, E)
    assert cap == 2
    keep = _numpy_keep(np.asarray(experts), valid, DEVICES, cap)
    want_dropped = int((valid[:, None] & ~keep).sum())
    assert want_dropped > 5  # the skew makes the capacity bite
    run = jax.jit(_parallel_with_count(mesh, capacity_factor=1.0))
    y, dropped = run(x, moe, weights, experts, jnp.asarray(valid))
    assert dropped.dtype == jnp.int32 and dropped.shape == ()
    assert int(dropped) == want_dropped
    # a dropped pair (and a padding token's) contributes exactly 0: zero its weight
    kept_weights = weights * jnp.asarray(keep, jnp.float32)
    ref = jax.jit(experts_sorted)(x, moe, kept_weights, experts)
    assert_close_to_scale(y, ref, rtol=VALUE_RTOL, what="y")
    assert not np.asarray(y)[~valid].any()
    # the gather dispatch with the same padding: padding gives 0, the rest is kept
    y_gather, none = jax.jit(_parallel_with_count(mesh))(x, moe, weights, experts,
                                                          jnp.asarray(valid))  # fmt: skip
    want = jax.jit(experts_sorted)(x, moe, weights * jnp.asarray(valid[:, None], jnp.float32),
                                   experts)  # fmt: skip
    assert_close_to_scale(y_gather, want, rtol=VALUE_RTOL, what="y (gather)")
    assert int(none) == 0


def test_experts_not_divisible_by_the_axis_are_refused():
    mesh = make_mesh({"dp": 2, "ep": 4})
    x, moe, weights, experts = _inputs()
    moe6 = {name: w[:6] for name, w in moe.items()}
    experts6 = experts % 6
    with pytest.raises(ValueError, match=r"num_experts=6 .* size 4; choose an ep size"):
        experts_parallel(x, moe6, weights, experts6, mesh=mesh, token_axes=TOKEN_AXES)
    with pytest.raises(ValueError, match="add 'ep'"):
        experts_parallel(x, moe, weights, experts, mesh=mesh, token_axes=("dp",))
    assert math.ceil(1.25 * 4 * 2 / 8) == capacity(1.25, 4, 2, 8) == 2


# ------------------------------------------------------------------ the decoder on the mesh


def _decoder():
    import jaxrl.models as M
    from jaxrl.models.moe import MoeSpec

    config = M.DecoderConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32,
                             intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=8, qk_norm=True, moe_intermediate_size=F,
                             moe=MoeSpec(num_experts=E, top_k=K, norm_topk_prob=True))  # fmt: skip
    return config, M.init_params(config, jax.random.key(0), std=0.3)


def _loss(config, params, ids, mask):
    """A policy-gradient-like loss on the next-token log-probs plus the router's losses."""
    import jaxrl.models as M
    from jaxrl.models.moe import load_balancing_loss, router_z_loss
    from jaxrl.models.transformer import hidden_states_and_router

    h, routing = hidden_states_and_router(config, params, ids, mask)
    router = routing.stats
    lp, _ = M.token_log_probs(config, params, h[:, :-1], ids[:, 1:])
    both = mask[:, :-1] * mask[:, 1:]  # real tokens predicting real tokens (padding's output
    # is the experts' under the sorted path and 0 under capacity: it must not count)
    pg = -jnp.sum(lp * both) / jnp.sum(both)
    return pg + 0.1 * load_balancing_loss(router) + 0.01 * router_z_loss(router), router


@pytest.mark.parametrize("sizes", [(1, 4, 2, 1), (1, 1, 8, 1)],
                         ids=lambda s: "dp{}xfsdp{}xep{}xtp{}".format(*s))  # fmt: skip
def test_the_decoder_under_ep_equals_one_device(sizes):
    """Train layouts with `ep` = 2 and 8 (experts split, tokens sent to them and back): the
    loss, the router sums and every gradient equal one device's; the expert weights lie
    split over `ep`. With ep = 2, a capacity large enough for every pair gives the same
    numbers and a small one drops pairs (counted) and still trains."""
    from jaxrl.models.params import param_shardings
    from jaxrl.sharding import TRAIN_RULES, Layout, train_mesh, use_layout

    config, params = _decoder()
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 64, (8, 12)))
    mask = jnp.asarray((np.arange(12)[None] >= rng.integers(0, 5, (8, 1))).astype(np.int32))
    grad_fn = jax.value_and_grad(_loss, argnums=1, has_aux=True)
    (ref_loss, ref_router), ref_grads = jax.jit(grad_fn, static_argnums=0)(config, params, ids,
                                                                         mask)  # fmt: skip
    dp, fsdp, ep, tp = sizes
    layout = Layout.create(train_mesh(dict(dp=dp, fsdp=fsdp, ep=ep, tp=tp, sp=1)), TRAIN_RULES)
    shardings = param_shardings(config, layout)
    assert shardings["layers"]["moe"]["w_gate_edf"].spec[1] == "ep"
    placed = jax.device_put(params, shardings)
    tokens = layout.tokens(ids.shape)
    ids_, mask_ = jax.device_put(ids, tokens), jax.device_put(mask, tokens)
    roomy = config.replace(moe=config.moe.__class__(**{**vars(config.moe),
                                                       "capacity_factor": E / K}))  # fmt: skip
    tight = config.replace(moe=config.moe.__class__(**{**vars(config.moe),
                                                       "capacity_factor": 0.5}))  # fmt: skip
    with use_layout(layout):
        step = jax.jit(grad_fn, static_argnums=0)
        for c in (config, roomy) if ep == 2 else (config,):
            (loss, router), grads = step(c, placed, ids_, mask_)
            assert_close_to_scale(loss, ref_loss, rtol=VALUE_RTOL)
            jax.tree.map(lambda a, b: assert_close_to_scale(a, b, rtol=VALUE_RTOL), router,
                         ref_router)  # fmt: skip
            jax.tree.map(lambda a, b: assert_close_to_scale(a, b, rtol=1e-4), grads, ref_grads)
            assert float(jnp.sum(router.dropped)) == 0
        if ep != 2:
            return
        (loss, router), grads = step(tight, placed, ids_, mask_)
    real_pairs = float(jnp.sum(mask)) * K * config.num_layers
    assert 0 < float(jnp.sum(router.dropped)) < real_pairs
    assert np.isfinite(float(loss)) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
