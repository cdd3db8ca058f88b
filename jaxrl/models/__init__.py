"""HuggingFace causal LMs (llama, qwen2, qwen3, mistral) as pure JAX functions.

    config, params = jaxrl.models.from_pretrained("path/to/hf_folder", dtype="float32")
    logits_btv = jaxrl.models.forward(config, params, input_ids_bt, attention_mask_bt)
    jaxrl.models.save_pretrained(config, params, "out_folder", tokenizer)

The same decoder serves the actor, the reference, the critic (token-classification head) and a
reward model (sequence-classification head).
"""

from jaxrl.models.config import DecoderConfig, RopeConfig, from_hf_config
from jaxrl.models.hf_io import (
    CheckpointError,
    checkpoint_problems,
    from_pretrained,
    load_config,
    save_pretrained,
    to_hf_config,
)
from jaxrl.models.outputs import (
    entropy_from_logits,
    last_token_index,
    log_probs_from_logits,
    sequence_scores,
    sum_pi_squared_from_logits,
    token_log_probs,
    token_statistics,
    values,
)
from jaxrl.models.params import (
    abstract_params,
    init_params,
    logical_axes,
    param_shapes,
    param_shardings,
)
from jaxrl.models.transformer import (
    forward,
    hidden_states,
    lm_logits,
    positions_from_mask,
    positions_from_segments,
    score_head,
)

__all__ = [
    "CheckpointError",
    "DecoderConfig",
    "RopeConfig",
    "abstract_params",
    "checkpoint_problems",
    "entropy_from_logits",
    "forward",
    "from_hf_config",
    "from_pretrained",
    "hidden_states",
    "init_params",
    "last_token_index",
    "lm_logits",
    "load_config",
    "log_probs_from_logits",
    "logical_axes",
    "param_shapes",
    "param_shardings",
    "positions_from_mask",
    "positions_from_segments",
    "save_pretrained",
    "score_head",
    "sequence_scores",
    "sum_pi_squared_from_logits",
    "to_hf_config",
    "token_log_probs",
    "token_statistics",
    "values",
]
