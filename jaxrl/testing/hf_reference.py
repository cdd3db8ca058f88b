"""Running `transformers` models as the reference in equivalence tests (compared with
`jaxrl.testing.numerics.assert_close_to_scale`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Families whose reference runs HF's eager attention: Gemma 2's score soft-cap exists only
# there (sdpa has none), and Gemma 3 is held to the same reference.
EAGER_MODEL_TYPES = ("gemma2", "gemma3_text")


def hf_model(folder: str | Path, head: str = "causal_lm"):
    """A fresh float32 HF model (dynamic-NTK rope keeps state across calls, so never reuse);
    eager attention for `EAGER_MODEL_TYPES`."""
    import json

    import torch
    import transformers

    cls = {
        "causal_lm": transformers.AutoModelForCausalLM,
        "token_classification": transformers.AutoModelForTokenClassification,
        "sequence_classification": transformers.AutoModelForSequenceClassification,
    }[head]
    model_type = json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    extra = {"attn_implementation": "eager"} if model_type in EAGER_MODEL_TYPES else {}
    return cls.from_pretrained(str(folder), dtype=torch.float32, **extra).eval()


def hf_run(folder, ids: np.ndarray, mask: np.ndarray, head: str = "causal_lm") -> np.ndarray:
    """HF outputs with verl's positions (`cumsum(mask) - 1`, clipped at 0)."""
    import torch

    pos = np.clip(mask.cumsum(-1) - 1, 0, None)
    with torch.no_grad():
        out = hf_model(folder, head)(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(pos),
        )
    return out.logits.float().numpy()


def random_batch(b: int, t: int, vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [B, T] in [2, vocab) and lengths [B] from T down (all rows different)."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(2, vocab, (b, t))
    lengths = np.maximum(t - np.arange(b) * (t // (b + 1) + 1), 1)
    return ids, lengths


def right_padded(ids: np.ndarray, lengths: np.ndarray, pad_id: int = 0):
    """(ids, mask) with each row's tokens first and `pad_id` after."""
    t = ids.shape[1]
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.int64)
    return np.where(mask, ids, pad_id), mask


def left_padded(ids: np.ndarray, lengths: np.ndarray, pad_id: int = 0):
    """(ids, mask) with `pad_id` first and each row's tokens last (verl's prompt layout)."""
    t = ids.shape[1]
    mask = (np.arange(t)[None] >= (t - lengths)[:, None]).astype(np.int64)
    return np.where(mask, ids, pad_id), mask
