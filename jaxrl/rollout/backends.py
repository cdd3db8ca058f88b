"""Decode backends: how the rollout's decode step runs (`rollout.decode_backend`).

    backend = choose_backend("auto", config, layout)    # or "xla", "cpu_kernels"
    prepared = backend.prepare(config, params)          # inside the generation program
    logits_bv, cache, routes_blk = backend.step(config, params, prepared, tokens_b,
                                                positions_b, cache, write_index_b, live, block)

`routes_blk`: a mixture of experts' chosen experts of each row's token in each layer (the
XLA step; the CPU kernels run dense models only), else None.

- `xla`: the model's own decode step (`jaxrl.models.cached.decode_step`: the layer scanned
  over the stacked parameters as they are, no copy) and its LM head. Every platform.
- `cpu_kernels`: the C++ CPU kernels of `jaxrl.kernels.cpu_decode`: each layer one kernel
  call, the LM head one, reading the weights as panels of 16 output rows that `prepare` cuts
  once per generation call (a second copy of the weights for the call: the price of ~2x the
  XLA step's speed on a CPU). float32 on one CPU device, head_dim a multiple of 16, dense
  llama-style layers only (not MoE, not Gemma: `_layers_unsupported`). LoRA adapters are
  merged into the weights as the panels are cut.
- `auto`: `cpu_kernels` where it applies, its library builds and the CPU has AVX-512 (with
  AVX2 alone its registers spill and XLA is ~4x faster: `cpu_decode.vectors_fit`), else `xla`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxrl.config.checks import DECODE_BACKENDS
from jaxrl.kernels import NO_WINDOW, cpu_decode
from jaxrl.models import lora
from jaxrl.models.cached import KVCache, decode_step, embed
from jaxrl.models.config import DecoderConfig
from jaxrl.models.rope import rope_cos_sin
from jaxrl.models.transformer import final_softcap, lm_logits, rms_norm
from jaxrl.sharding.layouts import Layout, shard


@dataclasses.dataclass(frozen=True)
class XlaBackend:
    """The model's decode step and LM head, compiled by XLA for any platform."""

    name: str = "xla"

    def prepare(self, config: DecoderConfig, params: Any) -> None:
        return None

    def step(
        self,
        config: DecoderConfig,
        params: Any,
        prepared: None,
        tokens: Int[Array, " b"],
        positions: Int[Array, " b"],
        cache: KVCache,
        write_index: Int[Array, " b"],
        live: Int[Array, ""],
        block: int,
    ) -> tuple[Float[Array, "b v"], KVCache, Int[Array, "b l k"] | None]:
        """Next-token logits [B, V] after each row's token, the updated cache and the routes.

        With tied embeddings the head is the embedding table [V, D], and the logits are
        taken as E h^T [V, B], the table as the matmul's row-major left operand; h E^T (its
        contracting dimension last) ran 3x slower on XLA's CPU kernels. The barrier keeps
        XLA from folding the transpose back into the product. Gemma's final soft-cap
        (`final_softcap`) applies on either path."""
        h, cache, routes = decode_step(config, params, tokens, positions, cache, write_index,
                                       live, block)  # fmt: skip
        if not config.tie_word_embeddings:
            return lm_logits(config, params, h[:, None])[:, 0], cache, routes
        table_vd = params["embed"]["tokens_vd"].astype(h.dtype)
        logits_vb = jax.lax.optimization_barrier(jnp.matmul(table_vd, h.T))
        logits_bv = final_softcap(config, shard(logits_vb.T, ("batch", "vocab")))
        return logits_bv, cache, routes


