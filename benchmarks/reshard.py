"""Workload R1: the actor's train -> rollout reshard (verl's 3D-HybridEngine switch) and back.

    python benchmarks/reshard.py [--sizes M,L]

On 8 fake CPU devices (set here before JAX starts): parameters of model M / L in the train
layout (fsdp=8, float32) resharded to the rollout layout (dp=4, tp=2, bfloat16) and back, one
tensor per program (jaxrl's default) and as one program (the plain path) for comparison.
Figures per device: parameter bytes before and after, the largest XLA temporary, the peak
(before + after + temporary: the train copy stays alive), bytes received, seconds; and the same
switch on 8 GPUs by the same accounting: bytes received per device over NVLink bandwidth.
JSON on the last line.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_cpu_experimental_ynn_fusion_type="
)

import argparse
import time

from common import MODEL_SIZES, emit, machine

NVLINK_BYTES_PER_S = 450e9  # H100 SXM, NVLink 4, per direction per GPU


def decoder_config(size: str):
    import jaxrl.models as M

    s = MODEL_SIZES[size]
    return M.DecoderConfig(
        model_type="qwen2",
        vocab_size=32000,
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_layers=s["num_hidden_layers"],
        num_heads=s["num_attention_heads"],
        num_kv_heads=2,
        head_dim=64,
        qkv_bias=True,
        tie_word_embeddings=True,
    )


def bench(size: str) -> dict:
    import jax

    import jaxrl.models as M
    from jaxrl.sharding import (
        ROLLOUT_RULES,
        TRAIN_RULES,
        Layout,
        free,
        reshard,
        reshard_report,
        rollout_mesh,
        train_mesh,
    )

    config = decoder_config(size)
    train = Layout.create(train_mesh({"fsdp": 8}), TRAIN_RULES)
    rollout = Layout.create(rollout_mesh(2), ROLLOUT_RULES)
    init = jax.jit(M.init_params, static_argnums=0, out_shardings=M.param_shardings(config, train))
    params = jax.block_until_ready(init(config, jax.random.key(0)))
    to_rollout, to_train = M.param_shardings(config, rollout), M.param_shardings(config, train)
    result = {"params": sum(x.size for x in jax.tree.leaves(params))}
    for name, bucket in (("per_tensor", None), ("one_program", 1 << 62)):
        report = reshard_report(params, to_rollout, dtype="bfloat16", bucket_bytes=bucket)
        rolled = jax.block_until_ready(reshard(params, to_rollout, "bfloat16", bucket))  # compile
        free(rolled)
        start = time.perf_counter()
        rolled = jax.block_until_ready(reshard(params, to_rollout, "bfloat16", bucket))
        forward_s = time.perf_counter() - start
        back = jax.block_until_ready(reshard(rolled, to_train, "float32", bucket))  # compile
        free(back)
        start = time.perf_counter()
        back = jax.block_until_ready(reshard(rolled, to_train, "float32", bucket))
        back_s = time.perf_counter() - start
        free(rolled)
        free(back)
        result[name] = {
            **report,
            "seconds_to_rollout": forward_s,
            "seconds_back": back_s,
            "gpu_estimate_s": report["bytes_moved_per_device"] / NVLINK_BYTES_PER_S,
            "peak_over_params": report["peak"] / (report["params_before"] + report["params_after"]),
        }
        print(size, name, result[name], flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="M,L")
    args = parser.parse_args()
    results = {size: bench(size) for size in args.sizes.split(",")}
    emit(
        {
            "workload": "R1",
            "train_layout": "fsdp=8 float32",
            "rollout_layout": "dp=4 tp=2 bfloat16",
            "nvlink_bytes_per_s": NVLINK_BYTES_PER_S,
            "results": results,
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
