"""Policy losses vs verl 0.9.1: loss, metrics and d loss / d log_prob, under jit and vmap.

Every comparison runs verl's torch function and ours on the same float32 inputs and checks the
loss, every metric (same key set) and the gradient with respect to `log_prob` (torch autograd
vs `jax.grad`) within `assert_close`'s float32 tolerance (1e-5; its reason:
`jaxrl.testing.verl_compare`). The inputs cover length-1 responses, masks with holes (multi-turn)
and a fully masked row, log-ratios of +-30 (beyond the +-20 clamp), log-ratios exactly on a
clamp bound, an exactly on-policy row (log-ratio 0: the kink of abs), both advantage signs,
`rollout_is_weights` given and None, and global batch counts that differ from the local ones.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl.core_algos.policy_losses as PL
from jaxrl.core_algos import LOSS_AGG_MODES, POLICY_LOSS_REGISTRY, get_policy_loss_fn
from jaxrl.core_algos.policy_losses_common import float64_floor_product
from jaxrl.core_algos.policy_losses_cov import random_subset
from jaxrl.core_algos.policy_losses_rollout_corr import (
    compute_rollout_correction_and_rejection_mask,
)
from jaxrl.testing.verl_compare import (
    actor_configs,
    assert_close,
    assert_metrics_close,
    to_torch,
    verl_core_algos,
)

ALL_LOSSES = (
    "vanilla",
    "dppo_tv",
    "dppo_kl",
    "gspo",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dro",
    "cispo",
    "bypass_mode",
)
# verl asserts `isinstance(config, ActorConfig)` in these; the others take its DictConfig.
NEEDS_ACTOR_CONFIG = ("gspo", "sapo", "cispo")

# (shape, seed, rollout_is_weights given, global batch info given)
CASES = (
    ((1, 1), 0, False, False),
    ((1, 1), 1, True, True),
    ((4, 6), 2, False, True),
    ((4, 6), 3, True, False),
    ((6, 9), 4, True, True),
    ((6, 9), 5, False, False),
)


def make_problem(b: int, r: int, seed: int, weights: bool = False) -> dict:
    """Random float32 inputs with every edge case the shape allows (module docstring)."""
    rng = np.random.RandomState(seed)
    old = -2.0 * np.abs(rng.randn(b, r)) - 0.05
    log_prob = old + 0.3 * rng.randn(b, r)
    advantages = rng.randn(b, r)
    lengths = rng.randint(1, r + 1, b)
    if b > 1:
        lengths[1] = 1  # a length-1 response
    if b > 4:
        lengths[4] = r
    mask = np.arange(r)[None] < lengths[:, None]
    if r > 3:
        mask[lengths > 2, 1] = False  # a hole: an observation token inside a multi-turn response
    if b > 3:
        mask[3] = False  # a fully masked row
    old[0, 0], log_prob[0, 0] = -32.0, -2.0  # log-ratio +30
    if b > 1:
        old[1, 0], log_prob[1, 0] = -1.0, -31.0  # log-ratio -30
    if b > 2:
        log_prob[2] = old[2]  # on-policy: log-ratio exactly 0
    if b > 4 and r > 3:
        # Exactly on a clamp bound, where torch passes the full gradient (jnp.clip half):
        # the +-20 log-ratio clamp, and geo_mean's log-ratio clip of variant 1 (0.25).
        old[4, 0], log_prob[4, 0] = -21.0, -1.0
        old[4, 2], log_prob[4, 2] = -1.25, -1.0
    problem = {
        "old_log_prob": old,
        "log_prob": log_prob,
        "advantages": advantages,
        "response_mask": mask,
        "rollout_is_weights": rng.uniform(0.5, 1.5, (b, r)) if weights else None,
    }
    return {k: None if v is None else np.asarray(v, np.float32) for k, v in problem.items()}


def global_info(mask: np.ndarray, seed: int) -> dict:
    """Global counts deliberately different from the local ones (dp_size 1)."""
    return {
        "dp_size": 1,
        "batch_num_tokens": int(mask.sum()) + 7,
        "global_batch_size": int((mask.sum(-1) > 0).sum()) + 3,
        "loss_scale_factor": None if seed % 2 else 11.0,
    }


def make_configs(name: str, overrides: dict, info: dict):
    """(verl config, jaxrl SimpleNamespace config) with verl's actor defaults."""
    overrides = dict(overrides)
    policy_loss = dict(overrides.pop("policy_loss", {}))
    correction = policy_loss.pop("rollout_correction", None)
    verl_cfg, ours = actor_configs(
        policy_loss={**policy_loss, "loss_mode": name}, global_batch_info=info, **overrides
    )
    if correction is not None:
        from omegaconf import OmegaConf

        verl_cfg.policy_loss.rollout_correction = OmegaConf.create(correction)
        ours.policy_loss.rollout_correction = types.SimpleNamespace(**correction)
    return verl_cfg, ours


