"""DESIGN contract 3: verl's `core_algos` imports work from `jaxrl.core_algos` unchanged.

Walks verl 0.9.1's module: every public name is exported by `jaxrl.core_algos` (with verl's
argument names and defaults) or listed, with its reason, in `VERL_NAMES_NOT_PROVIDED`. Then
the pieces that only a name walk would not catch: the KL estimators' values and gradients at
their kinks (exact ties, clamp bounds) against torch autograd, the deprecated
`compute_policy_loss`, and verl's group-label helpers that core_algos re-exports.

Values are compared with `assert_close`'s float32 tolerance (its reason:
`jaxrl.testing.verl_compare`); counts and indices exactly.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import pkgutil
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl.core_algos as C
from jaxrl.testing.verl_compare import (
    assert_close,
    to_torch,
    verl_core_algos,
)

# Names verl's module holds that are not verl's: its imports from the standard library and
# omegaconf (checked below to come from there, so a verl function of the same name would fail).
NOT_VERL_NAMES = {"Any", "Callable", "Optional", "Enum", "defaultdict", "DictConfig"}
# Arguments jaxrl adds after verl's, each keyword-only and with a default.
EXTRA_ARGUMENTS = {"compute_policy_loss_clip_cov": ("rng",), "register_adv_est": ("inputs",)}


def verl_public_names(verl) -> set[str]:
    names = {n for n, o in vars(verl).items() if not n.startswith("_") and not inspect.ismodule(o)}
    for name in NOT_VERL_NAMES:
        module = getattr(vars(verl)[name], "__module__", "") or ""
        assert not module.startswith("verl"), (name, module)
    return names - NOT_VERL_NAMES


def jaxrl_definitions() -> dict[str, object]:
    """Every public function and class defined in a submodule of jaxrl.core_algos."""
    found = {}
    for info in pkgutil.iter_modules(C.__path__):
        module = importlib.import_module(f"jaxrl.core_algos.{info.name}")
        for name, obj in vars(module).items():
            defined_here = getattr(obj, "__module__", None) == module.__name__
            if not name.startswith("_") and defined_here and callable(obj):
                found[name] = obj
    return found


def test_every_verl_name_is_exported_or_listed():
    verl = verl_core_algos()
    public = verl_public_names(verl)
    exported = set(C.__all__)
    listed = set(C.VERL_NAMES_NOT_PROVIDED)
    assert not (public - exported - listed), "verl names neither exported nor listed"
    assert listed <= public, f"stale entries: {sorted(listed - public)}"
    assert not (listed & exported)
    for name in exported:
        assert getattr(C, name) is not None
    for name in listed:
        assert C.VERL_NAMES_NOT_PROVIDED[name].strip()
        assert not hasattr(C, name)
        with pytest.raises(AttributeError, match=f"does not provide verl's '{name}'"):
            getattr(C, name)
    # Implemented in a submodule under verl's name, so it must be the exported object.
    for name, obj in jaxrl_definitions().items():
        if name in public:
            assert name not in listed, f"{name} is implemented but listed as not provided"
            assert getattr(C, name, None) is obj, f"{name} is implemented but not exported"


def test_exported_functions_take_verls_arguments():
    verl = verl_core_algos()
    for name in sorted(verl_public_names(verl) & set(C.__all__)):
        ref, ours = getattr(verl, name), getattr(C, name)
        if isinstance(ref, enum.EnumMeta):
            assert {m.name: m.value for m in ref} == {m.name: m.value for m in ours}, name
            continue
        if isinstance(ref, dict):  # the registries: same keys (filled on import)
            assert set(ref) == set(ours), name
            continue
        if not callable(ref) or name == "PolicyLossFn":  # a typing alias: arity only
            assert len(ref.__args__) == len(ours.__args__), name  # 7 arguments + result
            continue
        target = (lambda f: f.__init__) if inspect.isclass(ref) else (lambda f: f)
        ref_params = list(inspect.signature(target(ref)).parameters.values())
        our_params = list(inspect.signature(target(ours)).parameters.values())
        extra = EXTRA_ARGUMENTS.get(name, ())
        assert [p.name for p in our_params] == [p.name for p in ref_params] + list(extra), name
        for ref_p, our_p in zip(ref_params, our_params, strict=False):
            assert our_p.default == ref_p.default, (name, ref_p.name)
        for our_p in our_params[len(ref_params) :]:
            assert our_p.default is not inspect.Parameter.empty, (name, our_p.name)
            assert our_p.kind is inspect.Parameter.KEYWORD_ONLY, (name, our_p.name)


# ------------------------------------------------------------------------------------------------
# KL estimators at their kinks
# ------------------------------------------------------------------------------------------------


def kink_problem() -> tuple[np.ndarray, np.ndarray]:
    """[3, 8] float32 (logprob, ref_logprob): exact ties, k3's +-20 clamp bounds and beyond
    them, and k3's result exactly on its 10 bound and on both sides of it.

    With kl = ref - logprob, k3 = exp(kl) - kl - 1 is exactly 10.0 (in torch and XLA alike) at
    kl = -10.999983, where torch's clamp passes the whole gradient and `jnp.clip` half of it;
    at the +-20 bounds k3 is beyond 10, so the outer clamp zeroes the gradient either way.
    """
    logprob = np.array(
        [
            [0.0, -1e-3, -5.3, -30.0, -25.0, -5.0, -26.0, -4.0],
            [-0.7, -2.0, -12.0, -3.0, -3.0, -1.0, -0.25, -8.0],
            [-1.0000172, -1.0000172, -0.5, -2.0, -1.0, -3.0, -0.1, -6.0],
        ],
        np.float32,
    )
    ref = logprob.copy()  # ties wherever not overwritten: row 0 columns 0-3, rows 1-2 column 0
    ref[0, 4], ref[0, 5] = -5.0, -25.0  # kl = +20 and -20 exactly
    ref[0, 6], ref[0, 7] = -4.0, -26.0  # +-22: beyond the clamp
    for col, kl in ((3, 2.6108685), (4, 2.6108687)):
        ref[1, col] = logprob[1, col] + np.float32(kl)  # k3 just under / over 10
    ref[1, 1], ref[1, 2] = -2.5, -11.0
    ref[1, 5:] = ref[1, 5:] + np.array([0.3, -0.1, 1e-4], np.float32)
    ref[2, 1] = -12.0  # kl = -10.999983: k3 exactly 10
    ref[2, 2:] = ref[2, 2:] + np.array([-11.2, -10.9, 0.7, -0.3, 5.0, -2.0], np.float32)
    return logprob, ref


def verl_kl_grads(verl, logprob, ref, name):
    t_lp, t_ref = to_torch(logprob, requires_grad=True), to_torch(ref, requires_grad=True)
    value = verl.kl_penalty(t_lp, t_ref, name)
    value.sum().backward()
    return value.detach().numpy(), t_lp.grad.numpy(), t_ref.grad.numpy()


PENALTIES = [*C.KL_PENALTIES, *(k + "+" for k in C.KL_PENALTIES)]


@pytest.mark.parametrize("name", PENALTIES)
def test_kl_penalty_at_ties_and_clamp_bounds(name):
    """Values and gradients (w.r.t. both log-probs) equal torch's, eager and under jit."""
    verl = verl_core_algos()
    logprob, ref = kink_problem()
    ref_value, ref_dlp, ref_dref = verl_kl_grads(verl, logprob, ref, name)
    if name in ("k3", "low_var_kl"):
        assert ref_value[2, 1] == 10.0 and ref_dlp[2, 1] != 0.0  # on the bound, gradient passes

    def total(lp, rf):
        return C.kl_penalty(lp, rf, name).sum()

    for fn in (total, jax.jit(total)):
        dlp, dref = jax.grad(fn, argnums=(0, 1))(jnp.asarray(logprob), jnp.asarray(ref))
        assert_close(dlp, ref_dlp, what=f"d/dlogprob {name}")
        assert_close(dref, ref_dref, what=f"d/dref {name}")
    assert_close(C.kl_penalty(logprob, ref, name), ref_value, what=f"value {name}")
    assert_close(jax.jit(C.kl_penalty, static_argnums=2)(logprob, ref, name), ref_value, what=name)


