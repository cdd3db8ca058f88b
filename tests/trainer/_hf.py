"""The HF torch model's view of a trainer step's rows, for comparisons with jaxrl's passes."""

import numpy as np


def hf_response_logits(folder, host) -> np.ndarray:
    """float32 logits [N, R, V] of the HF torch causal LM in `folder` at the positions that
    predict each response token of the batch `host` (left-padded prompts, right-padded
    responses, positions counted over the real tokens)."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    ids = np.concatenate([host["prompts"], host["responses"]], axis=1)
    attention = np.concatenate([host["prompt_mask"], host["response_mask"]], axis=1)
    positions = np.clip(np.cumsum(attention, axis=1) - 1, 0, None)
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(attention),
                    position_ids=torch.tensor(positions)).logits  # fmt: skip
    p, r = host["prompts"].shape[1], host["responses"].shape[1]
    return logits[:, p - 1 : p - 1 + r].float().numpy()  # position t predicts response token t