def verl_actor_config(verl_cfg):
    """verl's typed `ActorConfig` with the values of its DictConfig (for NEEDS_ACTOR_CONFIG):
    a `PolicyLossConfig` inside, with a typed `RolloutCorrectionConfig` when one is set."""
    from omegaconf import OmegaConf
    from verl.trainer.config import RolloutCorrectionConfig
    from verl.workers.config import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    values = OmegaConf.to_container(verl_cfg)
    policy_loss = values["policy_loss"]
    if "rollout_correction" in policy_loss:
        policy_loss["rollout_correction"] = RolloutCorrectionConfig(
            **policy_loss["rollout_correction"]
        )
    values["policy_loss"] = PolicyLossConfig(**policy_loss)
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **values)


def run_verl(fn, problem: dict, mode: str, config):
    """verl's (loss, metrics, d loss / d log_prob)."""
    log_prob = to_torch(problem["log_prob"], requires_grad=True)
    weights = problem["rollout_is_weights"]
    loss, metrics = fn(
        to_torch(problem["old_log_prob"]),
        log_prob,
        to_torch(problem["advantages"]),
        to_torch(problem["response_mask"]),
        mode,
        config,
        None if weights is None else to_torch(weights),
    )
    loss.backward()
    grad = log_prob.grad
    grad = np.zeros_like(problem["log_prob"]) if grad is None else grad.numpy()
    return loss.detach().numpy(), metrics, grad


def run_ours(fn, problem: dict, mode: str, config, **kwargs):
    """Our (loss, metrics, d loss / d log_prob) (eager)."""

    def loss_fn(log_prob):
        return fn(
            problem["old_log_prob"],
            log_prob,
            problem["advantages"],
            problem["response_mask"],
            mode,
            config,
            problem["rollout_is_weights"],
            **kwargs,
        )

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(problem["log_prob"])
    return loss, metrics, grad


def compare(name: str, ours_fn, verl_fn, overrides: dict, mode: str, cases=CASES):
    for shape, seed, weights, with_info in cases:
        problem = make_problem(*shape, seed, weights=weights)
        info = global_info(problem["response_mask"], seed) if with_info else {}
        verl_cfg, cfg = make_configs(name, overrides, info)
        if name in NEEDS_ACTOR_CONFIG:
            verl_cfg = verl_actor_config(verl_cfg)
        ref_loss, ref_metrics, ref_grad = run_verl(verl_fn, problem, mode, verl_cfg)
        loss, metrics, grad = run_ours(ours_fn, problem, mode, cfg)
        where = f"{name} {overrides} {mode} shape={shape} seed={seed}"
        assert_close(loss, ref_loss, what=f"loss: {where}")
        assert_close(grad, ref_grad, what=f"grad: {where}")
        try:
            assert_metrics_close(metrics, ref_metrics)
        except AssertionError as error:
            raise AssertionError(f"metrics: {where}") from error