def test_abs_penalty_has_zero_gradient_at_a_tie():
    """The issue's case: an actor equal to its reference gets no `abs` KL gradient (torch's
    subgradient at 0), so a `kl_loss_type: abs` run's first update equals verl's."""
    logprob = jnp.array([[-1.0, -2.0, -0.5]])
    grad = jax.grad(lambda lp: C.kl_penalty(lp, logprob, "abs").sum())(logprob)
    np.testing.assert_array_equal(np.asarray(grad), 0.0)
    grad = jax.grad(lambda lp: C.kl_penalty(lp, logprob - 1.0, "abs").sum())(logprob)
    np.testing.assert_array_equal(np.asarray(grad), 1.0)


# ------------------------------------------------------------------------------------------------
# compute_policy_loss (deprecated in verl, still importable there)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", C.LOSS_AGG_MODES)
def test_deprecated_compute_policy_loss_matches_verl(mode):
    verl = verl_core_algos()
    rng = np.random.RandomState(3)
    old = (-2.0 * np.abs(rng.randn(5, 7)) - 0.05).astype(np.float32)
    log_prob = (old + 0.3 * rng.randn(5, 7)).astype(np.float32)
    log_prob[2] = old[2]  # on-policy row
    advantages = rng.randn(5, 7).astype(np.float32)
    mask = (np.arange(7)[None] < rng.randint(1, 8, 5)[:, None]).astype(np.float32)
    kwargs = dict(cliprange=0.2, cliprange_low=0.1, cliprange_high=0.28, clip_ratio_c=2.5)

    t_lp = to_torch(log_prob, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ref = verl.compute_policy_loss(
            to_torch(old), t_lp, to_torch(advantages), to_torch(mask), **kwargs, loss_agg_mode=mode
        )
    ref[0].backward()

    def loss(lp):
        out = C.compute_policy_loss(old, lp, advantages, mask, **kwargs, loss_agg_mode=mode)
        return out[0], out[1:]

    with pytest.warns(FutureWarning, match="compute_policy_loss_vanilla"):
        (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(log_prob))
    assert_close(value, ref[0])
    assert_close(grad, t_lp.grad)
    for ours, theirs in zip(metrics, ref[1:], strict=True):
        assert_close(ours, theirs)
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="cliprange"):
        C.compute_policy_loss(old, log_prob, advantages, mask)


