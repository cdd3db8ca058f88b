"""The rollout engine: jitted KV-cache generation with verl's sampling parameters.

out = jaxrl.rollout.generate(model_config, params, input_ids, attention_mask,
                             jaxrl.rollout.SamplingParams(max_tokens=128, n=4), rng)
"""

from jaxrl.rollout.engine import (
    GenerationOutput,
    compile_generate,
    generate,
    idle_fraction,
)
from jaxrl.rollout.sampling import SamplingParams, processed_logits, sample

__all__ = [
    "GenerationOutput",
    "SamplingParams",
    "compile_generate",
    "generate",
    "idle_fraction",
    "processed_logits",
    "sample",
]
