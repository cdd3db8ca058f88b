"""Chat templates, truncation modes, left padding; verl's `postprocess_data` as the reference."""

import numpy as np
import pytest

from jaxrl.data import DataError, encode_prompts, left_pad, truncate
from jaxrl.data.templates import render_prompt, set_chat_template
from jaxrl.testing import import_reference

MESSAGES = [{"role": "user", "content": "copy: 3 1 4"}]


def test_chat_template_with_generation_prompt(tokenizer):
    ids = encode_prompts(tokenizer, [MESSAGES])[0]
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "<|im_start|>", "user", "copy", ":", "3", "1", "4", "<|im_end|>",
        "<|im_start|>", "assistant",
    ]  # fmt: skip
    # The same ids as HF's own tokenizing apply_chat_template.
    hf = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert ids == list(hf["input_ids"] if hasattr(hf, "keys") else hf)


def test_template_kwargs_and_custom_template(tokenizer_dir):
    from jaxrl.data import load_tokenizer

    template = (
        "{% if greet %}copy{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>{% endif %}"
    )
    tok = load_tokenizer(str(tokenizer_dir), custom_chat_template=template)
    # tokenize/return_dict in the kwargs are ignored: jaxrl decides those.
    text = render_prompt(tok, MESSAGES, {"greet": True, "tokenize": True})
    assert text == "copycopy: 3 1 4<|im_start|>"
    assert render_prompt(tok, MESSAGES, {}) == "copy: 3 1 4<|im_start|>"
    path = tokenizer_dir / "custom.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    set_chat_template(tok, str(path))
    assert render_prompt(tok, MESSAGES) == "copy: 3 1 4"


def test_word_level_tokenizer_next_to_qwen2_config(tmp_path):
    """Regression: next to a qwen2 config.json, transformers 5's AutoTokenizer loads the
    synthetic word-level tokenizer as a byte-level BPE Qwen2Tokenizer that drops words."""
    import transformers

    from jaxrl.data import load_tokenizer, synthetic

    synthetic.write_tokenizer(tmp_path)
    transformers.Qwen2Config(vocab_size=64).save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    text = "repeat: 7 3 1"
    assert tok.tokenize(text) == ["repeat", ":", "7", "3", "1"]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids).split() == ["repeat", ":", "7", "3", "1"]
    assert tok.pad_token == "<pad>" and tok.eos_token == "<|im_end|>"
    assert tok.chat_template == synthetic.CHATML_TEMPLATE


def test_smollm2_chatml_template():
    """The real SmolLM2 tokenizer (cached by jaxrl.testing.assets): verl's ChatML prompt."""
    from jaxrl.data import load_tokenizer
    from jaxrl.testing.assets import smollm2_135m_instruct

    tok = load_tokenizer(str(smollm2_135m_instruct()))
    ids = encode_prompts(tok, [MESSAGES])[0]
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\ncopy: 3 1 4<|im_end|>\n" in text


def _verl_postprocess(ids, max_length, truncation):
    import torch

    torch_functional = import_reference("verl.utils.torch_functional")

    t = torch.tensor([ids])
    out, mask = torch_functional.postprocess_data(
        t, torch.ones_like(t), max_length, pad_token_id=0, left_pad=True, truncation=truncation
    )
    return out[0].tolist(), mask[0].tolist()


@pytest.mark.parametrize("truncation", ["left", "right", "middle"])
@pytest.mark.parametrize("length", [3, 7, 8, 9, 12])
def test_truncation_modes_match_verl(truncation, length):
    ids = list(range(1, length + 1))
    max_length = 8
    ours = truncate(ids, max_length, truncation)
    ours_ids, ours_mask = left_pad([ours], max_length, pad_token_id=0)
    ref_ids, ref_mask = _verl_postprocess(ids, max_length, truncation)
    assert ours_ids[0].tolist() == ref_ids and ours_mask[0].tolist() == ref_mask
    expected = {
        "left": ids[-8:],
        "right": ids[:8],
        "middle": ids[:4] + ids[-4:],
    }[truncation]
    assert ours == (ids if length <= 8 else expected)


def test_truncation_error_names_row_and_fixes():
    assert truncate([1, 2, 3], 3, "error") == [1, 2, 3]
    with pytest.raises(DataError) as e:
        truncate([1, 2, 3, 4], 3, "error", where="f.parquet: row 5")
    msg = str(e.value)
    assert msg.startswith("f.parquet: row 5: the templated prompt has 4 tokens")
    assert "data.filter_overlong_prompts=true" in msg and "data.truncation" in msg
    with pytest.raises(ValueError, match="not one of"):
        truncate([1], 3, "center")


def test_left_pad():
    ids, mask = left_pad([[5, 6], [7], []], 3, pad_token_id=0)
    np.testing.assert_array_equal(ids, [[0, 5, 6], [0, 0, 7], [0, 0, 0]])
    np.testing.assert_array_equal(mask, [[0, 1, 1], [0, 0, 1], [0, 0, 0]])
    assert ids.dtype == mask.dtype == np.int32
