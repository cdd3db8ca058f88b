"""Shared by the benchmark scripts: the machine description and the measured matmul peak."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import jax

    devices = jax.devices()
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
    }


def wall_seconds(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 3) -> list[float]:
    """Wall times of `repeats` calls of `fn()` (which must block until its result is ready),
    after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_seconds(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 3) -> float:
    """Median wall time of `fn()` (which must block until its result is ready)."""
    return statistics.median(wall_seconds(fn, warmup=warmup, repeats=repeats))


def matmul_peak_flops(n: int = 2048, dtype: str = "float32") -> float:
    """FLOP/s of a jitted n x n x n matmul on the default device: the MFU denominator."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    matmul = jax.jit(jnp.matmul)
    seconds = median_seconds(lambda: matmul(a, b).block_until_ready(), warmup=2, repeats=5)
    return 2 * n**3 / seconds


def hf_sample(model, ids, new_tokens: int):
    """HF `generate` the way the workloads sample: temperature 1, no top-k/top-p, exactly
    `new_tokens` new tokens (EOS suppressed), all-ones attention mask."""
    import torch

    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_new_tokens=new_tokens,
            max_new_tokens=new_tokens,
            pad_token_id=0,
        )


def emit(result: dict[str, Any]) -> None:
    """Print the benchmark's JSON line (always the last line of stdout)."""
    print(json.dumps(result, sort_keys=True))


# Model shapes of WORKLOADS.md (HF Qwen2, random init, float32, vocab 32000, tied).
MODEL_SIZES = {
    "S": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=768),
    "M": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, intermediate_size=1536),
    "L": dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, intermediate_size=4864
    ),
}


# A mixture of experts of S's other sizes (issue 44): HF Qwen3-MoE (so q/k norm and no q/k/v
# biases, unlike S), 16 experts of intermediate 192, 4 per token (the active MLP is S's 768),
# renormalised top-k; 18.4M parameters, 11.4M of them active per token (S: 11.3M).
MOE_SIZES = {
    "MoE-S": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  moe_intermediate_size=192, intermediate_size=768, num_experts=16,
                  num_experts_per_tok=4, norm_topk_prob=True),
}  # fmt: skip


def workload_checkpoint(size: str):
    """The HF checkpoint folder of workload model `size`, created once (seeded) in the cache."""
    from pathlib import Path

    folder = Path(os.environ.get("JAXRL_CACHE", "~/.cache/jaxrl")).expanduser()
    family = "qwen3_moe" if size in MOE_SIZES else "qwen2"
    folder = folder / "workloads" / f"{family}-{size}"
    if (folder / "model.safetensors").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(workload_hf_config(size)).save_pretrained(str(folder))
    return folder


def workload_hf_config(size: str):
    """The HF config of workload model `size` (WORKLOADS.md): `Qwen2Config`, or
    `Qwen3MoeConfig` for the `MOE_SIZES`."""
    from transformers import Qwen2Config, Qwen3MoeConfig

    common = dict(
        vocab_size=32000,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        pad_token_id=0,
        eos_token_id=1,
        max_position_embeddings=4096,
    )
    if size in MOE_SIZES:
        return Qwen3MoeConfig(**common, **MOE_SIZES[size])
    return Qwen2Config(**common, **MODEL_SIZES[size])
