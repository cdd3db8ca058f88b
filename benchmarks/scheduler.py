"""W1 through the request scheduler beside the engine's fixed-batch generation.

    python benchmarks/scheduler.py [--size S] [--chunks 16,64] [--n 1]

The W1 workload (16 prompts x 64 random tokens, exactly 128 sampled tokens each, temperature
1, EOS ignored) on workload model `--size`, float32, as one `Scheduler.generate` batch
request: once on its fixed-batch path (`fast=True`: the engine's loop, prefill and every
decode step in one program, the host waits once), and once per `--chunks` entry on the
slots (`fast=False`: its 16 prompts submitted as requests, copies=`--n`, run to their end:
admission, `chunk` decode steps per program call, the host reading each chunk's tokens
back). One warm-up each, then the median of 3. The figure is tokens/s and its ratio to the
fixed-batch path: whether batch generation's fast path is still worth keeping.
"""

from __future__ import annotations

import argparse

from common import emit, machine, median_seconds, workload_checkpoint

PROMPTS, PROMPT, NEW = 16, 64, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="S")
    parser.add_argument("--chunks", default="16,64")
    parser.add_argument("--n", type=int, default=1)
    args = parser.parse_args()

    import jax
    import numpy as np

    import jaxrl.models as M
    from jaxrl.rollout import RolloutEngine, SamplingParams, Scheduler

    config, params = M.from_pretrained(workload_checkpoint(args.size), dtype="float32")
    rows = PROMPTS * args.n
    engine = RolloutEngine(config, max_num_seqs=rows, max_model_len=PROMPT + NEW + 1)
    engine.load_weights(params)
    rng = np.random.RandomState(0)
    ids = rng.randint(3, config.vocab_size, (PROMPTS, PROMPT)).astype(np.int32)
    mask = np.ones_like(ids)
    sampling = SamplingParams(n=args.n, temperature=1.0, max_tokens=NEW, ignore_eos=True)
    key = jax.random.key(0)

    def generate(chunk, fast):
        out = Scheduler(engine, chunk=chunk).generate(ids, mask, sampling, key, fast=fast)
        assert int(np.asarray(out.response_mask).sum()) == rows * NEW
        jax.block_until_ready(out.log_probs)

    def fixed_batch():
        generate(None, True)

    def scheduled(chunk):
        generate(chunk, False)

    tokens = rows * NEW
    base = median_seconds(fixed_batch)
    result = {"fixed_batch": {"seconds": base, "tokens_per_s": tokens / base}}
    for chunk in [int(c) for c in args.chunks.split(",")]:
        seconds = median_seconds(lambda chunk=chunk: scheduled(chunk))
        result[f"scheduler_chunk_{chunk}"] = {
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "fixed_batch_speedup": seconds / base,
        }
    emit({"workload": "W1 via the scheduler", "size": args.size, "n": args.n,
          "machine": machine(), **result})  # fmt: skip


if __name__ == "__main__":
    main()
