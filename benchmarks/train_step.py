"""Workload W2: one training step (forward + backward + AdamW) of a policy-gradient loss.

    python benchmarks/train_step.py [--sizes S,M,L,MoE-S]

Batch 8 sequences x 512 tokens. The actor's own update (`Learner.update` with its loss, verl's
default actor config): positions 64..511 predict the next token, the policy-gradient loss of a
per-sequence advantage (on-policy, so PPO's ratio is 1), token-mean over the response; AdamW
(lr 1e-6, weight decay 0.01), the gradient clipped to norm 1. Median of 3 steps after 1
warm-up. Figures: step seconds, tokens/s = 8 * 512 / step, and MFU = 6 * N * 4096 / step / peak
(N all parameters, a tied embedding once; for a mixture of experts, `MoE-S`, the parameters
one token uses; the float32 matmul peak measured in the same run).
`gpu_suite.py` runs the same step for the 1.5B shape in bf16 compute.
"""

from __future__ import annotations

import argparse
import time

from common import emit, machine, matmul_peak_flops, median_seconds, workload_checkpoint

ROWS, LENGTH, PROMPT = 8, 512, 64


def bench_train_step(config, *, rows: int, length: int, prompt: int, params=None) -> dict:
    """Time the actor's update of `config` (random parameters in `config.param_dtype` unless
    given) on `rows` sequences of `length` tokens, the first `prompt` of them the prompt: the
    run's own path (`Learner.update` with the actor's loss, on-policy: one mini-batch, one
    micro-batch, one optimizer step; verl's default actor config, lr 1e-6, weight decay 0.01)."""
    import functools

    import jax
    import numpy as np

    from jaxrl.config import Config
    from jaxrl.models import init_params
    from jaxrl.models.params import parameter_counts
    from jaxrl.trainer import losses
    from jaxrl.trainer.batch import RLBatch
    from jaxrl.trainer.learner import Learner
    from jaxrl.trainer.optim import make_optimizer
    from jaxrl.trainer.update import init_state

    if params is None:
        params = jax.jit(lambda key: init_params(config, key))(jax.random.key(0))
    actor_cfg = Config().actor_rollout_ref.actor
    optimizer = make_optimizer(actor_cfg.optim, total_steps=100)
    loss = functools.partial(losses.actor_loss, config=config, actor_cfg=actor_cfg, temperature=1.0)
    learner = Learner(
        config, init_state(params, optimizer, None, None), optimizer, loss,
        layout=None, grad_clip=actor_cfg.grad_clip,
    )  # fmt: skip
    rng = np.random.RandomState(0)
    ids = rng.randint(3, config.vocab_size, (rows, length)).astype(np.int32)
    host = {
        "prompts": ids[:, :prompt],
        "prompt_mask": np.ones((rows, prompt), np.int32),
        "responses": ids[:, prompt:],
        "response_mask": np.ones((rows, length - prompt), np.int32),
        "advantages": np.repeat(rng.randn(rows, 1), length - prompt, 1).astype(np.float32),
    }
    batch = RLBatch.from_host(host, None)

    def run():  # returns after reading the metrics back: the step has finished
        learner.update(batch, mini_batch_rows=rows, epochs=1, shuffle=False, seed=0,
                       micro_rows=None, token_budget=None, fields=("advantages",))  # fmt: skip

    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    seconds = median_seconds(run, warmup=0)
    n_params = parameter_counts(config)[1]  # a token's: all of a dense model's
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
