"""Reward managers: the same reward tensors and extra info as verl 0.9.1's `naive`, `dapo` and
`batch` managers on the same rollouts; errors are counted, not fatal; config wiring."""

import dataclasses
import types

import numpy as np
import pytest

from jaxrl.config.schema import Config, CustomRewardFunctionConfig, RewardModelConfig
from jaxrl.rewards import (
    BatchRewardManager,
    DAPORewardManager,
    NaiveRewardManager,
    ParallelRewardManager,
    RewardInputs,
    load_custom_reward_fn,
    make_reward_manager,
    place_scores,
)
from jaxrl.rewards.scorers import default_compute_score
from jaxrl.testing import import_reference

P, R = 6, 24

ROWS = [  # (data_source, response, ground_truth)
    ("openai/gsm8k", "so #### 1,000", "1000"),
    ("openai/gsm8k", "#### 7", "8"),
    ("math_dapo", "Answer: 42", "42"),
    ("aime2024", "\\boxed{3}", "4"),
    ("lighteval/MATH", "$\\boxed{\\frac12}$", "\\frac{1}{2}"),
    ("math_dapo", "Answer: 7" + " pad" * 3, "7"),
]


def batch(tok, rows=ROWS, eos=True):
    """(RewardInputs from token ids, the matching verl DataProto builder arguments)."""
    sources, texts, truths = (list(x) for x in zip(*rows, strict=True))
    resp_ids, resp_mask = tok.right_pad(texts, R, eos=eos)
    prompt_ids, _ = tok.right_pad(["Q?"] * len(rows), P)
    prompt_ids = np.roll(prompt_ids, P - 2, axis=1)  # left-padded prompts
    prompt_mask = (prompt_ids != 0).astype(np.int64)
    extra = [{"index": i} for i in range(len(rows))]
    inputs = RewardInputs(
        response_mask=resp_mask,
        data_sources=sources,
        ground_truths=truths,
        response_ids=resp_ids,
        extra_infos=extra,
    )
    return inputs, (prompt_ids, prompt_mask, resp_ids, resp_mask, sources, truths, extra)


def data_proto(prompt_ids, prompt_mask, resp_ids, resp_mask, sources, truths, extra):
    import torch

    protocol = import_reference("verl.protocol")
    return protocol.DataProto.from_dict(
        tensors={
            "prompts": torch.tensor(prompt_ids),
            "responses": torch.tensor(resp_ids),
            "attention_mask": torch.tensor(np.concatenate([prompt_mask, resp_mask], 1)),
        },
        non_tensors={
            "data_source": np.array(sources, dtype=object),
            "reward_model": np.array([{"ground_truth": g} for g in truths], dtype=object),
            "extra_info": np.array([dict(e) for e in extra], dtype=object),
        },
    )


def verl_manager(name):
    return import_reference(f"verl.workers.reward_manager.{name}")


def as_list(values):
    return [v.item() if hasattr(v, "item") else v for v in values]


def test_naive_matches_verl(char_tokenizer):
    inputs, raw = batch(char_tokenizer)
    ours = NaiveRewardManager(char_tokenizer)(inputs)
    ref = verl_manager("naive").NaiveRewardManager(char_tokenizer, num_examine=0)(
        data_proto(*raw), return_dict=True
    )
    np.testing.assert_array_equal(ours.reward_tensor, ref["reward_tensor"].numpy())
    assert ours.metrics == {"reward/errors": 0.0, "reward/timeouts": 0.0}
    # Rows with dict scores give the same extra info (verl's legacy lists skip float rows).
    dapo_rows = [r for r in ROWS if r[0] == "math_dapo"]
    ours = NaiveRewardManager(char_tokenizer)(batch(char_tokenizer, dapo_rows)[0])
    ref = verl_manager("naive").NaiveRewardManager(char_tokenizer, num_examine=0)(
        data_proto(*batch(char_tokenizer, dapo_rows)[1]), return_dict=True
    )
    assert ours.reward_extra_info == dict(ref["reward_extra_info"])


