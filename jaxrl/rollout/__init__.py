"""The rollout: jitted KV-cache generation with verl's sampling parameters, and the engine
object that holds the rollout's weights and its multi-turn conversations.

    out = jaxrl.rollout.generate(model_config, params, input_ids, attention_mask,
                                 jaxrl.rollout.SamplingParams(max_tokens=128, n=4), rng)
    engine = jaxrl.rollout.RolloutEngine(model_config, layout, max_num_seqs=64)
"""

from jaxrl.rollout.engine import Conversation, RolloutEngine, Turn
from jaxrl.rollout.generation import (
    GenerationOutput,
    compile_generate,
    generate,
    idle_fraction,
)
from jaxrl.rollout.sampling import SamplingParams, processed_logits, sample

__all__ = [
    "Conversation",
    "GenerationOutput",
    "RolloutEngine",
    "SamplingParams",
    "Turn",
    "compile_generate",
    "generate",
    "idle_fraction",
    "processed_logits",
    "sample",
]
