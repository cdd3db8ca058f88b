"""The suite's float comparisons, with the reason for each tolerance (DESIGN §6).

Two float32 computations of the same value in another order (another reduction order, another
XLA code path or CPU, another library) differ by rounding: about 1e-7 of the magnitudes summed
per operation, so ~1e-6 of the output's scale after a few composite operations. A comparison
is therefore made relative to the reference's scale; an absolute tolerance only where the test
fixes the magnitude by construction and says so (docs/testing.md).

After an optimizer step what is compared must be stable. Adam's update of an element is
lr * m / (sqrt(v) + eps): where the gradient g is near 0 its derivative in g is up to lr / eps,
so at torch's eps = 1e-8 a rounding difference of 1e-9 in g moves the parameter by up to ~lr
(the suite once failed on another CPU by 1.07e-5 against atol 1e-5 that way). Tests that
compare parameters after Adam steps use `STABLE_ADAM_EPS` on both sides: the step is still
AdamW (moments, bias correction, decoupled weight decay, clipping), but a gradient error
|dg| moves an element by at most lr * |dg| / eps (first step; bounded alike later). Clipped
gradients are below 1 per element, so their float32 rounding (<= 1e-6) moves an update by
<= 1e-4 lr; `assert_updates_close` allows 1e-3 lr (10x margin), which is also far above the
rounding of the parameters themselves (|theta| < 1: 6e-8, i.e. 6e-5 of lr = 1e-3).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

# Adam's epsilon in tests that compare parameters after optimizer steps (see above), and the
# RL config's overrides that set it for the actor and the critic (runs compared over steps).
STABLE_ADAM_EPS = 1e-2
STABLE_ADAM_OVERRIDES = (
    f"actor_rollout_ref.actor.optim.eps={STABLE_ADAM_EPS}",
    f"critic.optim.eps={STABLE_ADAM_EPS}",
)
# float32, composite operations (a forward pass, a loss and its gradient): 1e-4 of the scale
# leaves a 100x margin over the ~1e-6 rounding of a few composite operations.
COMPOSITE_RTOL = 1e-4
# The updates of one optimizer step, as a fraction of the learning rate (see above).
UPDATE_RTOL = 1e-3
# Log-probs over the tiny models' 97-token vocabulary (|log p| up to ~10) of the same tokens
# from another program (prefill against decode, chunks, slots, cache blocks, a mesh): float32
# rounding, measured <= 1.2e-6 absolute over the rollout and trainer tests (both XLA CPU
# configurations pass); 2e-5 leaves 17x.
LOG_PROB_ATOL = 2e-5


def _host(x: Any) -> np.ndarray:
    return np.asarray(x, np.float64)  # a jax or numpy array, or a torch tensor without grad


def assert_close_to_scale(ours, ref, valid=None, rtol: float = COMPOSITE_RTOL, what="") -> None:
    """max |ours - ref| <= rtol * max |ref| over the `valid` positions (all by default)."""
    ours, ref = _host(ours), _host(ref)
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    if valid is not None:
        ours, ref = ours[valid], ref[valid]
    scale = np.abs(ref).max(initial=0.0)
    err = np.abs(ours - ref).max(initial=0.0)
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol} x scale {scale:.3g}"


def assert_trees_close_to_scale(ours, ref, rtol: float = COMPOSITE_RTOL) -> None:
    """`assert_close_to_scale` leaf by leaf (each leaf against its own scale); same paths."""
    flat_ours = dict(jax.tree_util.tree_leaves_with_path(ours))
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref))
    assert flat_ours.keys() == flat_ref.keys(), sorted(map(str, flat_ours.keys() ^ flat_ref.keys()))
    for path, x in flat_ours.items():
        assert_close_to_scale(x, flat_ref[path], rtol=rtol, what=jax.tree_util.keystr(path))


def assert_updates_close(
    before, ours, ref, lr: float, steps: int = 1, rtol: float = UPDATE_RTOL
) -> None:
    """Parameters after `steps` optimizer steps (`ours`, `ref`, from the same `before`) moved
    alike: max |ours - ref| <= steps * rtol * lr per leaf, given `STABLE_ADAM_EPS` (see
    above; a later step's gradient differs further only by the Hessian times the earlier
    differences, far below that). The premise is checked too: the reference moved by more
    than 10x the tolerance."""
    tol = steps * rtol * lr
    flat_before = dict(jax.tree_util.tree_leaves_with_path(before))
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref))
    moved = 0.0
    for path, x in jax.tree_util.tree_leaves_with_path(ours):
        name = jax.tree_util.keystr(path)
        b, o, r = _host(flat_before[path]), _host(x), _host(flat_ref[path])
        err = np.abs(o - r).max(initial=0.0)
        assert err <= tol, f"{name}: updates differ by {err:.3g} > {steps} x {rtol} x lr {lr}"
        moved = max(moved, np.abs(r - b).max(initial=0.0))
    assert moved > 10 * tol, f"the reference barely moved ({moved:.3g}): nothing compared"
