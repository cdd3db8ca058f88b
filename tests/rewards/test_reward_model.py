"""The reward-model role equals `transformers`' sequence classification (float32, 1e-4 of
scale), with the actor's tokens as they are, re-templated for a different tokenizer, and on a
sharded mesh.

Two tiny character-level tokenizers with different vocabularies and chat templates stand in
for an actor and a reward model from different families (no hub access needed).
"""

import dataclasses

import numpy as np
import pytest
import torch

from jaxrl.config.mesh import TRAIN_RULES
from jaxrl.config.schema import RewardModelConfig, RewardModelPathConfig
from jaxrl.rewards.reward_model import RewardModel
from jaxrl.sharding.layouts import Layout, train_mesh
from jaxrl.testing.hf_reference import hf_model
from jaxrl.testing.numerics import assert_close_to_scale
from jaxrl.testing.tiny import save_tiny

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
INST = "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}</s>{% endfor %}"  # noqa: E501
PROMPTS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color"}],
    [{"role": "user", "content": "Hi"}],
]
RESPONSES = ["4 it is", "Blue, or maybe a long red", "Hello!"]
P, R = 64, 32


def char_tokenizer(specials, reverse, template, bos=None):
    """A character-level HF fast tokenizer: `specials` first, then the characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(specials)}
    for ch in CHARS[::-1] if reverse else CHARS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, vocab[bos])]
        )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=specials[0],
        eos_token=specials[2],
        bos_token=bos,
        additional_special_tokens=list(specials[3:]),
    )
    hf.chat_template = template
    return hf


@pytest.fixture(scope="module")
def actor_tokenizer():
    return char_tokenizer(["<pad>", "<unk>", "<|im_end|>", "<|im_start|>"], False, CHATML)


@pytest.fixture(scope="module")
def rm_same(tmp_path_factory, actor_tokenizer):
    """A reward model sharing the actor's tokenizer."""
    folder = save_tiny(
        "qwen2_gqa_tied", tmp_path_factory.mktemp("rm_a"), "sequence_classification", vocab_size=128
    )
    actor_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def rm_other(tmp_path_factory):
    """A reward model of another family with its own tokenizer and chat template."""
    folder = save_tiny(
        "llama_mha_tied", tmp_path_factory.mktemp("rm_b"), "sequence_classification", seed=1,
        vocab_size=128,
    )  # fmt: skip
    char_tokenizer(["<pad>", "<s>", "</s>"], True, INST, bos="<s>").save_pretrained(folder)
    return folder


def actor_batch(tok):
    """Left-padded templated prompts [B, P], right-padded responses with eos [B, R]."""
    prompt_ids = np.zeros((len(PROMPTS), P), np.int64)
    response_ids = np.zeros((len(PROMPTS), R), np.int64)
    for b, (messages, response) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        p = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        p = tok(p, add_special_tokens=False)["input_ids"]
        r = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        prompt_ids[b, P - len(p) :] = p
        response_ids[b, : len(r)] = r
    return prompt_ids, (prompt_ids != 0).astype(np.int64), response_ids, (response_ids != 0)


def hf_scores(folder, rows):
    model = hf_model(folder, "sequence_classification")
    with torch.no_grad():
        return np.array([model(input_ids=torch.tensor([r])).logits[0, 0].item() for r in rows])


def check_placed(reward, response_mask, expected):
    lengths = response_mask.sum(-1)
    assert reward.dtype == np.float32 and reward.shape == response_mask.shape
    scores = reward[np.arange(len(lengths)), lengths - 1]
    assert_close_to_scale(scores, expected)
    assert np.count_nonzero(reward) == np.count_nonzero(scores)


def test_same_tokenizer_scores_actor_tokens(rm_same, actor_tokenizer):
    prompt_ids, prompt_mask, response_ids, response_mask = actor_batch(actor_tokenizer)
    rm = RewardModel.from_pretrained(str(rm_same))
    assert not rm.retokenize
    reward = rm.compute_rm_score(response_ids, response_mask, prompt_ids, prompt_mask)
    rows = [
        [*prompt_ids[b][prompt_mask[b] > 0], *response_ids[b][response_mask[b]]]
        for b in range(len(PROMPTS))
    ]
    check_placed(reward, response_mask, hf_scores(rm_same, rows))


