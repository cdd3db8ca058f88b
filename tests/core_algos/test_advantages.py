"""The 14 advantage estimators vs verl 0.9.1, under jit and vmap, and the registry.

verl gets uid strings as `index`; jaxrl gets integer ids from a non-contiguous table of large
values (7, 1000003, ...), so every comparison also proves that arbitrary ids work.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl.core_algos.advantages as A
from jaxrl.core_algos import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageEstimator,
    EstimatorInputs,
    estimator_inputs,
    get_adv_estimator_fn,
    registry,
)
from jaxrl.testing.verl_compare import assert_close, to_torch, verl_core_algos

ID_TABLE = np.array(
    [7, 1000003, -3, 42, 0, 65537, 999, 12, 5, 2**30, 31, 8, 100, 77, 3, 1, 2**31 - 1], np.int32
)
GDPO_KEYS = ("format_reward", "accuracy_reward")


@dataclasses.dataclass
class Problem:
    rewards: np.ndarray  # [B, R]
    mask: np.ndarray  # [B, R] 0/1 float32
    values: np.ndarray  # [B, R]
    group: np.ndarray  # [B] dense group numbers
    reward_baselines: np.ndarray  # [B]
    old_log_probs: np.ndarray  # [B, R]
    sum_pi_squared: np.ndarray  # [B, R]
    is_weights: np.ndarray  # [B, R]
    components: dict[str, np.ndarray]  # GDPO reward components, each [B]

    @property
    def uid(self) -> np.ndarray:
        return np.array([f"uid-{g}" for g in self.group], dtype=object)

    @property
    def ids(self) -> np.ndarray:
        return ID_TABLE[self.group]


def make_problem(
    b, r, seed, holes=False, ties=False, zero_row=False, pairs=False, group=None, lengths=None
) -> Problem:
    """Random problem; with b >= 4 the last response is a singleton group (unless `pairs`:
    every group of two or more). `group` and `lengths` [B] impose a layout."""
    rng = np.random.RandomState(seed)
    if group is not None:
        group = np.asarray(group)
    elif pairs:
        group = np.arange(b) // 2
        if b % 2 and b > 1:
            group[-1] = group[-2]
    else:
        n_groups = max(1, b // 3)
        group = rng.randint(0, n_groups, b)
        if b >= 4:
            group[-1] = n_groups
    rewards = rng.randn(b, r).astype(np.float32)
    if ties:  # equal scores inside every group, and an all-zero group (GPG's count_nonzero)
        for g in np.unique(group):
            rows = np.flatnonzero(group == g)
            rewards[rows] = 0.0 if g == group[0] else rewards[rows[0]]
    lengths = rng.randint(1, r + 1, b) if lengths is None else np.asarray(lengths)
    mask = (np.arange(r)[None] < lengths[:, None]).astype(np.float32)
    if holes and r >= 4:
        mask[::2, 1:3] = 0.0  # observation tokens between two model turns
    if zero_row and b >= 3:
        mask[1] = 0.0
    values = rng.randn(b, r).astype(np.float32)
    reward_baselines = rng.randn(b).astype(np.float32)
    pi = rng.uniform(0.05, 1.0, (b, r))
    # sum_v pi_v^2 of a distribution holding pi: between pi^2 and pi^2 + (1 - pi)^2, so the
    # optimal token baselines' path weights 1 - 2 pi + sum pi^2 are >= 0 as in a real rollout
    # (independent draws made them of either sign, their group sums near 0 and the baselines
    # ill-conditioned: a rounding difference amplified 40x, to 0.24 of the tolerance).
    sum_pi_squared = pi**2 + rng.uniform(0.05, 1.0, (b, r)) * (1 - pi) ** 2
    return Problem(
        rewards=rewards,
        mask=mask,
        values=values,
        group=group,
        reward_baselines=reward_baselines,
        old_log_probs=np.log(pi).astype(np.float32),
        sum_pi_squared=sum_pi_squared.astype(np.float32),
        is_weights=rng.uniform(0.5, 1.5, (b, r)).astype(np.float32),
        components={
            "format_reward": rng.randint(0, 2, b).astype(np.float32),
            "accuracy_reward": rng.randn(b).astype(np.float32),
        },
    )


# ------------------------------------------------------------------------------------------------
# One entry per estimator configuration: how to call verl and jaxrl on a Problem.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Spec:
    id: str
    name: str  # registry name
    verl_fn: str
    arrays: Callable[[Problem], dict[str, np.ndarray]]  # same names and values on both sides
    grouped: bool = True  # takes `index`
    static: dict[str, Any] = dataclasses.field(default_factory=dict)  # both sides
    verl_static: dict[str, Any] = dataclasses.field(default_factory=dict)
    ours_static: dict[str, Any] = dataclasses.field(default_factory=dict)
    pairs: bool = False  # problems without singleton groups (verl requires it)
    refusal: str | None = None  # ValueError message of verl where jaxrl stays finite instead

    def ours(self):
        return functools.partial(get_adv_estimator_fn(self.name), **self.static, **self.ours_static)

    def jax_arrays(self, p: Problem, ids: np.ndarray | None = None) -> dict[str, Any]:
        kwargs = {k: jnp.asarray(v) for k, v in self.arrays(p).items()}
        if self.grouped:
            kwargs["index"] = jnp.asarray(p.ids if ids is None else ids)
        return kwargs


def rm(p):
    return {"token_level_rewards": p.rewards, "response_mask": p.mask}


def otb(p, is_weights):
    arrays = {**rm(p), "old_log_probs": p.old_log_probs, "sum_pi_squared": p.sum_pi_squared}
    if is_weights:
        arrays["rollout_is_weights"] = p.is_weights
    return arrays


def omega(**values):
    from omegaconf import OmegaConf

    return OmegaConf.create(values)


GDPO_CONFIG = dict(gdpo_reward_keys=list(GDPO_KEYS), gdpo_reward_weights=[0.7, 2.0])
SPECS = [
    Spec(
        "gae",
        "gae",
        "compute_gae_advantage_return",
        lambda p: {**rm(p), "values": p.values},
        grouped=False,
        static=dict(gamma=1.0, lam=1.0),
        refusal="mask",
    ),
    Spec(
        "gae-discounted",
        "gae",
        "compute_gae_advantage_return",
        lambda p: {**rm(p), "values": p.values},
        grouped=False,
        static=dict(gamma=0.9, lam=0.95),
        refusal="mask",
    ),
    Spec("grpo", "grpo", "compute_grpo_outcome_advantage", rm),
    Spec(
        "grpo-no-std",
        "grpo",
        "compute_grpo_outcome_advantage",
        rm,
        static=dict(norm_adv_by_std_in_grpo=False),
    ),
    Spec("grpo_vectorized", "grpo_vectorized", "compute_grpo_vectorized_outcome_advantage", rm),
    Spec(
        "grpo_vectorized-no-std",
        "grpo_vectorized",
        "compute_grpo_vectorized_outcome_advantage",
        rm,
        static=dict(norm_adv_by_std_in_grpo=False, epsilon=1e-3),
    ),
    Spec(
        "grpo_passk",
        "grpo_passk",
        "compute_grpo_passk_outcome_advantage",
        rm,
        verl_static=dict(config=omega(norm_adv_by_std_in_grpo=True)),
        ours_static=dict(config=types.SimpleNamespace(norm_adv_by_std_in_grpo=True)),
        pairs=True,
        refusal="at least 2 samples",
    ),
    Spec(
        "grpo_passk-no-std",
        "grpo_passk",
        "compute_grpo_passk_outcome_advantage",
        rm,
        verl_static=dict(config=omega(norm_adv_by_std_in_grpo=False)),
        ours_static=dict(config={"norm_adv_by_std_in_grpo": False}),
        pairs=True,
        refusal="at least 2 samples",
    ),
    Spec("gdpo-fallback", "gdpo", "compute_gdpo_outcome_advantage", rm, refusal="mask"),
    Spec(
        "gdpo-components",
        "gdpo",
        "compute_gdpo_outcome_advantage",
        rm,
        verl_static=dict(config=omega(**GDPO_CONFIG)),
        ours_static=dict(config=types.SimpleNamespace(**GDPO_CONFIG)),
        refusal="mask",
    ),
    Spec("rloo", "rloo", "compute_rloo_outcome_advantage", rm),
    Spec("rloo_vectorized", "rloo_vectorized", "compute_rloo_vectorized_outcome_advantage", rm),
    Spec(
        "reinforce_plus_plus",
        "reinforce_plus_plus",
        "compute_reinforce_plus_plus_outcome_advantage",
        rm,
        grouped=False,
        verl_static=dict(config=omega(gamma=0.9)),
        ours_static=dict(config={"gamma": 0.9}),
        refusal="mask",
    ),
    Spec(
        "reinforce_plus_plus_baseline",
        "reinforce_plus_plus_baseline",
        "compute_reinforce_plus_plus_baseline_outcome_advantage",
        rm,
        refusal="mask",
    ),
    Spec(
        "remax",
        "remax",
        "compute_remax_outcome_advantage",
        lambda p: {**rm(p), "reward_baselines": p.reward_baselines},
        grouped=False,
    ),
    Spec("opo", "opo", "compute_opo_outcome_advantage", rm),
    Spec("gpg", "gpg", "compute_gpg_outcome_advantage", rm),
    Spec(
        "gpg-f_norm", "gpg", "compute_gpg_outcome_advantage", rm, static=dict(f_norm=3.0, alpha=5.0)
    ),
    Spec(
        "optimal_token_baseline",
        "optimal_token_baseline",
        "compute_optimal_token_baseline_advantage",
        functools.partial(otb, is_weights=False),
    ),
    Spec(
        "optimal_token_baseline-is-no-tail",
        "optimal_token_baseline",
        "compute_optimal_token_baseline_advantage",
        functools.partial(otb, is_weights=True),
        static=dict(handle_zero_tail=False),
    ),
    Spec(
        "tir_optimal_token_baseline",
        "tir_optimal_token_baseline",
        "compute_multi_turn_optimal_token_baseline_advantage",
        functools.partial(otb, is_weights=True),
    ),
    Spec(
        "tir_optimal_token_baseline-no-tail",
        "tir_optimal_token_baseline",
        "compute_multi_turn_optimal_token_baseline_advantage",
        functools.partial(otb, is_weights=False),
        static=dict(handle_zero_tail=False, epsilon=1e-3),
    ),
]
SPEC_IDS = [s.id for s in SPECS]
# One configuration per estimator, for the (compile-heavy) jit and vmap checks.
ESTIMATOR_SPECS = [s for k, s in enumerate(SPECS) if all(t.name != s.name for t in SPECS[:k])]

# (B, R, seed, options): single response, length-1 responses, holes, empty rows, ties.
CASES = {
    "1x5": (1, 5, 1, {}),
    "6x1": (6, 1, 2, {}),
    "6x5-holes": (6, 5, 3, dict(holes=True)),
    "16x12-holes-empty-row": (16, 12, 4, dict(holes=True, zero_row=True)),
    "16x12-ties": (16, 12, 5, dict(ties=True)),
    # An empty response beside a lone partner, a unique longest response, a singleton group.
    "6x5-layout": (6, 5, 6, dict(holes=True, group=[0, 0, 1, 1, 1, 2], lengths=[4, 0, 5, 3, 3, 2])),
}


def problem_for(spec: Spec, case: str) -> Problem:
    b, r, seed, options = CASES[case]
    return make_problem(b, r, seed, pairs=spec.pairs, **options)


def with_gdpo_inputs(spec: Spec, p: Problem, verl_side: bool) -> dict[str, Any]:
    """verl's GDPO reads the components from `non_tensor_batch` only when `batch` is given."""
    if spec.id != "gdpo-components":
        return {}
    b = p.mask.shape[0]
    attention = np.concatenate([np.ones((b, 3)), p.mask], axis=1).astype(np.int64)
    if verl_side:
        batch = {
            "prompts": to_torch(np.zeros((b, 3), np.int64)),
            "attention_mask": to_torch(attention),
        }
        return {"non_tensor_batch": {**p.components, "uid": p.uid}, "batch": batch}
    nt = {k: jnp.asarray(v) for k, v in p.components.items()}
    return {"non_tensor_batch": nt, "batch": {"attention_mask": jnp.asarray(attention)}}