VARIANTS = {
    "vanilla": [
        {},
        {"clip_ratio_low": 0.1, "clip_ratio_high": 0.28, "clip_ratio_c": 2.0},
        {"clip_ratio": 0.15, "clip_ratio_low": None, "clip_ratio_high": None},
    ],
    "dppo_tv": [{}, {"clip_ratio_low": 0.05, "clip_ratio_high": 0.1, "clip_ratio_c": 20.0}],
    "dppo_kl": [{}, {"clip_ratio_low": 0.01, "clip_ratio_high": 0.02}],
    "gspo": [{}, {"clip_ratio_low": 0.0003, "clip_ratio_high": 0.0004}],
    "sapo": [{}, {"tau_pos": 2.0, "tau_neg": 3.0}],
    "gpg": [{}],
    "geo_mean": [{}, {"clip_ratio_low": 0.4, "clip_ratio_high": 0.25}],
    "dro": [{"policy_loss": {"dro_beta": 0.1}}, {"policy_loss": {"dro_beta": 2.0}}],
    "cispo": [{}, {"clip_ratio_low": 1.0, "clip_ratio_high": 0.28}],
    # k = 1 (the default ratio) and k = 20% of the tokens.
    "kl_cov": [{}, {"policy_loss": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 1.0}}],
    # The configurations where verl's random selection is deterministic: no eligible token,
    # or k >= #eligible (every eligible token dropped).
    "clip_cov": [
        {"policy_loss": {"clip_cov_lb": 1e6}},
        {"policy_loss": {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.2, "clip_cov_ub": 5.0}},
        {"policy_loss": {"clip_cov_ratio": 1.0, "clip_cov_lb": -1e9, "clip_cov_ub": 1e9}},
    ],
}
LOSS_VARIANTS = [(name, i) for name, variants in VARIANTS.items() for i in range(len(variants))]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize(("name", "variant"), LOSS_VARIANTS)
def test_matches_verl(name, variant, mode):
    verl = verl_core_algos()
    compare(
        name, get_policy_loss_fn(name), verl.get_policy_loss_fn(name), VARIANTS[name][variant], mode
    )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_reinforce_matches_verl(mode):
    verl = verl_core_algos()
    compare(
        "reinforce", PL.compute_policy_loss_reinforce, verl.compute_policy_loss_reinforce, {}, mode
    )


def correction(**kwargs) -> dict:
    values = dict(
        loss_type="reinforce",
        rollout_is=None,
        rollout_is_threshold=2.0,
        rollout_is_batch_normalize=False,
        rollout_rs=None,
        rollout_rs_threshold=None,
    )
    return {**values, **kwargs}


CORRECTIONS = [
    correction(loss_type="ppo_clip"),
    correction(loss_type="ppo_clip", rollout_is="sequence"),
    correction(rollout_is="token"),
    correction(rollout_is="token", rollout_is_threshold="0.5_2.0", rollout_is_batch_normalize=True),
    correction(
        rollout_is="sequence",
        rollout_is_threshold=5.0,
        rollout_is_batch_normalize=True,
        rollout_rs="seq_mean_k3",
        rollout_rs_threshold=0.5,
    ),
    correction(
        loss_type="ppo_clip",
        rollout_is="token",
        rollout_rs="token_k1",
        rollout_rs_threshold="0.5_1.5",
    ),
    correction(rollout_rs="token_k2,token_k3,seq_sum_k1", rollout_rs_threshold="0.1,0.2,0.3_3.0"),
    correction(
        rollout_is="sequence",
        rollout_is_threshold="0.2_3.0",
        rollout_rs="seq_sum_k2,seq_mean_k1,seq_max_k2,seq_max_k3,seq_sum_k3,seq_mean_k2",
        rollout_rs_threshold=2.0,
    ),
    correction(rollout_rs=" token_k1, token_k1 ,", rollout_rs_threshold="1.5"),
]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("index", range(len(CORRECTIONS)))
def test_bypass_mode_matches_verl(index, mode):
    verl = verl_core_algos()
    settings = CORRECTIONS[index]
    overrides = {"policy_loss": {"rollout_correction": settings}}
    cases = (CASES[1], CASES[2], CASES[4])
    if "_" in str(settings["rollout_is_threshold"]):
        # verl divides by zero (ZeroDivisionError) when IcePop zeroes every weight, as it does
        # for the single +30 token of the (1, 1) case; see test_icepop_without_weights.
        cases = (CASES[2], CASES[3], CASES[4])
    # Bypass mode ignores `rollout_is_weights`; some cases pass them anyway.
    compare(
        "bypass_mode",
        PL.compute_policy_loss_bypass_mode,
        verl.compute_policy_loss_bypass_mode,
        overrides,
        mode,
        cases=cases,
    )