@pytest.mark.parametrize("log", [True, False])
@pytest.mark.parametrize("buffer_len,factor", [(8, 1.0), (20, 0.7)])
def test_dapo_overlong_matches_verl(char_tokenizer, buffer_len, factor, log):
    inputs, raw = batch(char_tokenizer)
    cfg = dict(enable=True, len=buffer_len, penalty_factor=factor, log=log)
    ours = DAPORewardManager(char_tokenizer, max_resp_len=R, overlong_buffer_cfg=cfg)(inputs)
    ref = verl_manager("dapo").DAPORewardManager(
        char_tokenizer,
        num_examine=0,
        max_resp_len=R,
        overlong_buffer_cfg=types.SimpleNamespace(**cfg),
    )(data_proto(*raw), return_dict=True)
    np.testing.assert_array_equal(ours.reward_tensor, ref["reward_tensor"].numpy())
    # The eos text was stripped before scoring, as verl does: "Answer: 42<|end|>" is correct.
    assert ours.reward_extra_info["acc"][2] is True
    # Keys every row has agree; verl's lists of dict-only keys ("score", "pred") skip the
    # float-scored rows, so they are misaligned with the batch; jaxrl's hold None there.
    ref_info = {k: as_list(v) for k, v in ref["reward_extra_info"].items()}
    for key in ("acc", "overlong_reward", "overlong"):
        assert ours.reward_extra_info.get(key) == ref_info.get(key), key
    assert ours.reward_extra_info["pred"] == [None, None, "42", "3", None, "7padpadpad"]
    if log:
        assert any(ours.reward_extra_info["overlong"])


def test_dapo_config_errors(char_tokenizer):
    on = dict(enable=True, len=8, penalty_factor=1.0, log=False)
    with pytest.raises(ValueError, match="max_resp_len"):
        DAPORewardManager(char_tokenizer, overlong_buffer_cfg=on)
    with pytest.raises(ValueError, match=r"overlong_buffer.len must be positive"):
        DAPORewardManager(char_tokenizer, max_resp_len=8, overlong_buffer_cfg={**on, "len": 0})
    with pytest.raises(ValueError, match=r"at least overlong_buffer\.len"):
        DAPORewardManager(char_tokenizer, max_resp_len=4, overlong_buffer_cfg=on)


def test_batch_matches_verl(char_tokenizer, scorers_file):
    rows = [("a", "x", "x"), ("b", "y", "z"), ("c", "", "")]
    inputs, raw = batch(char_tokenizer, rows, eos=False)
    fn = load_custom_reward_fn(scorers_file, "batch_score")
    ours = BatchRewardManager(char_tokenizer, compute_score=fn, reward_kwargs={"scale": 3.0})(
        inputs
    )
    ref = (
        verl_manager("batch")
        .BatchRewardManager(char_tokenizer, 0, fn, scale=3.0)(data_proto(*raw), return_dict=True)[
            "reward_tensor"
        ]
        .numpy()
    )
    # Row 2 is empty: verl's index `length - 1 = -1` wraps to the last position, jaxrl uses 0.
    np.testing.assert_array_equal(ours.reward_tensor[:2], ref[:2])
    assert ours.reward_tensor[2, 0] == ref[2, -1] == 3.0
    # A raising batch scorer: every row scores 0 and counts as an error.
    boom = BatchRewardManager(char_tokenizer, compute_score=fn)(
        dataclasses.replace(inputs, data_sources=["boom"] * 3)
    )
    assert not boom.reward_tensor.any() and boom.metrics["reward/errors"] == 3
    # Without a function, the built-in scorers row by row.
    default = BatchRewardManager(char_tokenizer)(batch(char_tokenizer)[0])
    np.testing.assert_array_equal(
        default.reward_tensor,
        NaiveRewardManager(char_tokenizer)(batch(char_tokenizer)[0]).reward_tensor,
    )


def test_raising_scorer_is_counted_not_fatal(char_tokenizer, scorers_file):
    fn = load_custom_reward_fn(scorers_file, "compute_score", {"bonus": 0.5})
    texts = ["x", "x", "x", "x"]
    mask = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    inputs = RewardInputs(
        response_mask=mask,
        data_sources=["plain", "boom", "dict", "nan_type"],
        ground_truths=["x", "x", "x", "x"],
        responses=texts,
    )
    out = NaiveRewardManager(compute_score=fn)(inputs)
    np.testing.assert_array_equal(
        out.reward_tensor, [[0, 1.5, 0], [0, 0, 0], [0, 0, 1.5], [0, 0, 0]]
    )
    assert out.metrics == {"reward/errors": 2.0, "reward/timeouts": 0.0}
    assert out.reward_extra_info == {
        "acc": [1.5, None, None, None],
        "score": [None, None, 1.5, None],
        "pred": [None, None, "x", None],
    }