def run_verl(spec: Spec, verl, p: Problem):
    kwargs = {k: to_torch(v) for k, v in spec.arrays(p).items()}
    if spec.grouped:
        kwargs["index"] = p.uid
    kwargs.update(with_gdpo_inputs(spec, p, verl_side=True))
    return getattr(verl, spec.verl_fn)(**kwargs, **spec.static, **spec.verl_static)


def jax_inputs(spec: Spec, p: Problem, ids: np.ndarray | None = None) -> dict[str, Any]:
    return {**spec.jax_arrays(p, ids), **with_gdpo_inputs(spec, p, verl_side=False)}


def assert_pair_close(ours, ref, what=""):
    """(advantages, returns) within `assert_close`'s float32 tolerance (its reason:
    `jaxrl.testing.verl_compare`); jit against eager and vmap against single calls are the
    same ops fused otherwise, a rounding difference as well."""
    assert len(ours) == len(ref) == 2
    for name, x, y in zip(("advantages", "returns"), ours, ref, strict=True):
        assert x.shape == tuple(y.shape), (name, x.shape, tuple(y.shape))
        assert_close(x, y, what=f"{what} {name}")


# ------------------------------------------------------------------------------------------------
# Equivalence with verl
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_matches_verl(spec: Spec, case: str):
    verl = verl_core_algos()
    p = problem_for(spec, case)
    # Eager: primitives compile once per shape for all estimators, unlike one jit per spec.
    ours = spec.ours()(**jax_inputs(spec, p))
    try:
        ref = run_verl(spec, verl, p)
    except ValueError as err:
        # verl refuses inputs a jitted function cannot refuse (see the module docstring).
        assert spec.refusal is not None and re.search(spec.refusal, str(err)), err
        assert all(np.isfinite(np.asarray(x)).all() for x in ours)
        return
    assert_pair_close(ours, ref, what=f"{spec.id}[{case}]")