@pytest.mark.parametrize("index", [3, 4, 7])
def test_rollout_correction_weights_and_mask_match_verl(index):
    verl_corr = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    settings = {k: v for k, v in CORRECTIONS[index].items() if k != "loss_type"}
    problem = make_problem(6, 9, seed=index)
    args = (problem["log_prob"], problem["old_log_prob"], problem["response_mask"])
    ref_weights, ref_mask, ref_metrics = verl_corr.compute_rollout_correction_and_rejection_mask(
        *map(to_torch, args), **settings
    )
    weights, mask, metrics = compute_rollout_correction_and_rejection_mask(*args, **settings)
    assert_close(weights, ref_weights.batch["rollout_is_weights"])
    np.testing.assert_array_equal(mask, ref_mask.numpy())  # exact: a 0/1 mask
    assert_metrics_close(metrics, ref_metrics)


def test_icepop_without_weights():
    """Every weight outside the IcePop band: verl crashes (1 / 0.0 in Python); ours gives inf."""
    problem = make_problem(1, 1, seed=1)
    args = (problem["log_prob"], problem["old_log_prob"], problem["response_mask"])
    settings = {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0"}
    weights, _, metrics = compute_rollout_correction_and_rejection_mask(*args, **settings)
    assert float(weights.sum()) == 0.0
    assert np.isinf(metrics["rollout_corr/rollout_is_eff_sample_size"])


# One representative configuration per loss for the jit / vmap checks.
REPRESENTATIVE = {
    **{name: VARIANTS[name][-1] for name in VARIANTS},
    "bypass_mode": {"policy_loss": {"rollout_correction": CORRECTIONS[7]}},
}


def _inputs(problem: dict) -> tuple:
    keys = ("old_log_prob", "log_prob", "advantages", "response_mask", "rollout_is_weights")
    return tuple(jnp.asarray(problem[k]) for k in keys)


@pytest.mark.parametrize("kind", ["namespace", "dictconfig", "actorconfig"])
@pytest.mark.parametrize("name", [*ALL_LOSSES, "reinforce"])
def test_verl_config_objects(name, kind):
    """DESIGN contract 3: each loss takes a `types.SimpleNamespace` with verl's attribute names,
    verl's own DictConfig, or verl's typed `ActorConfig` (with `global_batch_info` a plain dict,
    as verl's has it), and gives verl's result with verl's `ActorConfig`."""
    verl = verl_core_algos()
    if name == "reinforce":
        ours_fn, verl_fn = PL.compute_policy_loss_reinforce, verl.compute_policy_loss_reinforce
    else:
        ours_fn, verl_fn = get_policy_loss_fn(name), verl.get_policy_loss_fn(name)
    problem = make_problem(6, 9, seed=8, weights=True)
    info = global_info(problem["response_mask"], 0)
    verl_cfg, namespace = make_configs(name, REPRESENTATIVE.get(name, {}), info)
    typed = verl_actor_config(verl_cfg)
    assert type(typed.global_batch_info) is dict and typed.global_batch_info == info
    config = {"namespace": namespace, "dictconfig": verl_cfg, "actorconfig": typed}[kind]
    for mode in ("token-mean", "seq-mean-token-sum-norm"):
        ref_loss, ref_metrics, ref_grad = run_verl(verl_fn, problem, mode, typed)
        loss, metrics, grad = run_ours(ours_fn, problem, mode, config)
        assert_close(loss, ref_loss, what=f"loss {name} {kind} {mode}")
        assert_close(grad, ref_grad, what=f"grad {name} {kind} {mode}")
        assert_metrics_close(metrics, ref_metrics)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_jit_matches_eager(name):
    problem = make_problem(6, 9, seed=7, weights=True)
    info = global_info(problem["response_mask"], 0)
    _, cfg = make_configs(name, REPRESENTATIVE[name], info)
    # Global counts as jax arrays (as a jitted trainer step computes them), closed over.
    cfg.global_batch_info = {
        k: v if k in ("dp_size", "loss_scale_factor") else jnp.asarray(v, jnp.float32)
        for k, v in info.items()
    }
    fn = functools.partial(
        get_policy_loss_fn(name), loss_agg_mode="seq-mean-token-sum-norm", config=cfg
    )

    def loss_and_grad(old, log_prob, adv, mask, weights):
        return jax.value_and_grad(
            lambda lp: fn(old, lp, adv, mask, rollout_is_weights=weights), has_aux=True
        )(log_prob)

    (loss, metrics), grad = loss_and_grad(*_inputs(problem))
    (jit_loss, jit_metrics), jit_grad = jax.jit(loss_and_grad)(*_inputs(problem))
    # Both ours: the same float32 ops, which XLA fuses (and may reorder within a sum) under
    # jit; atol 1e-6 (~8 ulps of the unit-scale inputs) for values that cancel, rtol 1e-5 for
    # the rest (ratios up to exp(20)); measured <= 0.013 of the tolerance.
    assert_close(jit_loss, loss, atol=1e-6)
    assert_close(jit_grad, grad, atol=1e-6)
    assert_metrics_close(jit_metrics, metrics, atol=1e-6)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_vmap_over_stacked_problems(name):
    problems = [make_problem(6, 9, seed, weights=True) for seed in (8, 9)]
    _, cfg = make_configs(name, REPRESENTATIVE[name], {})
    loss_fn = get_policy_loss_fn(name)

    def fn(old, log_prob, adv, mask, weights):
        return loss_fn(old, log_prob, adv, mask, "token-mean", cfg, weights)

    stacked = [jnp.stack(parts) for parts in zip(*map(_inputs, problems), strict=True)]
    # Under jit too: eager vmap re-dispatches every batched op and is slower than one compile.
    losses, metrics = jax.jit(jax.vmap(fn))(*stacked)
    for i, problem in enumerate(problems):
        loss_i, metrics_i = fn(*_inputs(problem))
        # jit(vmap) against eager: the same ops fused otherwise (see test_jit_matches_eager)
        assert_close(losses[i], loss_i, atol=1e-6)
        assert_metrics_close({k: v[i] for k, v in metrics.items()}, metrics_i, atol=1e-6)


def test_registry_holds_all_losses():
    assert set(ALL_LOSSES) <= set(POLICY_LOSS_REGISTRY)
    for name in ALL_LOSSES:
        assert get_policy_loss_fn(name).__module__.startswith("jaxrl.core_algos.policy_losses")
    verl = verl_core_algos()
    assert set(verl.POLICY_LOSS_REGISTRY) == set(ALL_LOSSES)


def _clip_cov_setup(mode: str = "token-mean"):
    problem = make_problem(6, 9, seed=11)
    overrides = {"policy_loss": {"clip_cov_ratio": 0.1, "clip_cov_lb": 0.05, "clip_cov_ub": 5.0}}
    verl_cfg, cfg = make_configs("clip_cov", overrides, {})
    return problem, verl_cfg, cfg


def _clip_cov_eligible(problem: dict, cfg) -> np.ndarray:
    """verl's eligibility rule, in numpy."""
    old, lp, adv = problem["old_log_prob"], problem["log_prob"], problem["advantages"]
    mask = problem["response_mask"] > 0
    ratio = np.exp(lp - old)
    unclipped, clipped = -adv * ratio, -adv * np.clip(ratio, 0.8, 1.2)
    cov = (adv - adv[mask].mean()) * (lp - lp[mask].mean())
    pl = cfg.policy_loss
    return mask & ~(clipped > unclipped) & (cov > pl.clip_cov_lb) & (cov < pl.clip_cov_ub)


def test_clip_cov_random_selection_matches_verl_in_distribution():
    """The random part: as many tokens as verl drops, only eligible ones, the rest exact."""
    verl = verl_core_algos()
    problem, verl_cfg, cfg = _clip_cov_setup()
    mask = problem["response_mask"]
    eligible = _clip_cov_eligible(problem, cfg)
    k = max(int(0.1 * mask.sum()), 1)
    assert 0 < k < eligible.sum(), "the setup must make the selection random"

    _, ref_metrics, _ = run_verl(verl.compute_policy_loss_clip_cov, problem, "token-mean", verl_cfg)
    no_drop_cfg = make_configs("clip_cov", {"policy_loss": {"clip_cov_lb": 1e6}}, {})[0]
    full_loss, _, full_grad = run_verl(
        verl.compute_policy_loss_clip_cov, problem, "token-mean", no_drop_cfg
    )
    ratio = np.exp(problem["log_prob"] - problem["old_log_prob"])
    adv = problem["advantages"]
    token_losses = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.2))

    dropped_sets = set()
    for seed in range(5):
        loss, metrics, grad = run_ours(
            PL.compute_policy_loss_clip_cov, problem, "token-mean", cfg, rng=jax.random.key(seed)
        )
        # The dropped fraction and the KL are deterministic in verl too.
        assert_metrics_close(metrics, ref_metrics)
        grad = np.asarray(grad)
        dropped = (grad == 0) & (full_grad != 0) & (mask > 0)
        assert dropped.sum() == k and not (dropped & ~eligible).any()
        # Every other token keeps verl's gradient, and the loss loses the dropped terms only.
        assert_close(np.where(dropped, 0.0, grad), np.where(dropped, 0.0, full_grad))
        assert_close(loss, full_loss - token_losses[dropped].sum() / mask.sum())
        dropped_sets.add(tuple(np.flatnonzero(dropped)))
    assert len(dropped_sets) > 1, "different keys must give different selections"


