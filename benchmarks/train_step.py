"""Workload W2: one training step (forward + backward + AdamW) of a policy-gradient loss.

    python benchmarks/train_step.py [--sizes S,M,L]

Batch 8 sequences x 512 tokens. The loss reads the response log-probs as the actor's loss does
(`jaxrl.trainer.sequences.response_log_probs`: positions 64..511 predict the next token), times a
per-sequence advantage, token-mean over the response; AdamW (lr 1e-6, weight decay 0.01) with
the gradient clipped to norm 1. Median of 3 steps after 1 warm-up. Figures: step seconds,
tokens/s = 8 * 512 / step, and MFU = 6 * N * 4096 / step / peak (N all parameters, a tied
embedding once; the float32 matmul peak measured in the same run). `gpu_suite.py` runs the same
step for the 1.5B shape in bf16 compute.
"""

from __future__ import annotations

import argparse
import time

from common import emit, machine, matmul_peak_flops, median_seconds, workload_checkpoint

ROWS, LENGTH, PROMPT = 8, 512, 64


def bench_train_step(config, *, rows: int, length: int, prompt: int, params=None) -> dict:
    """Time the step of `config` (random parameters in `config.param_dtype` unless given) on
    `rows` sequences of `length` tokens, the first `prompt` of them the prompt."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jaxrl.models import init_params
    from jaxrl.trainer.sequences import response_log_probs
    from jaxrl.trainer.update import init_state, make_update_step

    if params is None:
        params = jax.jit(lambda key: init_params(config, key))(jax.random.key(0))
    optimizer = optax.adamw(1e-6, weight_decay=0.01)
    state = init_state(params, optimizer, None, None)

    def loss_fn(params, batch):
        log_probs, _ = response_log_probs(config, params, batch, temperature=1.0, chunk_size=2048)
        mask = batch["response_mask"].astype(jnp.float32)
        weighted = log_probs * batch["advantages"][:, None] * mask
        return -jnp.sum(weighted) / jnp.sum(mask), {}

    step = make_update_step(loss_fn, optimizer, grad_clip=1.0)
    rng = np.random.RandomState(0)
    ids = rng.randint(3, config.vocab_size, (rows, length)).astype(np.int32)
    batch = {
        "prompts": ids[:, :prompt],
        "prompt_mask": np.ones((rows, prompt), np.int32),
        "responses": ids[:, prompt:],
        "response_mask": np.ones((rows, length - prompt), np.int32),
        "advantages": rng.randn(rows).astype(np.float32),
    }
    batch = jax.device_put(batch)
    holder = [state]

    def run():
        holder[0], metrics = step(holder[0], batch)
        jax.block_until_ready(metrics)

    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    seconds = median_seconds(run, warmup=0)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    return {
        "step_s": seconds,
        "tokens_per_s": rows * length / seconds,
        "flops": 6 * n_params * rows * length,
        "params": n_params,
        "compile_s": first - seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="S,M")
    args = parser.parse_args()

    import jaxrl.models as M

    peak = matmul_peak_flops()
    results = {}
    for size in args.sizes.split(","):
        config, params = M.from_pretrained(workload_checkpoint(size), dtype="float32")
        figures = bench_train_step(config, rows=ROWS, length=LENGTH, prompt=PROMPT, params=params)
        figures["mfu"] = figures["flops"] / figures["step_s"] / peak
        results[size] = figures
        print(size, figures, flush=True)
    emit({"workload": "W2", "rows": ROWS, "length": LENGTH, "prompt": PROMPT,
          "peak_flops": peak, "results": results, "machine": machine()})  # fmt: skip


if __name__ == "__main__":
    main()
