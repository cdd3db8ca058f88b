"""verl's multi-turn and agent-loop keys load as verl writes them; values jaxrl cannot honour
are errors that name the key; rows pick their agent and tools' kwargs as verl's do."""

import numpy as np
import pytest

from jaxrl.agent import agent_requests
from jaxrl.config import ConfigError, load_config
from jaxrl.data.batch import PromptBatch, object_array

MT = "actor_rollout_ref.rollout.multi_turn"


def load(*overrides):
    return load_config(None, ["actor_rollout_ref.model.path=unused", *overrides])


def test_verl_keys_load():
    cfg = load(f"{MT}.enable=true", f"{MT}.max_assistant_turns=5", f"{MT}.max_user_turns=4",
               f"{MT}.max_parallel_calls=2", f"{MT}.max_tool_response_length=100",
               f"{MT}.tool_response_truncate_side=left", f"{MT}.format=hermes",
               f"{MT}.tool_config_path=configs/tools/calculator.yaml",
               f"{MT}.use_inference_chat_template=false",
               f"{MT}.tokenization_sanity_check_mode=strict",
               "actor_rollout_ref.rollout.agent.num_workers=4",
               "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
               "actor_rollout_ref.rollout.agent.agent_loop_config_path=null")  # fmt: skip
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert (mt.enable, mt.max_assistant_turns, mt.max_parallel_calls) == (True, 5, 2)
    assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "tool_agent"


@pytest.mark.parametrize(
    "override, named",
    [(f"{MT}.format=llama3_json", f"{MT}.format"),
     (f"{MT}.tool_response_truncate_side=top", "truncate_side"),
     ("actor_rollout_ref.rollout.agent.default_agent_loop=react_agent", "default_agent_loop"),
     (f"{MT}.max_assistant_turns=0", "max_assistant_turns must be >= 1"),
     (f"{MT}.tool_timeout=0", "tool_timeout must be > 0"),
     (f"{MT}.tool_config_path=/nowhere/tools.yaml", "no such file"),
     (f"{MT}.function_tool_path=tools.py", "function_tool"),
     (f"{MT}.use_inference_chat_template=true", "use_inference_chat_template"),
     ("actor_rollout_ref.rollout.agent.agent_loop_config_path=loops.yaml", "agent_loop_config")],
)  # fmt: skip
def test_values_jaxrl_cannot_honour_are_named(override, named):
    with pytest.raises(ConfigError, match=named):
        load(override)


def prompts(agent_name, extra_info):
    n = len(extra_info)
    return PromptBatch(
        input_ids=np.zeros((n, 2), np.int32), attention_mask=np.ones((n, 2), np.int32),
        group_ids=np.arange(n), uid=object_array(["u"] * n), row_ids=np.arange(n),
        data_source=object_array(["s"] * n), ground_truth=object_array(["1"] * n),
        ability=object_array([""] * n), extra_info=object_array(extra_info),
        raw_prompt=object_array([({"role": "user", "content": "hi"},)] * n),
        is_padding=np.zeros(n, bool), agent_name=agent_name,
    )  # fmt: skip


def test_rows_choose_their_agent_and_tool_kwargs():
    kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "7"}}}
    batch = prompts(object_array(["tool_agent", None]), [{"tools_kwargs": kwargs}, {}])
    first, second = agent_requests(batch.repeat(2), "single_turn_agent")[::2]
    assert (first.agent_name, first.tools_kwargs) == ("tool_agent", kwargs)
    assert (second.agent_name, second.tools_kwargs) == ("single_turn_agent", {})
    assert agent_requests(prompts(None, [{}]), "tool_agent")[0].agent_name == "tool_agent"
    (req,) = agent_requests(prompts(None, [{"tool_selection": ["calculator"]}]), "tool_agent")
    assert req.tool_names == ("calculator",)
    with pytest.raises(ValueError, match="tools_kwargs must map"):
        agent_requests(prompts(None, [{"tools_kwargs": ["calculator"]}]), "tool_agent")