@pytest.mark.parametrize("spec", ESTIMATOR_SPECS, ids=[s.name for s in ESTIMATOR_SPECS])
def test_jit_equals_eager_and_ids_are_arbitrary(spec: Spec):
    p = problem_for(spec, "6x5-holes")
    fn = jax.jit(spec.ours())
    eager = spec.ours()(**jax_inputs(spec, p))
    assert_pair_close(fn(**jax_inputs(spec, p)), eager, what="jit")
    # The same groups named 0..G-1 instead of by the table's large, scattered ids.
    assert_pair_close(fn(**jax_inputs(spec, p, ids=p.group)), eager, what="contiguous ids")


@pytest.mark.parametrize("spec", ESTIMATOR_SPECS, ids=[s.name for s in ESTIMATOR_SPECS])
def test_vmap_equals_separate_calls(spec: Spec):
    problems = [make_problem(6, 5, seed, holes=True, pairs=spec.pairs) for seed in (11, 12)]
    inputs = [jax_inputs(spec, p) for p in problems]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *inputs)
    batched = jax.vmap(spec.ours())(**stacked)
    for k, single in enumerate(inputs):
        assert_pair_close([x[k] for x in batched], spec.ours()(**single), what=f"vmap[{k}]")


def test_registry_has_all_estimators():
    import jaxrl.core_algos as C

    expected = {
        "gae": A.compute_gae_advantage_return,
        "grpo": A.compute_grpo_outcome_advantage,
        "grpo_vectorized": A.compute_grpo_vectorized_outcome_advantage,
        "grpo_passk": A.compute_grpo_passk_outcome_advantage,
        "gdpo": A.compute_gdpo_outcome_advantage,
        "rloo": A.compute_rloo_outcome_advantage,
        "rloo_vectorized": A.compute_rloo_vectorized_outcome_advantage,
        "reinforce_plus_plus": A.compute_reinforce_plus_plus_outcome_advantage,
        "reinforce_plus_plus_baseline": A.compute_reinforce_plus_plus_baseline_outcome_advantage,
        "remax": A.compute_remax_outcome_advantage,
        "opo": A.compute_opo_outcome_advantage,
        "gpg": A.compute_gpg_outcome_advantage,
        "optimal_token_baseline": A.compute_optimal_token_baseline_advantage,
        "tir_optimal_token_baseline": A.compute_multi_turn_optimal_token_baseline_advantage,
    }
    assert set(expected) == {e.value for e in AdvantageEstimator}
    assert {s.name for s in ESTIMATOR_SPECS} == set(expected)  # every one compared to verl
    assert set(expected) <= set(ADV_ESTIMATOR_REGISTRY)
    for name, fn in expected.items():
        assert get_adv_estimator_fn(name) is fn
        assert C.get_adv_estimator_fn(AdvantageEstimator(name)) is fn
        assert fn.__doc__


