"""Where each jaxrl parameter lives in a HuggingFace checkpoint, and how it is laid out there.

HF stores `nn.Linear` weights as [out, in]; jaxrl as [in, out] with the head axes split out
(`w_q_dnh` is `q_proj.weight` [N*H, D] transposed and reshaped to [D, N, H]). Layer tensors are
per layer in HF (`model.layers.{i}.…`) and stacked on a leading axis in jaxrl. The supported
families share these names; mixtures of experts name their experts per family, and Gemma's
four norms a layer put `post_attention_layernorm` on the attention's output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from jaxrl.models.config import DecoderConfig


@dataclasses.dataclass(frozen=True)
class Entry:
    """One parameter: its path in the jaxrl tree and its HF tensor.

    Attributes:
        path: Keys into the jaxrl parameter tree.
        hf_name: HF tensor name; `{i}` stands for the layer index of stacked parameters,
            `{j}` for the expert index of an MoE layer's experts (stacked [L, E, ...]).
        to_jax: HF tensor -> jaxrl layout (one layer for stacked parameters).
        to_hf: The inverse.
    """

    path: tuple[str, ...]
    hf_name: str
    to_jax: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf_name

    @property
    def per_expert(self) -> bool:
        return "{j}" in self.hf_name


def _same(x: np.ndarray) -> np.ndarray:
    return x


def _linear(*out_shape: int) -> tuple[Callable, Callable]:
    """[out, in] <-> [in, *out_shape]."""

    def to_jax(w: np.ndarray) -> np.ndarray:
        return w.T.reshape(w.shape[1], *out_shape)

    def to_hf(w: np.ndarray) -> np.ndarray:
        return w.reshape(w.shape[0], -1).T

    return to_jax, to_hf


def _linear_in(*in_shape: int) -> tuple[Callable, Callable]:
    """[out, prod(in_shape)] <-> [*in_shape, out] (the output projection)."""

    def to_jax(w: np.ndarray) -> np.ndarray:
        return w.T.reshape(*in_shape, w.shape[0])

    def to_hf(w: np.ndarray) -> np.ndarray:
        return w.reshape(-1, w.shape[-1]).T

    return to_jax, to_hf


def _reshape(*shape: int) -> tuple[Callable, Callable]:
    return (lambda b: b.reshape(shape)), (lambda b: b.reshape(-1))


def entries(config: DecoderConfig, prefix: str = "model.") -> Iterator[Entry]:
    """Every parameter of `config` with its HF name (base-model tensors under `prefix`)."""
    c = config
    N, K, H = c.num_heads, c.num_kv_heads, c.head_dim
    layer = prefix + "layers.{i}."
    attn, mlp = layer + "self_attn.", layer + "mlp."
    yield Entry(("embed", "tokens_vd"), prefix + "embed_tokens.weight", _same, _same)
    yield Entry(("layers", "ln_attn_d"), layer + "input_layernorm.weight", _same, _same)
    if c.post_norms:  # Gemma: post_attention_layernorm norms the attention's output
        for path, name in (("ln_attn_out_d", "post_attention_layernorm"),
                           ("ln_mlp_d", "pre_feedforward_layernorm"),
                           ("ln_mlp_out_d", "post_feedforward_layernorm")):  # fmt: skip
            yield Entry(("layers", path), f"{layer}{name}.weight", _same, _same)
    else:
        yield Entry(("layers", "ln_mlp_d"), layer + "post_attention_layernorm.weight", _same,
                    _same)  # fmt: skip
    yield Entry(("layers", "attn", "w_q_dnh"), attn + "q_proj.weight", *_linear(N, H))
    yield Entry(("layers", "attn", "w_k_dkh"), attn + "k_proj.weight", *_linear(K, H))
    yield Entry(("layers", "attn", "w_v_dkh"), attn + "v_proj.weight", *_linear(K, H))
    yield Entry(("layers", "attn", "w_o_nhd"), attn + "o_proj.weight", *_linear_in(N, H))
    if c.qkv_bias:
        yield Entry(("layers", "attn", "b_q_nh"), attn + "q_proj.bias", *_reshape(N, H))
        yield Entry(("layers", "attn", "b_k_kh"), attn + "k_proj.bias", *_reshape(K, H))
        yield Entry(("layers", "attn", "b_v_kh"), attn + "v_proj.bias", *_reshape(K, H))
    if c.o_bias:
        yield Entry(("layers", "attn", "b_o_d"), attn + "o_proj.bias", _same, _same)
    if c.qk_norm:
        yield Entry(("layers", "attn", "q_norm_h"), attn + "q_norm.weight", _same, _same)
        yield Entry(("layers", "attn", "k_norm_h"), attn + "k_norm.weight", _same, _same)
    transpose = (lambda w: w.T), (lambda w: w.T)
    if c.moe is not None:
        yield from _moe_entries(c, layer, transpose)
    else:
        yield from _mlp_entries(c, mlp, transpose)
    yield Entry(("final_norm_d",), prefix + "norm.weight", _same, _same)
    if c.head == "causal_lm" and not c.tie_word_embeddings:
        yield Entry(("lm_head_dv",), "lm_head.weight", *transpose)
    if c.head != "causal_lm":
        yield Entry(("score", "w_dc"), "score.weight", *transpose)
        if c.score_bias:
            yield Entry(("score", "b_c"), "score.bias", _same, _same)


# HF's per-expert tensor names (as checkpoints store them): (router, gate, up, down)
_MOE_NAMES = {
    "qwen2_moe": ("mlp.gate.weight", "mlp.experts.{j}.gate_proj.weight",
                  "mlp.experts.{j}.up_proj.weight", "mlp.experts.{j}.down_proj.weight"),
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{j}.gate_proj.weight",
                  "mlp.experts.{j}.up_proj.weight", "mlp.experts.{j}.down_proj.weight"),
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.w1.weight",
                "block_sparse_moe.experts.{j}.w3.weight", "block_sparse_moe.experts.{j}.w2.weight"),
}  # fmt: skip


def _moe_entries(c: DecoderConfig, layer: str, transpose) -> Iterator[Entry]:
    router, gate, up, down = (layer + n for n in _MOE_NAMES[c.model_type])
    yield Entry(("layers", "moe", "router_de"), router, *transpose)
    yield Entry(("layers", "moe", "w_gate_edf"), gate, *transpose)
    yield Entry(("layers", "moe", "w_up_edf"), up, *transpose)
    yield Entry(("layers", "moe", "w_down_efd"), down, *transpose)
    if c.shared_expert_intermediate_size:
        shared = layer + "mlp.shared_expert."
        for jax_name, hf_name in (("w_gate_df", "gate_proj"), ("w_up_df", "up_proj"),
                                  ("w_down_fd", "down_proj")):  # fmt: skip
            yield Entry(("layers", "moe", "shared", jax_name), f"{shared}{hf_name}.weight",
                        *transpose)  # fmt: skip
        yield Entry(("layers", "moe", "shared_gate_d"), layer + "mlp.shared_expert_gate.weight",
                    lambda w: w.reshape(-1), lambda w: w.reshape(1, -1))  # fmt: skip


def _mlp_entries(c: DecoderConfig, mlp: str, transpose) -> Iterator[Entry]:
    yield Entry(("layers", "mlp", "w_gate_df"), mlp + "gate_proj.weight", *transpose)
    yield Entry(("layers", "mlp", "w_up_df"), mlp + "up_proj.weight", *transpose)
    yield Entry(("layers", "mlp", "w_down_fd"), mlp + "down_proj.weight", *transpose)
    if c.mlp_bias:
        yield Entry(("layers", "mlp", "b_gate_f"), mlp + "gate_proj.bias", _same, _same)
        yield Entry(("layers", "mlp", "b_up_f"), mlp + "up_proj.bias", _same, _same)
        yield Entry(("layers", "mlp", "b_down_d"), mlp + "down_proj.bias", _same, _same)


def hf_names(entry: Entry, num_layers: int, num_experts: int = 0) -> list[str]:
    """The HF tensor names of an entry (one per layer when stacked; per layer and expert,
    layer-major, for experts)."""
    if entry.per_expert:
        return [entry.hf_name.format(i=i, j=j) for i in range(num_layers)
                for j in range(num_experts)]  # fmt: skip
    if entry.stacked:
        return [entry.hf_name.format(i=i) for i in range(num_layers)]
    return [entry.hf_name]


def num_experts(config: DecoderConfig) -> int:
    return config.moe.num_experts if config.moe is not None else 0


# Tensors some checkpoints carry that jaxrl recomputes or does not use.
IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)
