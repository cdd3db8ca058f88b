"""Workload W1: generation throughput of jaxrl's engine beside HF `generate` on the same model.

    python benchmarks/generate.py [--sizes S,M,L] [--dtypes float32,bfloat16] [--prefix]

16 prompts x 64 random tokens, exactly 128 sampled tokens each (temperature 1, no top-k/top-p,
EOS ignored), KV cache on; one warm-up call, then the median of 3. Figures: tokens/s
(16 x 128 / median, prefill included), prefill seconds, decode tokens/s, compile seconds, and
the decode step against its memory roofline (parameter + KV-cache bytes read per step over the
machine's measured read bandwidth). On a CPU, float32 runs once more with the C++ decode
kernels off (`jaxrl_float32_xla_kernels`). HF `generate` (torch, same thread count, min = max new
tokens = 128) runs on the same checkpoint in float32 as the peer. JSON on the last line, with
the cores other processes kept busy meanwhile (`other_processes_cores`: compare ratios only
from runs where it is ~0; on a shared machine HF slows down far more than jaxrl).
"""

from __future__ import annotations

import argparse
import os
import time

from common import emit, hf_sample, machine, median_seconds, wall_seconds, workload_checkpoint

from jaxrl.kernels import cpu_decode

BATCH, PROMPT, NEW = 16, 64, 128


def busy_seconds() -> float | None:
    """CPU seconds all processes have run so far (Linux /proc/stat), or None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def other_processes_cores(start_busy: float | None, start_own: float, start_wall: float):
    """Cores the *other* processes kept busy on average since the start: the machine is
    shared, and a ratio measured while they ran is not comparable (HF's threads suffer more
    from it than XLA's)."""
    busy = busy_seconds()
    if busy is None or start_busy is None:
        return None
    own = sum(os.times()[:4]) - start_own
    return max(busy - start_busy - own, 0.0) / (time.perf_counter() - start_wall)


def memory_bandwidth() -> float:
    """Read bytes/s: a jitted sum over a 512 MiB float32 array (what a decode step does with
    the parameters: read each once), the fastest of 7 runs (the machine's capability, which a
    busy shared host only lowers)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((128 * 2**20,), jnp.float32)
    total = jax.jit(jnp.sum)
    return x.nbytes / min(wall_seconds(lambda: total(x).block_until_ready(), repeats=7))


def bench_jaxrl(folder, dtype: str, bandwidth: float) -> dict:
    import jaxrl.models as M

    config, params = M.from_pretrained(folder, dtype=dtype)
    return bench_engine(config, params, dtype, bandwidth)


def bench_engine(config, params, dtype: str, bandwidth: float | None, new: int = NEW) -> dict:
    """W1 on loaded parameters: `BATCH` prompts x `PROMPT` random tokens, `new` sampled tokens
    each. `bytes_per_step` is what a decode step reads: the parameters and the KV cache, whose
    length is the engine's (`cache_geometry`: up to 256 entries it is one block read whole
    every step, as here; beyond, blocks up to the live prefix, and this is an upper bound).
    With `bandwidth`, the step's roof is `bytes_per_step / bandwidth`."""
    import jax
    import numpy as np

    from jaxrl.rollout import RolloutEngine, SamplingParams

    config = config.replace(dtype=dtype)
    engine = RolloutEngine(config.replace(param_dtype=str(jax.tree.leaves(params)[0].dtype)))
    engine.load_weights(params)  # the trainer's rollout copy (per layer for the xla step)
    rng = np.random.RandomState(0)
    ids = rng.randint(3, config.vocab_size, (BATCH, PROMPT)).astype(np.int32)
    mask = np.ones_like(ids)
    sp = SamplingParams(temperature=1.0, max_tokens=new, ignore_eos=True)
    keys = iter(jax.random.split(jax.random.key(0), 100))

    def run(sampling):
        out = engine.generate(ids, mask, sampling, next(keys))
        jax.block_until_ready(out)
        return out

    start = time.perf_counter()
    out = run(sp)
    first_call = time.perf_counter() - start
    assert int(out.lengths.min()) == new
    total = median_seconds(lambda: run(sp), warmup=0)
    prefill_sp = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True)
    run(prefill_sp)
    prefill = median_seconds(lambda: run(prefill_sp), warmup=0)
    decode_step = (total - prefill) / (new - 1)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    kv_bytes = kv_cache_bytes(config, BATCH, PROMPT, new)
    figures = {
        "tokens_per_s": BATCH * new / total,
        "seconds": total,
        "prefill_s": prefill,
        "decode_tokens_per_s": BATCH * (new - 1) / (total - prefill),
        "decode_step_s": decode_step,
        "bytes_per_step": param_bytes + kv_bytes,
        "compile_s": first_call - total,
    }
    return figures if bandwidth is None else with_roof(figures, bandwidth)


def kv_cache_bytes(config, batch: int, prompt: int, new: int) -> int:
    """Bytes of the KV cache `generate` allocates for `batch` rows of `prompt` + `new` tokens
    (its length the engine's `cache_geometry`), in the compute dtype."""
    import numpy as np

    from jaxrl.data import bucket
    from jaxrl.rollout.generation import cache_geometry

    cells, _ = cache_geometry(bucket(prompt), new)
    per_row = 2 * config.num_layers * cells * config.num_kv_heads * config.head_dim
    return batch * per_row * np.dtype(config.compute_dtype).itemsize


def with_roof(figures: dict, bandwidth: float) -> dict:
    """`bench_engine`'s figures with the decode step's roof at `bandwidth` bytes/s."""
    roof = figures["bytes_per_step"] / bandwidth
    return {
        **figures,
        "roofline_step_s": roof,
        "fraction_of_roofline": roof / figures["decode_step_s"],
    }


