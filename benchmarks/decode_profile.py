"""Where a W1 decode step's device time goes: kernels summed by name from a profiler trace.

    python benchmarks/decode_profile.py [--size M|L|tiny] [--unroll]

W1's shapes (16 prompts x 64 random tokens, 128 sampled tokens, bf16, random weights of
workload model `--size`'s shape): the decode step's seconds (best of 5 full calls minus best
of 5 prefill-only calls, over 127 steps), then one more call under `jax.profiler.trace`, whose
device events are summed by kernel name. Figures: `decode_step_ms`, `kernels_per_step`,
`device_busy_ms` against `call_ms` (a device idle between kernels is host-bound; busy
throughout, it is bound by its kernels), `copy_ms` (the `memcpy*` kernels) and the top kernels.
`--unroll` unrolls every `lax.scan` (the layer stacks of prefill and decode). XLA_FLAGS is
read as usual, so command-buffer settings compare run against run. On a CPU there are no
device events: only the timings come back. JSON on the last line (docs/gpu.md: the first
H200 run).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import tempfile
import time

from common import MODEL_SIZES, emit

BATCH, PROMPT, NEW = 16, 64, 128
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def decoder_config(size: str):
    """Workload model `size`'s shape (WORKLOADS.md: Qwen2, 2 kv heads, head dim 64, tied) in
    bf16; `tiny` for a CPU check."""
    import jaxrl.models as M

    shape = TINY if size == "tiny" else MODEL_SIZES[size]
    return M.DecoderConfig(
        model_type="qwen2", vocab_size=512 if size == "tiny" else 32000,
        hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_layers=shape["num_hidden_layers"], num_heads=shape["num_attention_heads"],
        num_kv_heads=2, head_dim=64 if size != "tiny" else 16, tie_word_embeddings=True,
        param_dtype="bfloat16", dtype="bfloat16",
    )  # fmt: skip


def kernel_table(xplane: str) -> tuple[dict[str, list], float]:
    """{kernel name: [count, milliseconds]} over the GPU planes of a trace, and the span
    from the first kernel's start to the last one's end (ms)."""
    import jax

    data = jax.profiler.ProfileData.from_file(xplane)
    table: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    first, last = float("inf"), 0.0
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            for event in line.events:
                table[event.name][0] += 1
                table[event.name][1] += event.duration_ns / 1e6
                first = min(first, event.start_ns)
                last = max(last, event.start_ns + event.duration_ns)
    return dict(table), max(0.0, (last - first) / 1e6)


def profile(size: str, unroll: bool) -> dict:
    import jax
    import numpy as np

    if unroll:
        scan = jax.lax.scan
        jax.lax.scan = lambda *a, **k: scan(*a, **{**k, "unroll": True})
    import jaxrl.models as M
    from jaxrl.rollout import RolloutEngine, SamplingParams

    config = decoder_config(size)
    params = jax.jit(lambda key: M.init_params(config, key))(jax.random.key(0))
    ids = np.random.RandomState(0).randint(3, config.vocab_size, (BATCH, PROMPT)).astype(np.int32)
    mask = np.ones_like(ids)
    engine = RolloutEngine(config)  # the trainer's rollout copy (per layer for the xla step)
    engine.load_weights(params)

    def call(new: int, seed: int) -> float:
        sampling = SamplingParams(temperature=1.0, max_tokens=new, ignore_eos=True)
        start = time.perf_counter()
        jax.block_until_ready(engine.generate(ids, mask, sampling, jax.random.key(seed)))
        return time.perf_counter() - start

    call(NEW, 0), call(1, 0)  # compile both
    total = min(call(NEW, s) for s in range(5))
    prefill = min(call(1, s) for s in range(5))
    figures = {"size": size, "unroll": unroll, "xla_flags": os.environ.get("XLA_FLAGS", ""),
               "backend": jax.default_backend(), "call_ms": 1e3 * total,
               "decode_step_ms": 1e3 * (total - prefill) / (NEW - 1)}  # fmt: skip
    folder = tempfile.mkdtemp()
    with jax.profiler.trace(folder):
        call(NEW, 7)
    table, span = kernel_table(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
    if table:
        top = sorted(table.items(), key=lambda kv: -kv[1][1])
        figures.update(
            kernels_per_step=sum(c for c, _ in table.values()) / NEW,
            device_busy_ms=sum(ms for _, ms in table.values()),
            device_span_ms=span,
            copy_ms=sum(ms for name, (_, ms) in table.items() if name.startswith("memcpy")),
            top=[[name[:80], count, round(ms, 3)] for name, (count, ms) in top[:20]],
        )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="M", choices=["tiny", *MODEL_SIZES])
    parser.add_argument("--unroll", action="store_true", help="unroll every lax.scan")
    args = parser.parse_args()
    emit(profile(args.size, args.unroll))


if __name__ == "__main__":
    main()
