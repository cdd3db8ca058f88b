"""agg_loss, KL estimators, KL rewards and controllers, value and entropy losses vs verl 0.9.1.

Compared with `assert_close`'s float32 tolerance (its reason: `jaxrl.testing.verl_compare`)
unless a comparison states another.
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl.core_algos as C
from jaxrl.testing.verl_compare import assert_close, to_torch, verl_core_algos

SHAPES = [(1, 1), (4, 7), (9, 16)]


def problem(b, r, seed=0, holes=True):
    rng = np.random.RandomState(seed)
    loss_mat = rng.randn(b, r).astype(np.float32)
    lengths = rng.randint(1, r + 1, b)
    mask = (np.arange(r)[None] < lengths[:, None]).astype(np.float32)
    if holes and r > 3:
        mask[:, 1] = 0.0  # multi-turn: an observation token inside the response
    if b > 2:
        mask[2] = 0.0  # a fully masked row (excluded from sequence counts)
    return loss_mat, mask


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", C.LOSS_AGG_MODES)
def test_agg_loss_local_counts(shape, mode):
    verl = verl_core_algos()
    loss_mat, mask = problem(*shape)
    ref = verl.agg_loss(to_torch(loss_mat), to_torch(mask), mode)
    assert_close(C.agg_loss(loss_mat, mask, mode), ref)


@pytest.mark.parametrize("mode", C.LOSS_AGG_MODES)
@pytest.mark.parametrize("scale", [None, 3.0])
def test_agg_loss_global_counts(mode, scale):
    verl = verl_core_algos()
    loss_mat, mask = problem(6, 9, seed=1)
    info = dict(dp_size=2, batch_num_tokens=37, global_batch_size=11, loss_scale_factor=scale)
    ref = verl.agg_loss(to_torch(loss_mat), to_torch(mask), mode, **info)
    assert_close(C.agg_loss(loss_mat, mask, mode, **info), ref)
    jax_info = {**info, "batch_num_tokens": jnp.float32(37), "global_batch_size": jnp.float32(11)}
    assert_close(jax.jit(C.agg_loss, static_argnums=2)(loss_mat, mask, mode, **jax_info), ref)


def test_agg_loss_needs_global_counts_with_dp():
    loss_mat, mask = problem(2, 3)
    with pytest.raises(ValueError, match="batch_num_tokens is required"):
        C.agg_loss(loss_mat, mask, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="invalid loss_agg_mode"):
        C.agg_loss(loss_mat, mask, "mean")


@pytest.mark.parametrize("mode", C.LOSS_AGG_MODES)
@pytest.mark.parametrize("splits", [[8], [4, 4], [1, 3, 4], [2, 1, 1, 1, 3]])
def test_micro_batch_split_invariance(mode, splits):
    """Summing micro-batch losses with the mini-batch's global counts equals the whole loss,
    and so does the gradient, however the mini-batch is split (verl's bug family)."""
    loss_mat, mask = problem(8, 10, seed=3)
    weights = jnp.asarray(np.random.RandomState(4).randn(8, 10).astype(np.float32))

    def whole(w):
        return C.agg_loss(loss_mat * w, mask, mode)

    info = C.global_batch_info(jnp.asarray(mask))

    def accumulated(w):
        total, start = 0.0, 0
        for size in splits:
            rows = slice(start, start + size)
            total = total + C.agg_loss(loss_mat[rows] * w[rows], mask[rows], mode, **info)
            start += size
        return total

    # The same float32 terms t summed in other groupings: a sum of n terms in any order is
    # within (n - 1) u sum|t| of the exact one (u = 2^-24, Higham's bound), here with sum|t|
    # the loss aggregated over |t| and n the unmasked terms plus two divisions by counts. Not
    # an absolute tolerance: token-sum adds terms of sum|t| = 18 into 0.18 (measured 5.4e-7,
    # 0.014 of the bound; a wrong count is off by > 1e-2 relative).
    magnitude = float(C.agg_loss(np.abs(loss_mat * weights), mask, mode))
    bound = (mask.sum() + 2) * 2.0**-24 * magnitude
    assert_close(accumulated(weights), whole(weights), atol=bound, rtol=0)
    # Each gradient element is one product and one division, no sum: within an ulp (< 3e-7 of
    # values < 2.6); measured exact.
    assert_close(jax.grad(accumulated)(weights), jax.grad(whole)(weights), atol=1e-6)


def test_local_counts_are_not_split_invariant():
    """Why the global counts matter: per-micro-batch means do not add up to the whole."""
    loss_mat, mask = problem(8, 10, seed=3)
    whole = C.agg_loss(loss_mat, mask, "token-mean")
    halves = sum(C.agg_loss(loss_mat[s], mask[s], "token-mean") for s in (slice(0, 4), slice(4, 8)))
    # 0.12 apart (a property of the counts); rounding is ~1e-7
    assert abs(float(halves) - float(whole)) > 1e-3


def log_probs(b, r, seed=0):
    rng = np.random.RandomState(seed)
    logprob = (rng.randn(b, r) - 2).astype(np.float32)
    ref = (rng.randn(b, r) - 2).astype(np.float32)
    ref[0, 0] = logprob[0, 0] + 30.0  # beyond the +-20 clamp of k3
    if r > 1:
        ref[0, 1] = logprob[0, 1] - 30.0
    return logprob, ref


@pytest.mark.parametrize("name", [*C.KL_PENALTIES, *(k + "+" for k in C.KL_PENALTIES)])
def test_kl_penalty_value_and_gradient(name):
    verl = verl_core_algos()
    logprob, ref_logprob = log_probs(5, 6, seed=2)
    t_lp = to_torch(logprob, requires_grad=True)
    ref = verl.kl_penalty(t_lp, to_torch(ref_logprob), name)
    ref.sum().backward()
    assert_close(C.kl_penalty(logprob, ref_logprob, name), ref)
    grad = jax.grad(lambda lp: C.kl_penalty(lp, ref_logprob, name).sum())(jnp.asarray(logprob))
    assert_close(grad, t_lp.grad)
    jitted = jax.jit(C.kl_penalty, static_argnums=2)(logprob, ref_logprob, name)
    assert_close(jitted, ref)


def test_kl_penalty_unknown():
    with pytest.raises(NotImplementedError, match="full"):
        C.kl_penalty(jnp.zeros(2), jnp.zeros(2), "full")


def test_compute_rewards():
    verl = verl_core_algos()
    scores, _ = problem(4, 5)
    old, ref = log_probs(4, 5)
    expected = verl.compute_rewards(to_torch(scores), to_torch(old), to_torch(ref), 0.05)
    assert_close(C.compute_rewards(scores, old, ref, 0.05), expected)


@pytest.mark.parametrize("kind", ["fixed", "adaptive"])
def test_kl_controllers_follow_verl(kind):
    verl = verl_core_algos()
    settings = dict(type=kind, kl_coef=0.01, horizon=100, target_kl=0.05)
    ours = C.get_kl_controller(types.SimpleNamespace(**settings))
    ref = verl.get_kl_controller(types.SimpleNamespace(**settings))
    for kl, steps in [(0.2, 16), (0.001, 16), (0.06, 32), (jnp.float32(0.3), 8)]:
        ours.update(kl, steps)
        ref.update(float(kl), steps)
        # Python floats (float64), verl's formula: equal but for the order of a few operations
        assert ours.value == pytest.approx(ref.value, rel=1e-12)
    with pytest.raises(ValueError, match="horizon"):
        C.get_kl_controller({"type": "adaptive", "kl_coef": 0.1, "horizon": 0, "target_kl": 1})
    with pytest.raises(NotImplementedError):
        C.get_kl_controller({"type": "pid"})


@pytest.mark.parametrize("mode", C.LOSS_AGG_MODES)
def test_value_loss(mode):
    verl = verl_core_algos()
    rng = np.random.RandomState(5)
    b, r = 6, 8
    vpreds, returns, values = rng.randn(3, b, r).astype(np.float32)
    _, mask = problem(b, r, seed=5)
    t_vpreds = to_torch(vpreds, requires_grad=True)
    info = dict(batch_num_tokens=30, global_batch_size=5)
    ref_loss, ref_frac = verl.compute_value_loss(
        t_vpreds, to_torch(returns), to_torch(values), to_torch(mask), 0.5, mode, **info
    )
    ref_loss.backward()
    fn = functools.partial(C.compute_value_loss, cliprange_value=0.5, loss_agg_mode=mode, **info)
    loss, frac = fn(vpreds, returns, values, mask)
    assert_close(loss, ref_loss)
    assert_close(frac, ref_frac)
    grad = jax.grad(lambda v: fn(v, returns, values, mask)[0])(jnp.asarray(vpreds))
    assert_close(grad, t_vpreds.grad)
    stacked = jax.vmap(fn)(*(jnp.stack([x, x]) for x in (vpreds, returns, values, mask)))
    assert_close(stacked[0], jnp.stack([loss, loss]))


def test_entropy_loss():
    verl = verl_core_algos()
    rng = np.random.RandomState(6)
    logits = rng.randn(3, 4, 11).astype(np.float32) * 3
    _, mask = problem(3, 4, seed=6)
    for mode in C.LOSS_AGG_MODES:
        ref = verl.compute_entropy_loss(to_torch(logits), to_torch(mask), mode)
        assert_close(C.compute_entropy_loss(logits, mask, mode), ref)


def test_masked_helpers_match_verl():
    from jaxrl.testing.reference import import_reference

    verl_f = import_reference("verl.utils.torch_functional")
    values, mask = problem(5, 6, seed=7)
    assert_close(C.masked_mean(values, mask), verl_f.masked_mean(to_torch(values), to_torch(mask)))
    assert_close(C.masked_var(values, mask), verl_f.masked_var(to_torch(values), to_torch(mask)))
    assert_close(
        C.masked_whiten(values, mask), verl_f.masked_whiten(to_torch(values), to_torch(mask))
    )
    # Fewer than two masked elements: verl raises; jaxrl (under jit) gives variance 0.
    one = np.zeros_like(mask)
    one[0, 0] = 1.0
    assert float(C.masked_var(values, one)) == 0.0
    assert np.isfinite(np.asarray(C.masked_whiten(values, one))).all()


def test_dense_group_ids():
    ids = jnp.array([1000003, 7, 7, -2, 1000003, 5])
    dense = np.asarray(jax.jit(C.dense_group_ids)(ids))
    assert dense.max() < len(ids)
    for i in range(len(ids)):
        for j in range(len(ids)):
            assert (dense[i] == dense[j]) == (ids[i] == ids[j])


def test_config_choices_are_the_registries():
    """The config checks list exactly the names core_algos registers (and verl's)."""
    import jaxrl.core_algos.advantages
    import jaxrl.core_algos.policy_losses  # noqa: F401
    from jaxrl.config import checks

    verl = verl_core_algos()
    assert set(checks.ADV_ESTIMATORS) == set(C.ADV_ESTIMATOR_REGISTRY)
    assert set(checks.ADV_ESTIMATORS) == set(verl.ADV_ESTIMATOR_REGISTRY)
    assert set(checks.POLICY_LOSSES) == set(C.POLICY_LOSS_REGISTRY)
    assert set(checks.POLICY_LOSSES) == set(verl.POLICY_LOSS_REGISTRY)
    assert set(checks.LOSS_AGG_MODES) == set(C.LOSS_AGG_MODES)