def test_signatures_match_verl():
    verl = verl_core_algos()
    for spec in SPECS:
        ours = inspect.signature(get_adv_estimator_fn(spec.name)).parameters
        ref = inspect.signature(getattr(verl, spec.verl_fn)).parameters
        assert list(ours) == list(ref), spec.name
        for name, param in ref.items():
            assert ours[name].default == param.default, (spec.name, name)


def algo_config(kind: str, values: dict[str, Any]) -> Any:
    """The same algorithm settings as verl's `AlgoConfig`, its DictConfig, a namespace or dict."""
    from verl.trainer.config import AlgoConfig

    makers = {
        "algoconfig": lambda: AlgoConfig(**values),
        "dictconfig": lambda: omega(**values),
        "namespace": lambda: types.SimpleNamespace(**values),
        "dict": lambda: dict(values),
    }
    return makers[kind]()


CONFIG_SPECS = [s for s in SPECS if s.id != "gdpo-fallback" and s.name not in ("gae",)]
CONFIG_SPECS = [s for s in CONFIG_SPECS if "optimal_token_baseline" not in s.name]


@pytest.mark.parametrize("kind", ["algoconfig", "dictconfig", "namespace", "dict"])
@pytest.mark.parametrize("spec", CONFIG_SPECS, ids=[s.id for s in CONFIG_SPECS])
def test_verl_config_objects(spec: Spec, kind: str):
    """DESIGN contract 3: every estimator with verl's `config` argument takes verl's own
    `AlgoConfig` (what verl's trainer passes), its DictConfig, a namespace or a dict, and gives
    verl's result with verl's `AlgoConfig`."""
    verl = verl_core_algos()
    assert "config" in inspect.signature(getattr(verl, spec.verl_fn)).parameters
    values = dict(gamma=0.9, norm_adv_by_std_in_grpo="no-std" not in spec.id)
    if spec.id == "gdpo-components":
        values.update(GDPO_CONFIG)
    spec = dataclasses.replace(
        spec,
        verl_static={"config": algo_config("algoconfig", values)},
        ours_static={"config": algo_config(kind, values)},
    )
    p = problem_for(spec, "16x12-ties" if spec.pairs else "6x5-holes")
    ours = spec.ours()(**jax_inputs(spec, p))
    assert_pair_close(ours, run_verl(spec, verl, p), what=f"{spec.id} {kind}")


