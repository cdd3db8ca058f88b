"""Workload A1: causal attention at 2k-32k tokens; time and XLA temporary bytes.

    python benchmarks/attention.py [--lengths 2048,8192,16384,32768] [--time-limit 8192]

Batch 1, 8 query heads, 2 kv heads, head dim 64, float32, causal. For `reference` (dense) and
`blockwise`: the XLA temp bytes of the compiled forward and forward+backward programs (compiled
only, so dense is measured where it could never run here), and their median wall time for
lengths up to `--time-limit` (dense) / all lengths (blockwise). Ring attention over sp = 2, 4, 8
fake CPU devices: temp bytes per device of forward+backward. XLA_FLAGS disables the CPU's YNN
fusions (set here before JAX starts), which otherwise hide temporaries. JSON on the last line.
On a GPU, `benchmarks/attention_gpu.py` times the Pallas kernel.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_cpu_experimental_ynn_fusion_type="
)

import argparse

from common import emit, machine, median_seconds

B, N, K, H = 1, 8, 2, 64


def problem(t: int):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, t, N, H), jnp.float32)
    k, v = (jax.random.normal(key, (B, t, K, H), jnp.float32) for key in keys[1:])
    return q, k, v


def programs(impl: str):
    """(forward, forward+backward) functions of (q, k, v)."""
    import jax
    import jax.numpy as jnp

    from jaxrl.kernels import attention

    def fwd(q, k, v):
        return attention(q, k, v, implementation=impl)

    def fwd_bwd(q, k, v):
        return jax.grad(lambda *a: jnp.sum(fwd(*a) ** 2), (0, 1, 2))(q, k, v)

    return {"forward": fwd, "forward_backward": fwd_bwd}


def temp_bytes(fn, *args) -> int:
    import jax

    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def flops(t: int, kind: str) -> float:
    """Causal attention FLOPs: 2 matmuls of 2·T·T·H per head, half the triangle; backward 2.5x."""
    forward = 2 * 2 * B * N * t * t * H / 2
    return forward if kind == "forward" else 3.5 * forward


def single_device(lengths, time_limit) -> list[dict]:
    import jax

    rows = []
    for impl in ("reference", "blockwise"):
        for t in lengths:
            args = problem(t)
            for kind, fn in programs(impl).items():
                row = {"impl": impl, "T": t, "pass": kind, "temp_bytes": temp_bytes(fn, *args)}
                if impl == "blockwise" or t <= time_limit:
                    jitted = jax.jit(fn)
                    seconds = median_seconds(
                        lambda jitted=jitted, args=args: jax.block_until_ready(jitted(*args)),
                        repeats=1 if t >= 16384 else 3,
                    )
                    row |= {"seconds": seconds, "gflop_per_s": flops(t, kind) / seconds / 1e9}
                rows.append(row)
                print(row, flush=True)
    return rows


def ring_rows(t: int) -> list[dict]:
    import jax

    from jaxrl.sharding import TRAIN_RULES, Layout, train_mesh, use_layout

    rows = []
    q, k, v = problem(t)
    for sp in (1, 2, 4, 8):
        impl = "blockwise" if sp == 1 else "ring"
        mesh = train_mesh({"dp": 1, "fsdp": 1, "tp": 1, "sp": sp}, jax.devices()[:sp])
        layout = Layout.create(mesh, TRAIN_RULES)
        sharding = layout.sharding(q.shape, ("batch", "seq", "heads", "head_dim"))
        placed = [jax.device_put(x, sharding) for x in (q, k, v)]
        with use_layout(layout):
            row = {"impl": impl, "T": t, "sp": sp, "pass": "forward_backward"}
            row["temp_bytes_per_device"] = temp_bytes(programs(impl)["forward_backward"], *placed)
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,8192,16384,32768")
    parser.add_argument("--time-limit", type=int, default=8192, help="longest dense run timed")
    parser.add_argument("--ring-length", type=int, default=16384)
    parser.add_argument("--ring-only", action="store_true", help="skip the single-device rows")
    args = parser.parse_args()
    lengths = [] if args.ring_only else [int(x) for x in args.lengths.split(",")]
    rows = single_device(lengths, args.time_limit)
    ring = ring_rows(args.ring_length)
    by = {(r["impl"], r["T"], r["pass"]): r["temp_bytes"] for r in rows}
    summary = {}
    for t in lengths:
        dense, block = (
            by[("reference", t, "forward_backward")],
            by[("blockwise", t, "forward_backward")],
        )
        summary[f"dense_over_blockwise_temp_fwd_bwd_{t}"] = dense / max(block, 1)
    emit({"workload": "A1", "machine": machine(), "rows": rows, "ring": ring, "summary": summary})


if __name__ == "__main__":
    main()