def test_trainer_reward_fn_scores_the_responses(rm_same, actor_tokenizer):
    """The trainer's reward function (`reward_model.enable`) passes the responses as responses
    and the prompts as prompts: the scores equal a direct `compute_rm_score`."""
    from jaxrl.data.batch import PromptBatch
    from jaxrl.trainer.fit import reward_fn_from

    prompt_ids, prompt_mask, response_ids, response_mask = actor_batch(actor_tokenizer)
    rm = RewardModel.from_pretrained(str(rm_same))
    b = len(PROMPTS)
    column = np.empty(b, object)
    column[:] = [None] * b
    raw = np.empty(b, object)
    raw[:] = [tuple(m) for m in PROMPTS]
    prompts = PromptBatch(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        group_ids=np.arange(b, dtype=np.int32),
        uid=column,
        row_ids=np.arange(b),
        data_source=column,
        ground_truth=column,
        ability=column,
        extra_info=column,
        raw_prompt=raw,
        is_padding=np.zeros(b, bool),
    )
    scores, _, _ = reward_fn_from(None, rm)(prompts, response_ids, response_mask)
    direct = rm.compute_rm_score(response_ids, response_mask, prompt_ids, prompt_mask)
    assert scores.shape == response_mask.shape
    np.testing.assert_array_equal(scores, direct)


def test_retokenize_for_another_tokenizer(rm_other, actor_tokenizer):
    _, _, response_ids, response_mask = actor_batch(actor_tokenizer)
    cfg = RewardModelConfig(
        enable=True, model=RewardModelPathConfig(path=str(rm_other)), dtype="float32"
    )
    rm = RewardModel.from_config(cfg, actor_tokenizer)
    assert rm.retokenize
    # verl 0.9.1's reward loop: decoded response without eos, the RM's template, no bos text.
    assert rm.rm_text(PROMPTS[0], response_ids[0][response_mask[0]]) == (
        "[USER] What is 2+2?</s>[ASSISTANT] 4 it is</s>"
    )
    reward = rm.compute_rm_score(response_ids, response_mask, raw_prompts=PROMPTS)
    texts = [rm.rm_text(m, response_ids[b][response_mask[b]]) for b, m in enumerate(PROMPTS)]
    rows = [rm.tokenizer(t)["input_ids"] for t in texts]
    assert all(r[0] == rm.tokenizer.bos_token_id for r in rows)  # bos from tokenizing
    check_placed(reward, response_mask, hf_scores(rm_other, rows))
    with pytest.raises(ValueError, match="pass raw_prompts"):
        rm.compute_rm_score(response_ids, response_mask)


def test_sharded_and_micro_batched_scores_agree(rm_same, actor_tokenizer):
    prompt_ids, prompt_mask, response_ids, response_mask = actor_batch(actor_tokenizer)
    single = RewardModel.from_pretrained(str(rm_same))
    ref = single.compute_rm_score(response_ids, response_mask, prompt_ids, prompt_mask)
    layout = Layout.create(train_mesh({"dp": 2, "fsdp": 2, "tp": 2}), TRAIN_RULES)
    sharded = RewardModel.from_pretrained(str(rm_same), layout=layout, micro_batch_size=2)
    reward = sharded.compute_rm_score(response_ids, response_mask, prompt_ids, prompt_mask)
    # tp splits the contractions, so partial sums add in another order: float32 rounding of
    # scores of scale ~1 (DESIGN §6's 1e-5; measured 3e-8, 0.002 of the tolerance)
    np.testing.assert_allclose(reward, ref, rtol=1e-5, atol=1e-5)


def test_bad_reward_model_config(rm_same, tmp_path):
    with pytest.raises(ValueError, match=r"reward_model.model.path"):
        RewardModel.from_config(RewardModelConfig(enable=True))
    causal = save_tiny("qwen2_gqa_tied", tmp_path, vocab_size=128)
    from jaxrl.models import from_pretrained

    config, params = from_pretrained(causal)
    with pytest.raises(ValueError, match="1-label classification head"):
        RewardModel(config, params, tokenizer=None, retokenize=False)
    config, params = from_pretrained(rm_same)
    with pytest.raises(ValueError, match="truncation"):
        RewardModel(
            dataclasses.replace(config), params, None, truncation="middle", retokenize=False
        )