# ------------------------------------------------------------------------------------------------
# Edge cases, spelled out
# ------------------------------------------------------------------------------------------------


def test_grpo_singleton_and_equal_scores():
    rewards = np.array([[1.0, 2.0], [3.0, 0.0], [3.0, 0.0], [5.0, -1.0]], np.float32)
    mask = np.array([[1, 1], [1, 0], [1, 1], [1, 1]], np.float32)
    index = jnp.asarray([1000003, 7, 7, -2])  # a singleton, a tied pair, a singleton
    adv, ret = A.compute_grpo_outcome_advantage(jnp.asarray(rewards), jnp.asarray(mask), index)
    eps = 1e-6
    expected = np.array([3 / (1 + eps), 0.0, 0.0, 4 / (1 + eps)], np.float32)[:, None] * mask
    assert_close(adv, expected)
    assert_close(ret, expected)


def test_passk_credits_only_the_best_response():
    scores = np.array([1.0, 4.0, 2.0, 9.0, 9.0, 0.5], np.float32)
    index = jnp.asarray([5, 5, 5, 8, 8, 1])  # the last group is a singleton: advantage 0
    mask = np.ones((6, 3), np.float32)
    rewards = np.zeros((6, 3), np.float32)
    rewards[:, -1] = scores
    cfg = {"norm_adv_by_std_in_grpo": False}
    adv, _ = A.compute_grpo_passk_outcome_advantage(
        jnp.asarray(rewards), jnp.asarray(mask), index, config=cfg
    )
    assert_close(adv[:, 0], [0.0, 2.0, 0.0, 0.0, 0.0, 0.0])