def test_naive_alarm_timeout(scorers_file):
    fn = load_custom_reward_fn(scorers_file, "compute_score")
    inputs = RewardInputs(
        response_mask=np.ones((2, 2)),
        data_sources=["hang", "plain"],
        ground_truths=["x", "x"],
        responses=["x", "x"],
    )
    out = NaiveRewardManager(compute_score=fn, compute_score_timeout=0.2)(inputs)
    np.testing.assert_array_equal(out.reward_tensor, [[0, 0], [0, 1]])
    assert out.metrics == {"reward/errors": 1.0, "reward/timeouts": 1.0}


def test_async_custom_function_and_submit(char_tokenizer, scorers_file):
    fn = load_custom_reward_fn(scorers_file, "async_score")
    inputs, _ = batch(char_tokenizer, [("s", "ab", "ab"), ("s", "a", "b")], eos=False)
    with NaiveRewardManager(char_tokenizer, compute_score=fn) as manager:
        future = manager.submit(inputs)  # scores in a background thread
        out = future.result(timeout=30)
    np.testing.assert_array_equal(out.reward_tensor[:, :2], [[0, 2], [0, 0]])
    assert out.reward_extra_info["index"] == [0, 1]


def test_place_scores_last_valid_token():
    mask = np.array([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    out = place_scores(np.array([1.0, 2.0, 3.0, 4.0]), mask)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [[0, 0, 1, 0], [0, 0, 2, 0], [3, 0, 0, 0], [0, 0, 0, 4]])


def test_make_reward_manager_from_config(char_tokenizer, scorers_file):
    base = Config()
    manager = make_reward_manager(base, char_tokenizer)
    assert type(manager) is NaiveRewardManager
    assert manager.compute_score is default_compute_score
    custom = dataclasses.replace(
        base,
        reward_model=RewardModelConfig(reward_manager="dapo"),
        custom_reward_function=CustomRewardFunctionConfig(
            path=str(scorers_file), reward_kwargs={"bonus": 1.0}
        ),
    )
    buffer = dict(enable=True, len=4, penalty_factor=1.0, log=False)
    manager = make_reward_manager(custom, char_tokenizer, overlong_buffer_cfg=buffer)
    assert type(manager) is DAPORewardManager
    assert manager.max_resp_len == base.data.max_response_length
    assert manager.compute_score(data_source="s", solution_str="a", ground_truth="a") == 2.0
    prime = dataclasses.replace(base, reward_model=RewardModelConfig(reward_manager="prime"))
    with make_reward_manager(prime, char_tokenizer, num_workers=1, timeout_s=5) as manager:
        assert type(manager) is ParallelRewardManager
    bad = dataclasses.replace(base, reward_model=RewardModelConfig(reward_manager="nope"))
    with pytest.raises(ValueError, match=r"unknown reward manager 'nope'.*naive"):
        make_reward_manager(bad)


def test_inputs_from_verl_columns_and_examine(capsys):
    columns = {
        "source": ["openai/gsm8k", "openai/gsm8k", "math_dapo"],
        "reward_model": [{"ground_truth": "3", "style": "rule"}, {"ground_truth": "4"}, {}],
        "extra_info": [{"index": 0}, None, {"index": 2}],
    }
    manager = NaiveRewardManager(num_examine=1, reward_fn_key="source")
    inputs = manager.inputs_from_columns(
        columns, np.ones((3, 2)), responses=["#### 3", "#### 3", "Answer: 1"]
    )
    assert inputs.ground_truths == ["3", "4", None] and inputs.extra_info(1) == {}
    out = manager(inputs)
    # The row without a ground truth makes math_dapo raise: scored 0 and counted.
    np.testing.assert_array_equal(out.reward_tensor[:, 1], [1.0, 0.0, 0.0])
    assert out.metrics["reward/errors"] == 1
    printed = capsys.readouterr().out
    assert printed.count("[response]") == 2 and "needs reward_model.ground_truth" in printed
    with pytest.raises(KeyError, match="reward_fn_key"):
        RewardInputs.from_columns(columns, np.ones((3, 2)), responses=["a"] * 3)
