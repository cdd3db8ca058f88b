"""What the serving tests share: the scripted policy's engine (`policy` is conftest's)."""

from jaxrl.rollout.engine import RolloutEngine


def make_engine(policy, slots=4, max_model_len=96):
    """A `RolloutEngine` of the scripted policy, its weights loaded."""
    tokenizer, config, params = policy
    engine = RolloutEngine(config, None, max_num_seqs=slots, max_model_len=max_model_len,
                           tokenizer=tokenizer)  # fmt: skip
    engine.load_weights(params)
    return engine
