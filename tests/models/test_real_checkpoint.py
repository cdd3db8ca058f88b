"""A real checkpoint: SmolLM2-135M-Instruct (llama, GQA 9/3, tied), logits equal to transformers.

Logits within `COMPOSITE_RTOL` of their scale over the real tokens (30 layers of composite
float32 ops in another framework)."""

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
