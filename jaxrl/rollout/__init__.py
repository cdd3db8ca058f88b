"""The rollout: jitted KV-cache generation with verl's sampling parameters, and the engine
object that holds the rollout's weights and its multi-turn conversations.

    out = jaxrl.rollout.generate(model_config, params, input_ids, attention_mask,
                                 jaxrl.rollout.SamplingParams(max_tokens=128, n=4), rng)
    engine = jaxrl.rollout.RolloutEngine(model_config, layout, max_num_seqs=64)
    scheduler = jaxrl.rollout.Scheduler(engine)     # requests, each with its own settings
"""

from jaxrl.rollout.engine import RolloutEngine
from jaxrl.rollout.generation import (
    GenerationOutput,
    compile_generate,
    generate,
    idle_fraction,
)
from jaxrl.rollout.sampling import (
    RowSampling,
    SamplingParams,
    processed_logits,
    processed_rows,
    sample,
    sample_rows,
)
from jaxrl.rollout.scheduler import BatchOutput, Handle, Scheduler
from jaxrl.rollout.slots import Conversation, ConversationSlots, Turn

__all__ = [
    "BatchOutput",
    "Conversation",
    "ConversationSlots",
    "GenerationOutput",
    "Handle",
    "RolloutEngine",
    "RowSampling",
    "SamplingParams",
    "Scheduler",
    "Turn",
    "compile_generate",
    "generate",
    "idle_fraction",
    "processed_logits",
    "processed_rows",
    "sample",
    "sample_rows",
]