def test_whitening_over_one_token_is_finite_where_verl_raises():
    verl = verl_core_algos()
    rewards, mask = np.array([[2.0, 1.0]], np.float32), np.array([[1.0, 0.0]], np.float32)
    with pytest.raises(ValueError, match="mask"):
        verl.compute_reinforce_plus_plus_outcome_advantage(
            to_torch(rewards), to_torch(mask), config=omega(gamma=1.0)
        )
    adv, ret = A.compute_reinforce_plus_plus_outcome_advantage(
        jnp.asarray(rewards), jnp.asarray(mask), config=types.SimpleNamespace(gamma=1.0)
    )
    assert np.isfinite(np.asarray(adv)).all()
    assert_close(ret, [[2.0, 0.0]])  # a reward on a masked token is dropped


def test_missing_config_and_gdpo_keys_raise():
    x = jnp.ones((2, 3))
    index = jnp.asarray([0, 0])
    with pytest.raises(ValueError, match="config"):
        A.compute_grpo_passk_outcome_advantage(x, x, index)
    with pytest.raises(ValueError, match="config"):
        A.compute_reinforce_plus_plus_outcome_advantage(x, x)
    nt = {"a": jnp.ones(2)}
    with pytest.raises(ValueError, match="gdpo_reward_keys"):
        A.compute_gdpo_outcome_advantage(x, x, index, config={}, non_tensor_batch=nt, batch={})
    with pytest.raises(ValueError, match="not in non_tensor_batch"):
        A.compute_gdpo_outcome_advantage(
            x, x, index, config={"gdpo_reward_keys": ["b"]}, non_tensor_batch=nt, batch={}
        )


def test_no_gradient_flows_through_advantages():
    p = make_problem(4, 3, 0)
    inputs = jax_inputs(SPECS[0], p)

    def total(values):
        adv, ret = A.compute_gae_advantage_return(**{**inputs, "values": values}, gamma=1, lam=1)
        return jnp.sum(adv) + jnp.sum(ret)

    # exact: stop_gradient makes the gradient zeros, not small values
    np.testing.assert_array_equal(jax.grad(total)(inputs["values"]), np.zeros_like(p.values))


# The parameter through which an estimator reads each declared input.
INPUT_PARAMETERS = {
    "values": "values",
    "reward_baselines": "reward_baselines",
    "sum_pi_squared": "sum_pi_squared",
    "reward_components": "non_tensor_batch",
}


@pytest.mark.parametrize("name", [e.value for e in AdvantageEstimator])
def test_declared_inputs_are_the_estimators_parameters(name):
    """The inputs an estimator registered (which passes the step plan runs for it) are the
    ones its signature reads, no more and no fewer."""
    parameters = inspect.signature(get_adv_estimator_fn(name)).parameters
    declared = dataclasses.asdict(estimator_inputs(name))
    assert declared == {k: p in parameters for k, p in INPUT_PARAMETERS.items()}


def test_an_estimator_registered_without_inputs_reads_none():
    fn = registry.register_adv_est("test_mine")(lambda token_level_rewards, response_mask: 0)
    try:
        assert get_adv_estimator_fn("test_mine") is fn
        assert estimator_inputs("test_mine") == EstimatorInputs()
    finally:
        del registry.ADV_ESTIMATOR_REGISTRY["test_mine"], registry.ESTIMATOR_INPUTS["test_mine"]
    with pytest.raises(ValueError, match="unknown advantage estimator 'test_mine'"):
        estimator_inputs("test_mine")
