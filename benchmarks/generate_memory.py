"""Peak memory of the generation program against the parameter and KV-cache bytes.

    python benchmarks/generate_memory.py [--sizes L] [--dtypes float32,bfloat16]
        [--backend xla]

W1's shapes (16 prompts x 64 tokens, 128 new tokens, one slot per row) on a workload model's
shape, compiled but not run (abstract parameters: no checkpoint, no weights allocated). The
figure is XLA's own account of the compiled program (`memory_analysis()`): argument bytes
(the parameters and the prompts) plus temp bytes (everything the program allocates, the KV
cache included), against params + KV cache; the goal is at most 10% above. JSON on the last
line.
"""

from __future__ import annotations

import argparse

from common import emit, machine, workload_hf_config


def model_config(size: str, dtype: str):
    """The workload model `size` as a jaxrl `DecoderConfig` (from its HF config alone)."""
    import jaxrl.models as M

    return M.from_hf_config(workload_hf_config(size)).replace(param_dtype=dtype, dtype=dtype)


def measure(size: str, dtype: str, backend: str, batch=16, prompt=64, new=128) -> dict:
    import jax
    import numpy as np
    from generate import kv_cache_bytes

    from jaxrl.models.params import abstract_params
    from jaxrl.rollout import RolloutEngine, SamplingParams

    config = model_config(size, dtype)
    params = abstract_params(config)
    sp = SamplingParams(max_tokens=new, ignore_eos=True)
    # the program the rollout runs on its copy of the weights (per layer for the xla step)
    compiled = RolloutEngine(config, decode_backend=backend).compile(params, batch, prompt, sp)
    memory = compiled.memory_analysis()
    param_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv_bytes = kv_cache_bytes(config, batch, prompt, new)
    peak = memory.argument_size_in_bytes + memory.temp_size_in_bytes
    return {
        "param_bytes": param_bytes,
        "kv_cache_bytes": kv_bytes,
        "argument_bytes": memory.argument_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
        "output_bytes": memory.output_size_in_bytes,
        "peak_bytes": peak,
        "peak_over_params_and_kv": peak / (param_bytes + kv_bytes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="L")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--backend", default="xla")
    args = parser.parse_args()
    results = {
        size: {d: measure(size, d, args.backend) for d in args.dtypes.split(",")}
        for size in args.sizes.split(",")
    }
    emit(
        {
            "workload": "generate_memory",
            "batch": 16,
            "prompt": 64,
            "new_tokens": 128,
            "backend": args.backend,
            "results": results,
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