def test_clip_cov_selection_is_uniform():
    eligible = np.zeros((6, 9), bool)
    eligible[[0, 1, 2, 4, 5], 2:7] = True
    n, k, draws = int(eligible.sum()), 7, 4000
    keys = jax.random.split(jax.random.key(3), draws)
    picks = jax.jit(jax.vmap(lambda key: random_subset(jnp.asarray(eligible), jnp.int32(k), key)))(
        keys
    )
    picks = np.asarray(picks)
    assert (picks.sum(axis=(1, 2)) == k).all()
    assert not (picks & ~eligible).any()
    frequency = picks.mean(axis=0)[eligible]
    expected = k / n
    sigma = np.sqrt(expected * (1 - expected) / draws)
    # not rounding: a binomial 5-sigma band (fixed keys, so the verdict is deterministic)
    assert np.abs(frequency - expected).max() < 5 * sigma
    # Asking for more than there is selects everything eligible.
    everything = random_subset(jnp.asarray(eligible), jnp.int32(n + 3), jax.random.key(0))
    np.testing.assert_array_equal(everything, eligible)


@pytest.mark.parametrize("factor", [0.0002, 0.1, 0.29, 0.3, 0.7, 1.0, 2.5])
def test_float64_floor_product_equals_python(factor):
    max_count = 1200
    counts = jnp.arange(max_count + 1, dtype=jnp.int32)
    got = np.asarray(
        jax.jit(jax.vmap(lambda n: float64_floor_product(factor, n, max_count)))(counts)
    )
    want = np.minimum([int(factor * n) for n in range(max_count + 1)], max_count)
    np.testing.assert_array_equal(got, want)


