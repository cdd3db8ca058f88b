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


def _time(fn, *args) -> float:
    import jax

    return median_seconds(lambda: jax.block_until_ready(fn(*args)), warmup=2, repeats=5)


def _cudnn_figures(q, k, v, dout, out, fwd_flops):
    import jax
    import jax.numpy as jnp

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    try:
        fwd = jax.jit(attend)
        fwd_bwd = jax.jit(lambda q, k, v, do: jax.vjp(attend, q, k, v)[1](do))
        ref = fwd(q, k, v)
        diff = float(jnp.max(jnp.abs(ref.astype(jnp.float32) - out.astype(jnp.float32))))
        fwd_s, fwd_bwd_s = _time(fwd, q, k, v), _time(fwd_bwd, q, k, v, dout)
    except Exception as error:  # cuDNN missing or the shape unsupported: report, go on
        return {"cudnn_error": f"{type(error).__name__}: {str(error)[:200]}"}
    return {
        "cudnn_fwd_ms": fwd_s * 1e3,
        "cudnn_fwd_tflops": fwd_flops / fwd_s / 1e12,
        "cudnn_fwd_bwd_ms": fwd_bwd_s * 1e3,
        "cudnn_fwd_bwd_tflops": 3.5 * fwd_flops / fwd_bwd_s / 1e12,
        "max_abs_diff_vs_cudnn": diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ts", default="2048,8192,16384,32768", help="sequence lengths")
    parser.add_argument("--blocks", default="64x64,128x64", help="block_q x block_k configs")
    parser.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU)")
    parser.add_argument("--no-cudnn", action="store_true", help="skip the cuDNN comparison")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from jaxrl.kernels.pallas_gpu import pallas_attention

    b, n, kh, h = 1, 8, 2, 64
    results = []
    for t in (int(x) for x in args.ts.split(",")):
        keys = jax.random.split(jax.random.key(t), 4)
        q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
        k = jax.random.normal(keys[1], (b, t, kh, h), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, t, kh, h), jnp.bfloat16)
        dout = jax.random.normal(keys[3], (b, t, n, h), jnp.bfloat16)
        fwd_flops = 2 * 2 * b * n * t * t * h / 2
        out = None
        for block in args.blocks.split(","):
            block_q, block_k = (int(x) for x in block.split("x"))
            attend = functools.partial(
                pallas_attention,
                causal=True,
                scale=h**-0.5,
                block_q=block_q,
                block_k=block_k,
                interpret=args.interpret,
            )
            fwd = jax.jit(lambda q, k, v, attend=attend: attend(q, k, v)[0])
            fwd_bwd = jax.jit(
                lambda q, k, v, do, attend=attend: jax.vjp(lambda *a: attend(*a)[0], q, k, v)[1](do)
            )
            out = fwd(q, k, v)
            fwd_s, fwd_bwd_s = _time(fwd, q, k, v), _time(fwd_bwd, q, k, v, dout)
            results.append(
                {
                    "t": t,
                    "block_q": block_q,
                    "block_k": block_k,
                    "fwd_ms": fwd_s * 1e3,
                    "fwd_tflops": fwd_flops / fwd_s / 1e12,
                    "fwd_bwd_ms": fwd_bwd_s * 1e3,
                    "fwd_bwd_tflops": 3.5 * fwd_flops / fwd_bwd_s / 1e12,
                }
            )
            print(results[-1], flush=True)
        if not args.no_cudnn and jax.default_backend() == "gpu":
            results.append({"t": t, **_cudnn_figures(q, k, v, dout, out, fwd_flops)})
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
