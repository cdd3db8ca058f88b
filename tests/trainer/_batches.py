"""A host RL batch for the learner tests."""

import numpy as np


def rl_batch(n=8, p=6, r=20, seed=0, vocab=90):
    """Responses of up to 12 tokens in 20 columns: micro-batches are trimmed (to 8 or 12)."""
    rng = np.random.RandomState(seed)
    p_len = rng.randint(1, p + 1, n)
    r_len = rng.randint(1, 13, n)
    r_len[0] = 0  # an empty response
    prompt_mask = (np.arange(p)[None] >= (p - p_len)[:, None]).astype(np.int32)
    response_mask = (np.arange(r)[None] < r_len[:, None]).astype(np.int32)
    return {
        "prompts": rng.randint(2, vocab, (n, p)).astype(np.int32) * prompt_mask,
        "prompt_mask": prompt_mask,
        "responses": rng.randint(2, vocab, (n, r)).astype(np.int32) * response_mask,
        "response_mask": response_mask,
        "old_log_probs": (rng.randn(n, r) * 0.1 - 4.0).astype(np.float32),
        "advantages": rng.randn(n, r).astype(np.float32),
        "ref_log_probs": (rng.randn(n, r) * 0.1 - 4.0).astype(np.float32),
    }
