"""Real checkpoints: SmolLM2-135M-Instruct (llama, GQA 9/3, tied) and Gemma-3-270m
(gemma3_text), logits equal to transformers'.

Logits within `COMPOSITE_RTOL` of their scale over the real tokens (30 / 18 layers of
composite float32 ops in another framework; Gemma measured 2.6e-6, a 38x margin). Each
checkpoint is converted on first use (`jaxrl.testing.assets`: SmolLM2 ~30 s, Gemma ~100 s),
hence `slow`."""

import numpy as np
import pytest

import jaxrl.models as M
from jaxrl.testing.assets import smollm2_135m_instruct
from jaxrl.testing.hf_reference import hf_run
from jaxrl.testing.numerics import assert_close_to_scale

PROMPTS = [
    [{"role": "user", "content": "What is 12 + 30?"}],
    [
        {
            "role": "user",
            "content": "A farmer has 3 fields with 14 rows of 9 plants each. How many plants "
            "does the farmer have in total? Answer with a number.",
        }
    ],
]


@pytest.mark.slow
def test_smollm2_logits_match_transformers():
    from transformers import AutoTokenizer

    folder = smollm2_135m_instruct()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.padding_side = "left"
    texts = [
        tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        for m in PROMPTS
    ]
    enc = tokenizer(texts, return_tensors="np", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert (mask == 0).any()  # the batch really is left-padded
    config, params = M.from_pretrained(folder)
    assert (config.model_type, config.num_layers, config.num_heads, config.num_kv_heads) == (
        "llama",
        30,
        9,
        3,
    )
    ours = np.asarray(M.forward(config, params, ids, mask))
    ref = hf_run(folder, ids, mask)
    assert_close_to_scale(ours, ref, mask > 0)
    np.testing.assert_array_equal(ours[:, -1].argmax(-1), ref[:, -1].argmax(-1))


GEMMA_PROMPTS = ["The capital of France is", "Water boils at a temperature of"]


@pytest.mark.slow
def test_gemma3_270m_decodes_and_scores_as_transformers():
    """Gemma-3-270m (gemma3_text: 18 layers, 5 of 6 with a 512-token window and the local
    RoPE, q/k norms, head_dim 256, tied 262k vocabulary): jaxrl's greedy continuation of each
    prompt (left-padded into one batch, prefill + cached decode) is transformers' (eager,
    one unpadded prompt at a time), and the logits of prompt + continuation are within
    `COMPOSITE_RTOL` of their scale over the real tokens (18 layers of composite float32 ops
    in another framework)."""
    import torch
    from transformers import AutoTokenizer

    from jaxrl.rollout import SamplingParams, generate
    from jaxrl.testing.assets import gemma3_270m
    from jaxrl.testing.hf_reference import hf_model

    folder = gemma3_270m()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.padding_side = "left"
    config, params = M.from_pretrained(folder)
    assert (config.model_type, config.num_layers, config.head_dim) == ("gemma3_text", 18, 256)
    assert config.rope_local is not None and config.sliding_windows[:6] == (512,) * 5 + (None,)
    n = 6
    model = hf_model(folder)
    want = []
    for text in GEMMA_PROMPTS:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        want.append(out[0, ids.shape[1] :].numpy())
    enc = tokenizer(GEMMA_PROMPTS, return_tensors="np", padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert (mask == 0).any()  # the batch really is left-padded
    greedy = SamplingParams(temperature=0.0, do_sample=False, max_tokens=n, ignore_eos=True)
    got = np.asarray(generate(config, params, ids, mask, greedy).responses)
    np.testing.assert_array_equal(got, np.stack(want))
    full, full_mask = np.concatenate([ids, got], 1), np.concatenate([mask, np.ones_like(got)], 1)
    assert_close_to_scale(M.forward(config, params, full, full_mask),
                          hf_run(folder, full, full_mask), full_mask > 0)  # fmt: skip