# weight, its bias (parameter names) -> the layer kernel's panels of the weight, bias there
_KERNEL_PROJECTIONS = {
    ("w_q_dnh", "b_q_nh"): ("w_q_p", "b_q_e"),
    ("w_k_dkh", "b_k_kh"): ("w_k_p", "b_k_e"),
    ("w_v_dkh", "b_v_kh"): ("w_v_p", "b_v_e"),
    ("w_o_nhd", "b_o_d"): ("w_o_p", "b_o_d"),
    ("w_gate_df", "b_gate_f"): ("w_gate_p", "b_gate_f"),
    ("w_up_df", "b_up_f"): ("w_up_p", "b_up_f"),
    ("w_down_fd", "b_down_d"): ("w_down_p", "b_down_d"),
}


@dataclasses.dataclass(frozen=True)
class CpuKernelsBackend:
    """The decode step as the C++ CPU kernels (`jaxrl.kernels.cpu_decode`).

    A decode step multiplies a handful of rows by every weight, so it is bound by streaming
    the weights; the kernels carry the activations column-major, x [D, B], and read each
    weight [out, in] as panels of 16 output rows (`cpu_decode.panels`), one contiguous
    stream per panel. `prepare` cuts the panels (stacked over the layers, as the parameters
    are: the kernel takes the layer's index) and the LM head's, behind a barrier that keeps
    XLA from folding the re-layout back into the decode loop.
    """

    name: str = "cpu_kernels"

    def prepare(self, config: DecoderConfig, params: Any) -> dict[str, Any]:
        if why := _layers_unsupported(config):
            raise ValueError(
                f"the CPU decode kernels cannot run this {config.model_type} model: {why}; "
                "decode with actor_rollout_ref.rollout.decode_backend=xla"
            )
        n_layers, f32 = config.num_layers, jnp.float32
        if lora.has_adapters(params):  # LoRA: the panels are cut from W + (alpha/r)·A B
            params = lora.fold(config, params)
        stacked = params["layers"]
        tree = {**stacked["attn"], **stacked["mlp"]}
        out = {"ln_attn_d": stacked["ln_attn_d"], "ln_mlp_d": stacked["ln_mlp_d"]}
        for (name, param_bias), (panels, bias) in _KERNEL_PROJECTIONS.items():
            w = tree[name]
            # [L, in, out] (the input axes of w_o_nhd are N, H; of the others, axis 1)
            w_lio = (
                w.reshape(n_layers, -1, w.shape[-1])
                if name == "w_o_nhd"
                else w.reshape(n_layers, w.shape[1], -1)
            )
            out[panels] = cpu_decode.panels(w_lio, in_major=True)
            if param_bias in tree:
                out[bias] = tree[param_bias].reshape(n_layers, -1)
            else:
                out[bias] = jnp.zeros((n_layers, w_lio.shape[2]), f32)
        for name in ("q_norm_h", "k_norm_h"):  # ones where absent (the kernel skips them)
            out[name] = tree[name] if name in tree else jnp.ones((n_layers, config.head_dim), f32)
        layers = {name: out[name].astype(f32) for name in cpu_decode.LAYER_WEIGHTS}
        if config.tie_word_embeddings:
            head = cpu_decode.panels(params["embed"]["tokens_vd"], in_major=False)
        else:
            head = cpu_decode.panels(params["lm_head_dv"], in_major=True)
        return jax.lax.optimization_barrier({"layers": layers, "head": head})

    def step(
        self,
        config: DecoderConfig,
        params: Any,
        prepared: dict[str, Any],
        tokens: Int[Array, " b"],
        positions: Int[Array, " b"],
        cache: KVCache,
        write_index: Int[Array, " b"],
        live: Int[Array, ""],
        block: int,
    ) -> tuple[Float[Array, "b v"], KVCache, None]:
        """`XlaBackend.step`'s result through the kernels (each row reads its own prefix, so
        `live` and `block` are not needed)."""
        # Materialised once per step (left to fusion, XLA recomputes them per element).
        cos, sin = jax.lax.optimization_barrier(
            rope_cos_sin(config.rope, config.head_dim, positions[:, None])
        )
        cos, sin = cos[:, 0], sin[:, 0]
        segments = cache.mark_written(write_index[:, None]).segments
        x_db = embed(config, params, tokens).T
        k, v = cache.k, cache.v
        windows = config.window_per_layer
        for i in range(config.num_layers):  # one kernel call per layer, in place on k, v
            x_db, k, v = cpu_decode.layer(
                prepared["layers"],
                i,
                x_db,
                cos,
                sin,
                write_index,
                segments,
                k,
                v,
                eps=config.rms_norm_eps,
                window=0 if windows[i] >= NO_WINDOW else windows[i],
                qk_norm=config.qk_norm,
            )
        h_db = rms_norm(x_db, params["final_norm_d"], config.rms_norm_eps, axis=0)
        logits_vb = cpu_decode.matmul(prepared["head"], h_db, config.vocab_size)
        # The barrier keeps XLA from folding the transpose into the kernel's output.
        logits_vb = jax.lax.optimization_barrier(logits_vb)
        cache = KVCache(k=k, v=v, segments=segments)
        return shard(logits_vb.T, ("batch", "vocab")), cache, None


