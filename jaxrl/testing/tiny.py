"""Tiny random HF checkpoints of every supported family, for tests and examples.

Each entry of `TINY_CONFIGS` is a distinct head layout or option set; `save_tiny` writes the
checkpoint with `transformers` (`save_pretrained`), exactly as a user's folder would look.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxrl.models import DecoderConfig

_COMMON = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    pad_token_id=0,
    eos_token_id=1,
)

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # llama: multi-head, tied; grouped-query with explicit head_dim, biases and llama3 rope;
    # multi-query with linear rope; dynamic NTK rope with a short trained context.
    "llama_mha_tied": dict(
        model_type="llama", num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True
    ),
    "llama_gqa_bias_llama3": dict(
        model_type="llama",
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
        mlp_bias=True,
        max_position_embeddings=64,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ),
    "llama_mqa_linear": dict(
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_scaling=dict(rope_type="linear", factor=2.0),
    ),
    "llama_dynamic": dict(
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8,
        rope_scaling=dict(rope_type="dynamic", factor=2.0),
    ),
    # qwen2: q/k/v biases, tied; sliding window on the upper layers with yarn rope.
    "qwen2_gqa_tied": dict(
        model_type="qwen2", num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True
    ),
    "qwen2_sliding_yarn": dict(
        model_type="qwen2",
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        max_position_embeddings=64,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    ),
    # qwen3: q/k norm with an explicit head_dim; attention biases, multi-query, sliding window.
    "qwen3_qknorm": dict(
        model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16
    ),
    "qwen3_bias_mqa_sliding": dict(
        model_type="qwen3",
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=12,
        attention_bias=True,
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=2,
        tie_word_embeddings=True,
    ),
    # mistral: sliding window everywhere; no window with an explicit head_dim.
    "mistral_sliding": dict(
        model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=4
    ),
    "mistral_headdim": dict(
        model_type="mistral",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=20,
        sliding_window=None,
    ),
    # gemma2: GeGLU, (1 + w) sandwich norms, sqrt(D)-scaled embeddings, a score scale
    # 1/sqrt(query_pre_attn_scalar) other than 1/sqrt(H), both soft-caps small enough that
    # tanh bends, a window of 4 on the even layers (the default layer_types); multi-query,
    # untied, biased, a window of 3 on explicit layer types with the default caps.
    "gemma2_softcap": dict(
        model_type="gemma2",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=4,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    ),
    "gemma2_mqa_untied_bias": dict(
        model_type="gemma2",
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=12,
        attention_bias=True,
        tie_word_embeddings=False,
        sliding_window=3,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    ),
    # gemma3_text: q/k (1 + w) norms, a global RoPE (theta 1e6, linear factor 2) and a local
    # one (theta 1e4) picked per layer, a window of 4 from the old sliding_window_pattern
    # (2: sliding, full, sliding); multi-query, untied, a final soft-cap and an attention cap
    # that HF never applies.
    "gemma3_local_rope": dict(
        model_type="gemma3_text",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        sliding_window_pattern=2,
        rope_parameters={
            "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
            "sliding_attention": dict(rope_type="default", rope_theta=1e4),
        },
    ),
    "gemma3_capped_mqa_untied": dict(
        model_type="gemma3_text",
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=32,
        final_logit_softcapping=3.0,
        attn_logit_softcapping=1.0,
        tie_word_embeddings=False,
        sliding_window=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),
}

# HF class name prefixes (model type -> prefix of `{prefix}ForCausalLM` etc.)
_FAMILY = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral",
           "gemma2": "Gemma2", "gemma3_text": "Gemma3Text"}  # fmt: skip
# Where the class is not the prefix + suffix.
_CLASS_NAMES = {("gemma3_text", "ForCausalLM"): "Gemma3ForCausalLM"}


def hf_config(name: str, **changes: Any) -> Any:
    """The `transformers` config of a tiny model (`changes` override entries)."""
    from transformers import AutoConfig

    spec = {**_COMMON, **TINY_CONFIGS[name], **changes}
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def save_tiny(
    name: str, folder: str | Path, head: str = "causal_lm", seed: int = 0, **changes: Any
) -> Path:
    """Write a random tiny checkpoint of `TINY_CONFIGS[name]` (optionally with a head)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = hf_config(name, **changes)
    cls_suffix = {
        "causal_lm": "ForCausalLM",
        "token_classification": "ForTokenClassification",
        "sequence_classification": "ForSequenceClassification",
    }[head]
    name = _CLASS_NAMES.get((config.model_type, cls_suffix),
                            _FAMILY[config.model_type] + cls_suffix)  # fmt: skip
    cls = getattr(transformers, name)
    if head != "causal_lm":
        config.num_labels = 1
    model = cls(config).eval()
    if config.model_type.startswith("gemma"):
        _randomise_gemma_offsets(model)
    folder = Path(folder)
    model.save_pretrained(str(folder))
    return folder


def _randomise_gemma_offsets(model: Any) -> None:
    """Gemma's norm weights are offsets from 1, initialised to zeros, and its biases zero: set
    them random, so a wrongly mapped norm or bias cannot pass a parity test."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.normal_(0.0, 0.3)


def tiny_decoder(**changes: Any):
    """A minimal `jaxrl.models.DecoderConfig` (llama, 1 layer, GQA 2/1) for shape and error
    tests that need no HF checkpoint; `changes` replace fields."""
    fields = dict(
        model_type="llama",
        vocab_size=16,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
    )
    return DecoderConfig(**{**fields, **changes})
