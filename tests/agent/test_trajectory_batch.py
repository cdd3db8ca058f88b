"""Trajectories become the step's rows: left-padded prompts, right-padded responses with the
tool turns in them, `loss_mask` on the sampled tokens only; and the rollout's log-probs of the
sampled tokens equal a teacher-forced forward pass over the whole multi-turn sequence (the
cache after tool turns were appended is the cache of the concatenated text)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl.models as M
from jaxrl.agent import (
    AgentLoop,
    AgentRequest,
    ChatTokens,
    Limits,
    ToolRunner,
    Trajectory,
    trajectory_rows,
)
from jaxrl.agent.tools.calculator import Calculator
from jaxrl.data import load_tokenizer, synthetic
from jaxrl.rollout import RolloutEngine, SamplingParams
from jaxrl.testing.scripted import calculator_chain, scripted_policy
from jaxrl.trainer.advantage import compute_advantage
from jaxrl.trainer.batch import RLBatch


def test_a_hand_built_two_turn_trajectory_becomes_rows():
    t = Trajectory(prompt=[5, 6, 7], response=[10, 11, 1, 20, 21, 22, 12, 1],
                   sampled=[1, 1, 1, 0, 0, 0, 1, 1],
                   log_probs=[-0.1, -0.2, -0.3, 0, 0, 0, -0.4, -0.5])  # fmt: skip
    rows = trajectory_rows([t], prompt_length=4, response_length=10, pad_id=0)
    np.testing.assert_array_equal(rows["prompts"], [[0, 5, 6, 7]])
    np.testing.assert_array_equal(rows["prompt_mask"], [[0, 1, 1, 1]])
    np.testing.assert_array_equal(rows["responses"], [[10, 11, 1, 20, 21, 22, 12, 1, 0, 0]])
    np.testing.assert_array_equal(rows["response_mask"], [[1] * 8 + [0, 0]])
    np.testing.assert_array_equal(rows["loss_mask"], [[1, 1, 1, 0, 0, 0, 1, 1, 0, 0]])
    # exact: the trajectory's log-probs stored as float32
    np.testing.assert_array_equal(rows["rollout_log_probs"][0, :8], np.float32(t.log_probs))
    # GRPO over the loss mask: the tool turn's tokens get no advantage.
    scores = np.zeros((2, 10), np.float32)
    scores[0, 7], scores[1, 7] = 1.0, 0.0
    both = {k: np.concatenate([v, v]) for k, v in rows.items()}
    batch = RLBatch.from_host({**both, "token_level_scores": scores, "group_ids": [0, 0]}, None)
    algorithm = type("A", (), {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True,
                               "gamma": 1.0, "lam": 1.0})()  # fmt: skip
    inputs = {"token_level_rewards": batch.token_level_scores, "loss_mask": batch.loss_mask,
              "group_ids": batch.group_ids, "response_mask": batch.response_mask,
              "prompt_mask": batch.prompt_mask}  # fmt: skip
    adv, _ = compute_advantage(inputs, None, algorithm=algorithm)
    adv = np.asarray(adv)
    assert np.all(adv[:, 3:6] == 0) and np.all(adv[:, 8:] == 0) and adv[0, 0] > 0


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools_tokenizer")
    synthetic.write_tokenizer(folder, tools=True)
    return load_tokenizer(str(folder))


def test_rollout_log_probs_equal_a_forward_pass_over_the_conversation(tokenizer):
    # A policy with live attention and MLP (the context matters) that still calls the tool.
    config, params = scripted_policy(tokenizer, calculator_chain(), weight=16.0, live=0.3)
    engine = RolloutEngine(config, None, max_num_seqs=4, max_model_len=96, tokenizer=tokenizer)
    engine.load_weights(params)
    chat = ChatTokens(tokenizer, [tokenizer.eos_token_id])
    with ToolRunner({"calculator": Calculator({})}) as runner:
        loop = AgentLoop(engine, chat, runner, Limits(max_assistant_turns=3, decode_chunk=5),
                         response_length=48, max_prompt_length=16)  # fmt: skip
        requests = [AgentRequest([{"role": "user", "content": f"add: {a} + 100"}])
                    for a in (123, 456, 789, 321)]  # fmt: skip
        out = loop.run(requests, SamplingParams(temperature=1.0), jax.random.key(5))
    assert sum(t.user_turns for t in out) >= 2  # tool turns were appended
    rows = trajectory_rows(out, prompt_length=16, response_length=48, pad_id=0)
    ids = np.concatenate([rows["prompts"], rows["responses"]], axis=1)
    mask = np.concatenate([rows["prompt_mask"], rows["response_mask"]], axis=1)
    logits = M.forward(config, params, jnp.asarray(ids), jnp.asarray(mask))
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)[:, 15:-1]
    forward = np.take_along_axis(np.asarray(lp), rows["responses"][..., None], axis=-1)[..., 0]
    sampled = rows["loss_mask"] > 0
    # The engine's decode steps against one full forward (composite float32 ops) on log-probs
    # up to ~10 in magnitude: DESIGN §6's 1e-4 composite tolerance of that scale, 2e-4 absolute
    # (measured 3.9e-6, 0.02 of it)
    np.testing.assert_allclose(rows["rollout_log_probs"][sampled], forward[sampled], atol=2e-4)
    assert np.all(rows["rollout_log_probs"][~sampled] == 0)