DecodeBackend = XlaBackend | CpuKernelsBackend


def choose_backend(name: str, config: DecoderConfig, layout: Layout | None) -> DecodeBackend:
    """The backend `rollout.decode_backend` names for this model and layout ("auto": the CPU
    kernels where they apply and the CPU has AVX-512, else XLA).

    Raises:
        ValueError: for an unknown name, or `cpu_kernels` where they cannot run (naming why).
    """
    if name not in DECODE_BACKENDS:
        raise ValueError(
            f"actor_rollout_ref.rollout.decode_backend={name!r}: must be one of {DECODE_BACKENDS}"
        )
    if name == "xla":
        return XlaBackend()
    why = _kernels_unavailable(config, layout)
    if name == "auto":
        return XlaBackend() if why or not cpu_decode.vectors_fit() else CpuKernelsBackend()
    if why:
        raise ValueError(
            f"actor_rollout_ref.rollout.decode_backend=cpu_kernels cannot run here: {why}; "
            "use actor_rollout_ref.rollout.decode_backend=xla (or auto)"
        )
    return CpuKernelsBackend()


def _layers_unsupported(config: DecoderConfig) -> str | None:
    """Why the CPU kernels' layer (llama-style: pre-norm x w RMSNorms, SwiGLU, scores scaled
    by 1/sqrt(H) and uncapped, one RoPE, an unscaled embedding and uncapped logits) is not
    this model's, or None."""
    c = config
    if c.moe is not None:
        return "the model is a mixture of experts (the kernels run dense SwiGLU layers)"
    gemma = {
        "(1 + w) RMSNorms": c.norm_unit_offset,
        "post-attention and post-MLP norms": c.post_norms,
        f"a {c.mlp_activation} MLP": c.mlp_activation != "silu",
        "sqrt(D)-scaled embeddings": c.scale_embeddings,
        "a query_pre_attn_scalar score scale": c.query_pre_attn_scalar is not None,
        "attention logit soft-capping": c.attn_logit_softcap is not None,
        "final logit soft-capping": c.final_logit_softcap is not None,
        "a second RoPE for its sliding-window layers": c.rope_local is not None,
    }
    found = [name for name, present in gemma.items() if present]
    if found:
        return f"the model has {', '.join(found)} (the kernels run llama-style layers)"
    return None


def _kernels_unavailable(config: DecoderConfig, layout: Layout | None) -> str | None:
    """Why the CPU kernels cannot decode this model on this layout, or None."""
    if why := _layers_unsupported(config):
        return why
    if not cpu_decode.supports(config.head_dim):
        return f"head_dim={config.head_dim} is not a multiple of 16 up to 1024"
    if not cpu_decode.enabled(config.compute_dtype, layout):
        return (
            "they need float32 compute (rollout.dtype) on one CPU device, a C++ compiler, "
            "and JAXRL_CPU_KERNELS unset or 1"
        )
    return None
