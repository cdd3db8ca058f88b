"""Load time and forward throughput of the workload models: `python benchmarks/forward.py`.

For each size (S, M, L of WORKLOADS.md): seconds to read the HF checkpoint with
`jaxrl.models.from_pretrained`, then a jitted forward (logits) over batch x seq tokens, median
of 3 after a warm-up, as tokens/s and as a fraction of the machine's float32 matmul peak
(FLOPs = 2 N tokens + attention). The same forward in `transformers` (torch, same threads)
runs beside it as the peer. JSON on the last line.
"""

from __future__ import annotations

import argparse
import os
import time

from common import emit, machine, matmul_peak_flops, median_seconds, workload_checkpoint


def forward_flops(config, batch: int, seq: int) -> float:
    """Matmul FLOPs of one forward: 2 N_matmul per token + causal attention (QK and PV)."""
    d, f, n_layers = config.hidden_size, config.intermediate_size, config.num_layers
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = d * (q + 2 * kv) + q * d + 3 * d * f
    matmul = 2 * batch * seq * (n_layers * per_layer + d * config.vocab_size)
    attention = 2 * 2 * batch * n_layers * q * seq * seq / 2
    return matmul + attention


def bench_size(size: str, batch: int, seq: int, peak: float, torch_peer: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxrl.models as M

    folder = workload_checkpoint(size)
    load_times = []
    for _ in range(2):  # the second read has the files in the page cache, as torch's does
        start = time.perf_counter()
        config, params = M.from_pretrained(folder)
        jax.block_until_ready(params)
        load_times.append(time.perf_counter() - start)
    load_s = min(load_times)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    ids = np.random.RandomState(0).randint(3, config.vocab_size, (batch, seq))
    mask = np.ones_like(ids)
    fwd = jax.jit(M.forward, static_argnums=0)
    ids_j, mask_j = jnp.asarray(ids), jnp.asarray(mask)
    seconds = median_seconds(lambda: fwd(config, params, ids_j, mask_j).block_until_ready())
    flops = forward_flops(config, batch, seq)
    result = {
        "params": n_params,
        "load_s": load_s,
        "forward_s": seconds,
        "tokens_per_s": batch * seq / seconds,
        "mfu": flops / seconds / peak,
    }
    if torch_peer:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(os.cpu_count() or 1)
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        result["torch_load_s"] = time.perf_counter() - start
        t_ids, t_mask = torch.tensor(ids), torch.tensor(mask)

        def run_torch():
            with torch.no_grad():
                model(input_ids=t_ids, attention_mask=t_mask)

        result["torch_forward_s"] = median_seconds(run_torch)
        result["speedup_vs_torch"] = result["torch_forward_s"] / seconds
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="S,M,L")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--no-torch", action="store_true", help="skip the transformers peer")
    args = parser.parse_args()
    peak = matmul_peak_flops()
    results = {}
    for size in args.sizes.split(","):
        results[size] = bench_size(size, args.batch, args.seq, peak, not args.no_torch)
        print(size, results[size], flush=True)
    emit(
        {
            "workload": "forward",
            "batch": args.batch,
            "seq": args.seq,
            "dtype": "float32",
            "peak_gflops": peak / 1e9,
            "results": results,
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