# ------------------------------------------------------------------------------------------------
# verl.utils.groupwise, re-exported by verl's core_algos
# ------------------------------------------------------------------------------------------------

LABELS = {
    "int-array": np.array([7, 3, 7, -2, 1000003]),
    "int-list": [4, 4, 0, 9],
    "bool": np.array([True, False, True]),
    "near-int-floats": np.array([1.0, 2.0000001, 1.0, 5.0]),
    "numeric-strings": np.array(["12", "3", "12"]),
    "uids": np.array(["uid-b", "uid-a", "uid-b", "uid-c"], dtype=object),
    "uid-list": ["x", "y", "x"],
    "mixed": np.array(["a", 3, "a", 2.5], dtype=object),
}


@pytest.mark.parametrize("case", list(LABELS))
def test_as_torch_index_matches_verl(case):
    verl = verl_core_algos()
    labels = LABELS[case]
    ref = verl.as_torch_index(labels, device="cpu").numpy()
    ours = C.as_torch_index(labels)
    assert isinstance(ours, jax.Array) and ours.dtype == jax.dtypes.canonicalize_dtype(np.int64)
    np.testing.assert_array_equal(np.asarray(ours), ref)
    np.testing.assert_array_equal(np.asarray(C.as_torch_index(jnp.asarray(ref))), ref)
    on_cpu = C.as_torch_index(labels, device="cpu")  # verl's device text
    assert on_cpu.devices() == {jax.devices("cpu")[0]}


def test_as_torch_index_refuses_what_verl_gets_wrong():
    # verl truncates non-integer floats of a numpy array or list: 1.2 and 1.7 become one group.
    for labels in (np.array([1.2, 1.7, 3.0]), np.array([1.2, 1.7], dtype=object), [1.5, 2]):
        with pytest.raises(ValueError, match="not integers"):
            C.as_torch_index(labels)
    with pytest.raises(ValueError, match="under jit"):
        jax.jit(C.as_torch_index)(jnp.arange(3))
    if not jax.config.jax_enable_x64:
        with pytest.raises(ValueError, match="do not fit"):
            C.as_torch_index(np.array([1, 2**40]))


def test_group_mean_std_matches_verl():
    verl = verl_core_algos()
    rng = np.random.RandomState(4)
    scores = rng.randn(11).astype(np.float32)
    scores[[6, 7]] = 2.0  # a group of equal scores: std floored by eps
    gidx = np.array([0, 0, 1, 0, 1, 1, 3, 3, 4, 0, 5])  # 2 has no member, 4 and 5 are singles
    for eps in (1e-6, 0.5):
        ref = verl.group_mean_std(to_torch(scores), to_torch(gidx), eps=eps, device="cpu")
        ours = C.group_mean_std(scores, gidx, eps=eps)
        for name, x, y in zip(("mean", "std", "count"), ours, ref, strict=True):
            assert x.shape == tuple(y.shape), name
            if name == "count":  # exact: an integer-valued count
                np.testing.assert_array_equal(x, y.numpy(), err_msg=f"count eps={eps}")
            else:
                assert_close(x, y, what=f"{name} eps={eps}")
    with pytest.raises(ValueError, match="length mismatch"):
        C.group_mean_std(scores, gidx[:-1])
    with pytest.raises(ValueError, match="negative"):
        C.group_mean_std(scores, np.where(gidx == 3, -1, gidx))
    with pytest.raises(ValueError, match="concrete gidx"):
        jax.jit(C.group_mean_std)(scores, gidx)


def test_algorithm_config_types_are_duck_typed():
    """verl's KL controller config (a typed dataclass) works as it is, like a namespace."""
    verl = verl_core_algos()
    from verl.trainer.config.algorithm import KLControlConfig

    typed = KLControlConfig(type="adaptive", kl_coef=0.02, horizon=50, target_kl=0.03)
    for config in (typed, types.SimpleNamespace(**dict(typed))):
        ours, ref = C.get_kl_controller(config), verl.get_kl_controller(typed)
        for kl, steps in [(0.2, 16), (0.001, 16)]:
            ours.update(kl, steps)
            ref.update(kl, steps)
            # Python floats (float64), verl's formula: equal but for the order of a few ops
            assert ours.value == pytest.approx(ref.value, rel=1e-12)
