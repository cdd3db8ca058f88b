"""Ring attention over 2, 4 and 8 fake devices equals dense attention, gradients included; the
zigzag layout round-trips; the compiled programs hold the expected collective-permutes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import (
    GRAD_RTOL,
    OUT_ATOL,
    SCALE,
    SOFTCAP,
    capped_reference,
    dense,
    inputs,
    packed_segments,
)

from jaxrl.kernels import attention
from jaxrl.kernels.ring import ring_attention, unzigzag, zigzag, zigzag_order
from jaxrl.sharding import Layout, make_mesh
from jaxrl.testing.numerics import assert_close_to_scale


def mesh_for(sp):
    return make_mesh({"dp": 8 // sp, "sp": sp})


def ring(mesh, sp, seg, window, batch_axes, causal=True):
    def run(q, k, v):
        out = ring_attention(
            zigzag(q, sp), zigzag(k, sp), zigzag(v, sp), mesh=mesh, scale=SCALE, causal=causal,
            segment_ids=None if seg is None else zigzag(seg, sp), sliding_window=window,
            batch_axes=batch_axes, block_q=8, block_k=8,
        )  # fmt: skip
        return unzigzag(out, sp)

    return run


def test_zigzag_layout():
    order = zigzag_order(16, 2)  # chunks of 4: device 0 holds chunks 0 and 3, device 1: 1, 2
    np.testing.assert_array_equal(order, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
    x = jnp.arange(2 * 48).reshape(2, 48)
    for sp in (2, 4, 8):
        np.testing.assert_array_equal(unzigzag(zigzag(x, sp), sp), x)
    with pytest.raises(ValueError, match="divisible by 2"):
        zigzag_order(20, 4)


@pytest.mark.parametrize(
    ("sp", "segments", "window", "heads", "causal"),
    [
        (2, True, 9, (4, 2), True),
        (4, True, None, (4, 1), True),
        (8, False, None, (2, 2), True),
        (4, True, 9, (4, 2), False),
    ],
)
def test_ring_equals_dense(sp, segments, window, heads, causal):
    mesh = mesh_for(sp)
    b, t = 2, 64
    q, k, v = inputs(b, t, t, *heads)
    seg = packed_segments(b, t) if segments else None
    run = ring(mesh, sp, seg, window, "dp" if 8 // sp <= b else None, causal)
    ref_out, _ = dense(q, k, v, causal=causal, seg_q=seg, seg_kv=seg, window=window, xp=np)
    # test_attention's tolerances: the same float32 terms in another order (ring hops and
    # blocks); measured <= 1.1e-6 for out, 4.5e-7 of the scale for the gradients
    np.testing.assert_allclose(jax.jit(run)(q, k, v), ref_out, atol=OUT_ATOL)

    w = jnp.asarray(np.random.default_rng(1).normal(size=ref_out.shape), jnp.float32)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(run(*a) * w), (0, 1, 2)))(q, k, v)
    # jitted: eagerly, each of the dense oracle's ops and their gradients compile on their own
    ref = jax.jit(jax.grad(
        lambda *a: jnp.sum(dense(*a, causal=causal, seg_q=seg, seg_kv=seg, window=window)[0] * w),
        (0, 1, 2),
    ))(q, k, v)  # fmt: skip
    for name, g, r in zip("qkv", grads, ref, strict=True):
        assert_close_to_scale(g, r, rtol=GRAD_RTOL, what=f"d{name}")


def test_ring_softcap_equals_reference():
    """`attention(implementation="ring", logit_softcap=c)`: every hop's blocks are capped, so the
    merged softmax is the capped one; causal, segments and a window over sp=4, gradients too."""
    sp, b, t = 4, 2, 64
    layout = Layout.create(mesh_for(sp), {"batch": "dp"})
    q, k, v = inputs(b, t, t, 4, 2)
    seg = packed_segments(b, t)

    def run(q, k, v):
        out = attention(
            zigzag(q, sp), zigzag(k, sp), zigzag(v, sp), segment_ids=zigzag(seg, sp),
            sliding_window=9, softmax_scale=SCALE, implementation="ring", layout=layout,
            logit_softcap=SOFTCAP,
        )  # fmt: skip
        return unzigzag(out, sp)

    def reference(q, k, v):
        return capped_reference(q, k, v, seg_q=seg, seg_k=seg, window=9)[0]

    # test_ring_equals_dense's tolerances: the same float32 terms in another order.
    np.testing.assert_allclose(jax.jit(run)(q, k, v), jax.jit(reference)(q, k, v), atol=OUT_ATOL)
    w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
    grads, ref = (
        jax.jit(jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) * w), (0, 1, 2)))(q, k, v)
        for fn in (run, reference)
    )
    for name, g, r in zip("qkv", grads, ref, strict=True):
        assert_close_to_scale(g, r, rtol=GRAD_RTOL, what=f"d{name}")


def _compiled(fn, *args) -> tuple[int, list[int]]:
    """(collective-permutes, known loop trip counts) of the compiled program."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    trips = [int(n) for n in re.findall(r'known_trip_count":\{"n":"(\d+)"', text)]
    return text.count("collective-permute-start(") + text.count("collective-permute("), trips


def test_collective_permutes_per_hop():
    """The hops are a loop of P - 1 trips. Forward: k, v and segment ids hop once per trip.
    Backward: the same, with dk and dv travelling along (5 per trip), and one more hop of dk
    and dv to take the last keys' gradients home."""
    sp = 4
    mesh = mesh_for(sp)
    q, k, v = inputs(2, 32, 32, 4, 2)
    run = ring(mesh, sp, packed_segments(2, 32), None, "dp")
    permutes, trips = _compiled(run, q, k, v)
    assert permutes == 3 and trips.count(sp - 1) == 1
    permutes, trips = _compiled(jax.grad(lambda *a: jnp.sum(run(*a)), (0, 1, 2)), q, k, v)
    assert permutes == 3 + (3 + 2) + 2 and trips.count(sp - 1) == 2
