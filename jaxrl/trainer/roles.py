"""The models of an RL run on the mesh: actor, reference, critic, each in its dtypes.

- actor: the policy, `model_dtype` master weights (fp32) and `dtype` compute (bf16), trained;
- reference: a frozen copy of the initial policy in its own dtypes (KL loss / KL in reward);
- critic: the policy's checkpoint (or `critic.model.path`) with a 1-label token-classification
  head in place of the LM head, as verl builds it (`AutoModelForTokenClassification` from a
  causal LM: a fresh head, normal(0, initializer_range)).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.models.config import DecoderConfig
from jaxrl.models.hf_io import from_pretrained, load_config
from jaxrl.models.params import abstract_params, param_shardings
from jaxrl.sharding.layouts import Layout, placed_abstract, use_layout
from jaxrl.trainer.sequences import response_log_probs, response_values

DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}


def dtype_name(value: str, key: str) -> str:
    if value not in DTYPES:
        raise ValueError(f"{key}={value!r}: use one of {sorted(DTYPES)}")
    return DTYPES[value]


def load_model(
    path: str,
    *,
    param_dtype: str,
    compute_dtype: str,
    layout: Layout | None,
    remat: str = "none",
    override_config: dict | None = None,
    attention_impl: str = "auto",
    abstract: bool = False,
) -> tuple[DecoderConfig, Any]:
    """An HF causal LM as (config, params) in `layout`, with separate parameter and compute
    dtypes and the attention implementation the forward passes use. `abstract`: only
    `config.json` is read and the parameters are `jax.ShapeDtypeStruct`s in their shardings,
    nothing loaded or allocated (for compiling programs without running them,
    `PPOTrainer(abstract=True)`)."""
    options = dict(remat=remat, override_config=override_config or None)
    if not abstract:
        config, params = from_pretrained(path, dtype=param_dtype, layout=layout, **options)
    else:
        config = load_config(path, param_dtype=param_dtype, **options)
        params = abstract_params(config)
        if layout is not None:
            params = placed_abstract(params, param_shardings(config, layout))
    return config.replace(dtype=compute_dtype, attention_impl=attention_impl), params


def is_abstract(tree: Any) -> bool:
    """Whether a parameter tree holds `jax.ShapeDtypeStruct`s (an abstract model)."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def _initializer_range(path: str) -> float:
    config = json.loads((Path(path).expanduser() / "config.json").read_text())
    return float(config.get("initializer_range", 0.02))


def critic_from_policy(
    path: str, config: DecoderConfig, params: Any, layout: Layout | None, seed: int = 0
) -> tuple[DecoderConfig, Any]:
    """A value model from a causal LM: the LM head is dropped and a 1-label token head is
    added, weights normal(0, initializer_range) and bias 0 (HF's token-classification init)."""
    if config.head != "causal_lm":
        return config, params
    critic = config.replace(head="token_classification", num_labels=1, score_bias=True)
    std = _initializer_range(path)
    abstract = is_abstract(params)
    params = {k: v for k, v in params.items() if k != "lm_head_dv"}
    dtype = jnp.dtype(config.param_dtype)
    shardings = param_shardings(critic, layout)["score"] if layout is not None else None
    if abstract:
        score = abstract_params(critic)["score"]
        if shardings is not None:
            score = placed_abstract(score, shardings)
        return critic, {**params, "score": score}
    w = std * jax.random.normal(jax.random.key(seed), (config.hidden_size, 1), jnp.float32)
    score = {"w_dc": w.astype(dtype), "b_c": jnp.zeros((1,), dtype)}
    if shardings is not None:
        score = jax.device_put(score, shardings)
    return critic, {**params, "score": score}


def log_prob_fn(
    config: DecoderConfig,
    layout: Layout | None,
    *,
    temperature: float,
    chunk_size: int | None,
    with_entropy: bool = False,
):
    """jit of `(params, micro_batch) -> log-probs [m, r]` (and entropy when asked)."""

    def fn(params, mb):
        with use_layout(layout):
            lp, entropy = response_log_probs(
                config,
                params,
                mb,
                temperature=temperature,
                chunk_size=chunk_size,
                with_entropy=with_entropy,
            )
        return (lp, entropy) if with_entropy else lp

    return jax.jit(fn)


def values_fn(config: DecoderConfig, layout: Layout | None):
    """jit of `(params, micro_batch) -> values [m, r]`."""

    def fn(params, mb):
        with use_layout(layout):
            return response_values(config, params, mb)

    return jax.jit(fn)
