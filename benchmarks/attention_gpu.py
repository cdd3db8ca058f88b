"""`pallas_gpu` flash attention on a GPU: forward and forward+backward time and TFLOP/s.

    python benchmarks/attention_gpu.py [--ts 2048,8192,16384,32768] [--blocks 64x64,128x64]

Workload: batch 1, 8 query heads, 2 kv heads, head dim 64, causal, bfloat16. FLOPs counted as
causal: forward 2·2·B·N·T²·H / 2, backward 2.5 times that (so forward+backward 3.5 times).
Beside it, where it runs, `jax.nn.dot_product_attention(implementation="cudnn")` on the same
inputs (its max |difference| from ours is reported as a correctness check).
`--interpret` runs the kernels in the Pallas interpreter (a smoke test on a CPU, small --ts).
"""

from __future__ import annotations

import argparse
import functools

from common import emit, machine, median_seconds

CALLS = 10  # back-to-back calls per timing: a 2k-token kernel runs for ~10 us, under the
# ~30-60 us of Python dispatch one call costs, so one blocked call would time the dispatch


def _time(fn, *args) -> float:
    """Seconds per call: the median over 5 of `CALLS` calls dispatched back to back and
    waited for once."""
    import jax

    def calls():
        for _ in range(CALLS - 1):
            fn(*args)
        jax.block_until_ready(fn(*args))

    return median_seconds(calls, warmup=1, repeats=5) / CALLS


def random_inputs(t: int, b: int = 1, n: int = 8, kh: int = 2, h: int = 64):
    """A1's bf16 (q, k, v, dout) at sequence length t."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(t), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, kh, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, kh, h), jnp.bfloat16)
    dout = jax.random.normal(keys[3], (b, t, n, h), jnp.bfloat16)
    return q, k, v, dout


def causal_fwd_flops(q) -> float:
    """2 matmuls x 2 FLOPs x B x N x T^2 x H, halved by the causal mask."""
    b, t, n, h = q.shape
    return 2 * 2 * b * n * t * t * h / 2


def pallas_figures(q, k, v, dout, block_q: int, block_k: int, interpret: bool = False) -> dict:
    """Forward and forward+backward time and TFLOP/s of the Pallas kernel."""
    import jax

    from jaxrl.kernels.pallas_gpu import pallas_attention

    attend = functools.partial(
        pallas_attention,
        causal=True,
        scale=q.shape[-1] ** -0.5,
        block_q=block_q,
        block_k=block_k,
        interpret=interpret,
    )
    fwd = jax.jit(lambda q, k, v: attend(q, k, v)[0])
    fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(lambda *a: attend(*a)[0], q, k, v)[1](do))
    fwd_s, fwd_bwd_s = _time(fwd, q, k, v), _time(fwd_bwd, q, k, v, dout)
    flops = causal_fwd_flops(q)
    return {
        "block_q": block_q,
        "block_k": block_k,
        "fwd_ms": fwd_s * 1e3,
        "fwd_tflops": flops / fwd_s / 1e12,
        "fwd_bwd_ms": fwd_bwd_s * 1e3,
        "fwd_bwd_tflops": 3.5 * flops / fwd_bwd_s / 1e12,
        "out": fwd(q, k, v),
    }


def cudnn_figures(q, k, v, dout, pallas_out=None) -> dict:
    """The same for `jax.nn.dot_product_attention(implementation="cudnn")`, and its max
    |difference| from the Pallas output when given; an error is reported, not raised."""
    import jax
    import jax.numpy as jnp

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    flops = causal_fwd_flops(q)
    try:
        fwd = jax.jit(attend)
        fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(attend, q, k, v)[1](do))
        ref = fwd(q, k, v)
        fwd_s, fwd_bwd_s = _time(fwd, q, k, v), _time(fwd_bwd, q, k, v, dout)
    except Exception as error:  # cuDNN missing or the shape unsupported: report, go on
        return {"cudnn_error": f"{type(error).__name__}: {str(error)[:200]}"}
    figures = {
        "cudnn_fwd_ms": fwd_s * 1e3,
        "cudnn_fwd_tflops": flops / fwd_s / 1e12,
        "cudnn_fwd_bwd_ms": fwd_bwd_s * 1e3,
        "cudnn_fwd_bwd_tflops": 3.5 * flops / fwd_bwd_s / 1e12,
    }
    if pallas_out is not None:
        diff = jnp.max(jnp.abs(ref.astype(jnp.float32) - pallas_out.astype(jnp.float32)))
        figures["max_abs_diff_vs_cudnn"] = float(diff)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ts", default="2048,8192,16384,32768", help="sequence lengths")
    parser.add_argument("--blocks", default="64x64,128x64", help="block_q x block_k configs")
    parser.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU)")
    parser.add_argument("--no-cudnn", action="store_true", help="skip the cuDNN comparison")
    args = parser.parse_args()

    import jax

    b, n, kh, h = 1, 8, 2, 64
    results = []
    for t in (int(x) for x in args.ts.split(",")):
        q, k, v, dout = random_inputs(t, b, n, kh, h)
        out = None
        for block in args.blocks.split(","):
            block_q, block_k = (int(x) for x in block.split("x"))
            figures = pallas_figures(q, k, v, dout, block_q, block_k, interpret=args.interpret)
            out = figures.pop("out")
            results.append({"t": t, **figures})
            print(results[-1], flush=True)
        if not args.no_cudnn and jax.default_backend() == "gpu":
            results.append({"t": t, **cudnn_figures(q, k, v, dout, out)})
            print(results[-1], flush=True)
    emit(
        {
            "workload": "attention_gpu",
            "batch": b,
            "heads": n,
            "kv_heads": kh,
            "head_dim": h,
            "causal": True,
            "dtype": "bfloat16",
            "flops": "causal: fwd 2*2*B*N*T*T*H/2, bwd 2.5x fwd",
            "results": results,
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