def test_config_errors():
    problem = make_problem(3, 5, seed=0)
    args = [jnp.asarray(problem[k]) for k in ("old_log_prob", "log_prob", "advantages")]
    args.append(jnp.asarray(problem["response_mask"]))
    cfg = make_configs("vanilla", {"clip_ratio_c": 1.0}, {})[1]
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PL.compute_policy_loss_vanilla(*args, config=cfg)
    with pytest.raises(ValueError, match="dro_beta"):
        PL.compute_policy_loss_dro(*args, config=make_configs("dro", {}, {})[1])
    with pytest.raises(ValueError, match="rollout_correction"):
        PL.compute_policy_loss_bypass_mode(*args, config=make_configs("bypass_mode", {}, {})[1])
    bad = {
        "policy_loss": {
            "rollout_correction": correction(rollout_rs="token_k4", rollout_rs_threshold=1.5)
        }
    }
    with pytest.raises(ValueError, match="rollout_rs option"):
        PL.compute_policy_loss_bypass_mode(*args, config=make_configs("bypass_mode", bad, {})[1])
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        cfg = make_configs("clip_cov", {"policy_loss": {"clip_cov_ratio": 0.0}}, {})[1]
        PL.compute_policy_loss_clip_cov(*args, config=cfg)
    with pytest.raises(ValueError, match="needs the actor config"):
        PL.compute_policy_loss_gpg(*args)