def bench_hf(folder) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor(
        np.random.RandomState(0).randint(3, model.config.vocab_size, (BATCH, PROMPT))
    )

    def run():
        out = hf_sample(model, ids, NEW)
        assert out.shape[1] == PROMPT + NEW

    seconds = median_seconds(run)
    return {"tokens_per_s": BATCH * NEW / seconds, "seconds": seconds}


def long_tail() -> dict:
    """Real responses end at different times: SmolLM2-135M-Instruct, 16 chat prompts x n=4,
    up to 128 tokens with EOS, static batching (64 slots) against continuous batching (16 and 32
    slots). Reports the share of decode slot-steps that produced no token, and throughput."""
    import jax
    from transformers import AutoTokenizer

    import jaxrl.models as M
    from jaxrl.rollout import SamplingParams, generate, idle_fraction
    from jaxrl.testing.assets import smollm2_135m_instruct

    folder = smollm2_135m_instruct()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.padding_side = "left"
    questions = [
        f"What is {a} + {b}? Answer briefly."
        for a, b in zip(range(3, 19), range(40, 56), strict=True)
    ]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
    enc = tokenizer(texts, return_tensors="np", padding=True)
    config, params = M.from_pretrained(folder)
    sp = SamplingParams(temperature=1.0, max_tokens=128, n=4, eos_token_ids=config.eos_token_id)
    results = {}
    for slots in (None, 32, 16):

        def run(key, slots=slots):
            out = generate(
                config,
                params,
                enc["input_ids"],
                enc["attention_mask"],
                sp,
                key,
                max_num_seqs=slots,
            )
            return jax.block_until_ready(out)

        run(jax.random.key(0))
        start = time.perf_counter()
        out = run(jax.random.key(1))
        seconds = time.perf_counter() - start
        lengths = out.lengths
        results[f"slots_{out.slots}"] = {
            "rows": int(lengths.shape[0]),
            "mean_length": float(lengths.mean()),
            "max_length": int(lengths.max()),
            "decode_steps": int(out.decode_steps),
            "idle_fraction": idle_fraction(out),
            "seconds": seconds,
            "useful_tokens_per_s": float(lengths.sum()) / seconds,
        }
    return results


def shared_prefill(folder, prompts: int = 4, length: int = 512, n: int = 8) -> dict:
    """Prefix sharing: `prompts` prompts of `length` random tokens, n samples each, one new
    token (the call is its prefill), float32; each prompt prefilled once and copied into its
    n slots, against every copy prefilled. Median of 3 after a warm-up each."""
    import jax
    import numpy as np

    import jaxrl.models as M
    from jaxrl.rollout import SamplingParams, generate

    config, params = M.from_pretrained(folder, dtype="float32")
    rng = np.random.RandomState(0)
    ids = rng.randint(3, config.vocab_size, (prompts, length)).astype(np.int32)
    mask = np.ones_like(ids)
    sp = SamplingParams(temperature=1.0, max_tokens=1, n=n, ignore_eos=True)
    figures = {}
    for shared in (True, False):

        def run(shared=shared):
            out = generate(config, params, ids, mask, sp, jax.random.key(0), prefix_sharing=shared)
            jax.block_until_ready(out)

        figures["shared_s" if shared else "per_copy_s"] = median_seconds(run)
    figures["speedup"] = figures["per_copy_s"] / figures["shared_s"]
    return {"prompts": prompts, "prompt_tokens": length, "n": n, **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="S,M,L")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument(
        "--long-tail", action="store_true", help="also measure finished-row idling (SmolLM2)"
    )
    parser.add_argument(
        "--prefix",
        action="store_true",
        help="also measure prefix sharing: 512-token prompts, n=8, model S",
    )
    args = parser.parse_args()
    start = busy_seconds(), sum(os.times()[:4]), time.perf_counter()
    bandwidth = memory_bandwidth()
    results = {}
    for size in args.sizes.split(","):
        folder = workload_checkpoint(size)
        entry = {f"jaxrl_{d}": bench_jaxrl(folder, d, bandwidth) for d in args.dtypes.split(",")}
        if "float32" in args.dtypes.split(",") and cpu_decode.enabled("float32"):
            # The same float32 run on XLA's kernels (the C++ CPU decode kernels off).
            os.environ["JAXRL_CPU_KERNELS"] = "0"
            try:
                entry["jaxrl_float32_xla_kernels"] = bench_jaxrl(folder, "float32", bandwidth)
            finally:
                os.environ.pop("JAXRL_CPU_KERNELS")
        if not args.no_hf:
            entry["hf_float32"] = bench_hf(folder)
            for d in args.dtypes.split(","):
                entry[f"ratio_{d}_vs_hf"] = (
                    entry[f"jaxrl_{d}"]["tokens_per_s"] / entry["hf_float32"]["tokens_per_s"]
                )
        results[size] = entry
        print(size, entry, flush=True)
    if args.prefix:
        results["shared_prefill_S"] = shared_prefill(workload_checkpoint("S"))
        print("shared prefill", results["shared_prefill_S"], flush=True)
    if args.long_tail:
        results["long_tail_smollm2"] = long_tail()
        print("long tail", results["long_tail_smollm2"], flush=True)
    emit(
        {
            "workload": "W1",
            "batch": BATCH,
            "prompt": PROMPT,
            "new_tokens": NEW,
            "bandwidth_bytes_per_s": bandwidth,
            "other_processes_cores": other_processes_cores(*start),
            "results": results,
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
