"""`DecoderConfig`: the static description of one decoder-only transformer, read from HF.

HF's `config.json` is read through `transformers.AutoConfig`, so defaults and the v4 -> v5
renames (`rope_scaling` -> `rope_parameters`, `layer_types`) follow transformers exactly; the
result is a frozen, hashable dataclass that can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from jaxrl.kernels import NO_WINDOW
from jaxrl.models.moe import MoeSpec

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "mixtral",
                         "gemma2", "gemma3_text")  # fmt: skip
GEMMA_TYPES = ("gemma2", "gemma3_text")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
# HF activation names (`hidden_act`, Gemma's `hidden_activation`) -> `mlp_activation`
_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
REMAT_POLICIES = ("none", "full", "save_dots")
HEADS = ("causal_lm", "token_classification", "sequence_classification")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF's `rope_parameters`).

    Attributes:
        type: One of `ROPE_TYPES`.
        theta: Base wavelength.
        factor: Scaling factor (linear, dynamic, llama3, yarn).
        original_max_position_embeddings: Pre-extension context (llama3, yarn).
        low_freq_factor: llama3 smoothing parameter.
        high_freq_factor: llama3 smoothing parameter.
        attention_factor: yarn's cos/sin scale; None derives it from `factor` and the mscales.
        beta_fast: yarn's fast rotation bound.
        beta_slow: yarn's slow rotation bound.
        mscale: yarn's mscale.
        mscale_all_dim: yarn's mscale_all_dim.
        truncate: yarn truncates the correction range to whole dimensions.
        max_position_embeddings: The model's context (dynamic NTK's reference length).
    """

    type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    max_position_embeddings: int = 2048


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters on the model's projections (`jaxrl.models.lora`).

    Attributes:
        rank: r, the adapters' inner width (> 0).
        alpha: The update's scale numerator: the update is (alpha / r) · x A B.
        targets: The adapted weights (`jaxrl.models.lora.adaptable`): projections by HF
            module name (`q_proj`, ..., `down_proj`; a mixture of experts' gate/up/down are
            its shared expert's) and a mixture of experts' expert parameters
            (`experts.gate_up_proj`, `experts.down_proj`).
        dtype: Storage dtype of the adapters (float32: they are the trained weights, whatever
            the frozen base's dtype).
    """

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dtype: str = "float32"

    def __post_init__(self):
        if self.rank <= 0:
            raise ValueError(f"LoRA rank={self.rank}: must be > 0 (lora_rank=0 turns LoRA off)")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha={self.alpha}: must be > 0")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """A llama-family decoder: what the weights are and how to run them.

    Attributes:
        model_type: HF model type (one of `SUPPORTED_MODEL_TYPES`).
        vocab_size: V.
        hidden_size: D.
        intermediate_size: F (SwiGLU width).
        num_layers: L.
        num_heads: N query heads.
        num_kv_heads: K key/value heads (N a multiple of K).
        head_dim: H.
        rms_norm_eps: RMSNorm epsilon.
        rope: Rotary embedding parameters.
        tie_word_embeddings: The LM head is the embedding matrix.
        qkv_bias: q/k/v projections have biases.
        o_bias: The output projection has a bias.
        mlp_bias: gate/up/down projections have biases.
        qk_norm: RMSNorm over the head dim of q and k before RoPE (Qwen3).
        sliding_windows: Per layer, the sliding window in tokens or None (full attention).
        head: `causal_lm` (logits), `token_classification` (per-token scores, the critic) or
            `sequence_classification` (one score at the last token, a reward model).
        num_labels: Outputs of a classification head.
        score_bias: The classification head has a bias (HF token classification does).
        pad_token_id: Padding token (HF's config value).
        eos_token_id: End-of-sequence token ids.
        param_dtype: Storage dtype of the parameters.
        dtype: Compute dtype (parameters are cast to it on use; norms and softmax in float32).
        remat: `none`, `full` or `save_dots`: what the scanned layer keeps for the backward pass.
        attention_impl: Passed to `jaxrl.kernels.attention`.
        lora: LoRA adapters the parameter tree carries (`jaxrl.models.lora`); None: none.
            A tree without them (the frozen base) runs as the plain model.
        moe: Every layer's MLP is a mixture of experts (`jaxrl.models.moe`; the tree's
            `layers/moe` in place of `layers/mlp`); None: dense.
        moe_intermediate_size: Each expert's SwiGLU width.
        shared_expert_intermediate_size: Qwen2-MoE's shared expert's SwiGLU width, added to
            the routed experts' sum through a sigmoid gate (0: none).
        norm_unit_offset: Every RMSNorm scales by (1 + w), the product in float32 then cast
            (Gemma: its norm weights are offsets from 1 and initialise to zeros).
        post_norms: Gemma's sandwich norms: the attention output and the MLP output are
            RMS-normed (`ln_attn_out_d`, `ln_mlp_out_d`) before their residual adds.
        mlp_activation: The gated MLP's activation: `silu` (SwiGLU) or `gelu_tanh` (GeGLU,
            HF's `gelu_pytorch_tanh`: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))).
        scale_embeddings: Token embeddings are multiplied by sqrt(D) (rounded to the compute
            dtype, as HF rounds it to the model's) at every embedding site (Gemma).
        query_pre_attn_scalar: Attention scores are (q·k) / sqrt(query_pre_attn_scalar)
            (Gemma); None: (q·k) / sqrt(H).
        attn_logit_softcap: Attention scores s become c · tanh(s / c) before the mask (Gemma
            2's `attn_logit_softcapping`); None: uncapped.
        final_logit_softcap: LM logits z become c · tanh(z / c) (Gemma's
            `final_logit_softcapping`); None: uncapped.
        rope_local: The RoPE of the sliding-window layers where it differs from `rope` (Gemma
            3's `sliding_attention` entry: theta = `rope_local_base_freq`); None: every layer
            uses `rope`.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_windows: tuple[int | None, ...] = ()
    head: str = "causal_lm"
    num_labels: int = 1
    score_bias: bool = False
    pad_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: str = "none"
    attention_impl: str = "auto"
    lora: LoraSpec | None = None
    moe: MoeSpec | None = None
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_unit_offset: bool = False
    post_norms: bool = False
    mlp_activation: str = "silu"
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    rope_local: RopeConfig | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if not self.sliding_windows:  # default: full attention in every layer
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(
                f"sliding_windows has {len(self.sliding_windows)} entries for "
                f"{self.num_layers} layers"
            )
        for name, value, allowed in (
            ("remat", self.remat, REMAT_POLICIES),
            ("head", self.head, HEADS),
            ("rope.type", self.rope.type, ROPE_TYPES),
            ("rope_local.type", (self.rope_local or self.rope).type, ROPE_TYPES),
            ("mlp_activation", self.mlp_activation, MLP_ACTIVATIONS),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not supported; use one of {allowed}")

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def window_per_layer(self) -> tuple[int, ...]:
        """Sliding windows with `NO_WINDOW` for full-attention layers (a scannable array)."""
        return tuple(NO_WINDOW if w is None else w for w in self.sliding_windows)

    @property
    def softmax_scale(self) -> float | None:
        """The attention score scale: 1 / sqrt(query_pre_attn_scalar), or None (the
        kernels' default 1 / sqrt(H))."""
        q = self.query_pre_attn_scalar
        return None if q is None else float(q) ** -0.5

    @property
    def ropes(self) -> tuple[RopeConfig, ...]:
        """The distinct RoPEs: (rope,) or (rope, rope_local)."""
        return (self.rope,) if self.rope_local is None else (self.rope, self.rope_local)

    @property
    def rope_per_layer(self) -> tuple[int, ...]:
        """Per layer, its index into `ropes`: 1 for a sliding-window layer when
        `rope_local` is set, else 0 (a scannable array)."""
        local = self.rope_local is not None
        return tuple(int(local and w is not None) for w in self.sliding_windows)

    def replace(self, **changes: Any) -> DecoderConfig:
        return dataclasses.replace(self, **changes)


def _rope_from_hf(hf: Any, params: Mapping[str, Any] | None = None) -> RopeConfig:
    """The RoPE of HF's flat `rope_parameters` (or `params`: one entry of Gemma 3's nested
    ones, by layer type)."""
    params = dict((getattr(hf, "rope_parameters", None) if params is None else params) or {})
    if not params:  # transformers < 5 style
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported by jaxrl; supported: {', '.join(ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported by jaxrl")
    max_pos = hf.max_position_embeddings
    original = params.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn") and original is None:
        original = max_pos
    factor = params.get("factor")
    if rope_type == "yarn" and factor is None:
        factor = max_pos / original
    return RopeConfig(
        type=rope_type,
        theta=float(params.get("rope_theta", 10000.0)),
        factor=None if factor is None else float(factor),
        original_max_position_embeddings=original,
        low_freq_factor=params.get("low_freq_factor"),
        high_freq_factor=params.get("high_freq_factor"),
        attention_factor=params.get("attention_factor"),
        beta_fast=params.get("beta_fast"),
        beta_slow=params.get("beta_slow"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=params.get("truncate", True),
        max_position_embeddings=max_pos,
    )


def _sliding_windows(hf: Any) -> tuple[int | None, ...]:
    n = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    if hf.model_type in ("mistral", "mixtral"):
        return (window,) * n
    if hf.model_type == "qwen3_moe":  # one window on every layer, when it is used
        return (window if getattr(hf, "use_sliding_window", False) else None,) * n
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is None or window is None:
        return (None,) * n
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def _head_from_hf(hf: Any) -> tuple[str, bool]:
    archs = getattr(hf, "architectures", None) or []
    if any(a.endswith("ForTokenClassification") for a in archs):
        return "token_classification", bool(getattr(hf, "token_classification_bias", True))
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return "sequence_classification", False
    return "causal_lm", False


def from_hf_config(
    hf: Any, *, overrides: Mapping[str, Any] | None = None, **options: Any
) -> DecoderConfig:
    """A `DecoderConfig` from a `transformers.PretrainedConfig` (or `AutoConfig` output).

    Args:
        hf: The HF config.
        overrides: HF config entries to change first (verl's `model.override_config`).
        **options: `DecoderConfig` fields to set (`dtype`, `param_dtype`, `remat`, `head`, ...).

    Raises:
        ValueError: for a model type or option jaxrl does not implement, naming it.
    """
    for key, value in (overrides or {}).items():
        setattr(hf, key, value)
    if hf.model_type == "gemma3":
        raise ValueError(
            "model type 'gemma3' (Gemma 3 with its vision tower, Gemma3ForConditionalGeneration) "
            "is not supported by jaxrl yet; its text model is: extract it with "
            "`transformers.AutoConfig.from_pretrained(path).text_config` (model type "
            "gemma3_text) and save the language model's weights as a Gemma3ForCausalLM folder"
        )
    if hf.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {hf.model_type!r} is not supported by jaxrl; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    act_key = "hidden_activation" if hf.model_type in GEMMA_TYPES else "hidden_act"
    act = getattr(hf, act_key, "silu")
    allowed = ("gelu_pytorch_tanh",) if hf.model_type in GEMMA_TYPES else ("silu",)
    if act not in allowed:
        raise ValueError(
            f"{act_key}={act!r} is not supported for {hf.model_type} (use {allowed[0]})"
        )
    head, score_bias = _head_from_hf(hf)
    eos = getattr(hf, "eos_token_id", None)
    eos = () if eos is None else tuple(eos) if isinstance(eos, list | tuple) else (eos,)
    fields = dict(
        model_type=hf.model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        rms_norm_eps=hf.rms_norm_eps,
        rope=_rope_from_hf(hf),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=hf.model_type == "qwen2"
        or (hf.model_type == "qwen2_moe" and bool(getattr(hf, "qkv_bias", True)))
        or bool(getattr(hf, "attention_bias", False)),
        o_bias=hf.model_type in ("llama", "qwen3", "qwen3_moe", *GEMMA_TYPES)
        and bool(getattr(hf, "attention_bias", False)),
        mlp_bias=hf.model_type == "llama" and bool(getattr(hf, "mlp_bias", False)),
        mlp_activation=_HF_ACTIVATIONS[act],
        qk_norm=hf.model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        sliding_windows=_sliding_windows(hf),
        head=head,
        num_labels=getattr(hf, "num_labels", 1) if head != "causal_lm" else 1,
        score_bias=score_bias,
        pad_token_id=getattr(hf, "pad_token_id", None),
        eos_token_id=eos,
        **_moe_from_hf(hf),
    )
    if hf.model_type in GEMMA_TYPES:
        fields.update(_gemma_from_hf(hf, fields["sliding_windows"]))
    fields.update(options)
    return DecoderConfig(**fields)


def _gemma_from_hf(hf: Any, windows: tuple[int | None, ...]) -> dict[str, Any]:
    """Gemma 2 / Gemma 3 (text): (1 + w) sandwich norms, sqrt(D)-scaled embeddings, the
    query_pre_attn_scalar score scale, the soft-caps and Gemma 3's RoPE per layer type.

    HF 5.24's Gemma 3 attention never applies `attn_logit_softcapping` (it is not passed to
    its attention functions), so it is dropped here too."""
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError(
            f"{hf.model_type} with use_bidirectional_attention=True (an encoder-style mask) is "
            "not supported by jaxrl: it decodes causally"
        )
    fields: dict[str, Any] = dict(
        norm_unit_offset=True,
        post_norms=True,
        scale_embeddings=True,
        query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
        final_logit_softcap=_cap(getattr(hf, "final_logit_softcapping", None)),
    )
    if hf.model_type == "gemma2":
        fields["attn_logit_softcap"] = _cap(getattr(hf, "attn_logit_softcapping", None))
        return fields
    ropes = hf.rope_parameters  # nested by layer type (replaces the flat read's default)
    fields["rope"] = _rope_from_hf(hf, ropes["full_attention"])
    local = _rope_from_hf(hf, ropes["sliding_attention"])
    kinds = tuple(hf.layer_types)
    sliding = tuple(t == "sliding_attention" for t in kinds)
    if sliding != tuple(w is not None for w in windows) and local != fields["rope"]:
        raise ValueError(
            f"gemma3_text with sliding_window={hf.sliding_window} and layer_types {kinds}: "
            "jaxrl gives the local RoPE to the windowed layers; set a sliding_window"
        )
    fields["rope_local"] = None if local == fields["rope"] else local
    return fields


def _cap(value: float | None) -> float | None:
    return None if value is None else float(value)


def _moe_from_hf(hf: Any) -> dict[str, Any]:
    """`moe` and `moe_intermediate_size` of an MoE family (every layer sparse)."""
    if hf.model_type in ("qwen2_moe", "qwen3_moe"):
        if getattr(hf, "mlp_only_layers", None) or getattr(hf, "decoder_sparse_step", 1) != 1:
            raise ValueError(
                f"{hf.model_type} with dense layers (mlp_only_layers, decoder_sparse_step != 1) "
                "is not supported by jaxrl yet: every layer must be sparse"
            )
        spec = MoeSpec(hf.num_experts, hf.num_experts_per_tok, "qwen",
                       bool(hf.norm_topk_prob))  # fmt: skip
        shared = getattr(hf, "shared_expert_intermediate_size", 0) or 0
        return {"moe": spec, "moe_intermediate_size": hf.moe_intermediate_size,
                "shared_expert_intermediate_size": shared}  # fmt: skip
    if hf.model_type == "mixtral":
        if getattr(hf, "router_jitter_noise", 0.0):
            raise ValueError(
                f"mixtral router_jitter_noise={hf.router_jitter_noise}: jaxrl routes without "
                "noise; set it to 0"
            )
        spec = MoeSpec(hf.num_local_experts, hf.num_experts_per_tok, "mixtral", True)
        return {"moe": spec, "moe_intermediate_size": hf.intermediate_size}
    return {}
