"""verl's GSM8K answer-check tool: the policy submits an answer and reads back its reward.

    create(create_kwargs={"ground_truth": "72"})        # the row's extra_info.tools_kwargs
    execute(id, {"answer": "72"})  ->  "Current parsed answer='72' reward=1.0", step reward 0.0

The answer is scored with jaxrl's port of verl's gsm8k scorer (`flexible`: the last number in
`#### <answer>`); the step reward is -0.05 when a call does not improve on the instance's
best reward so far (verl's penalty for guessing), and `calc_reward` is the instance's current
score.
"""

from __future__ import annotations

import uuid
from typing import Any

from jaxrl.agent.tools.base import BaseTool, ToolResponse
from jaxrl.rewards.scorers import gsm8k


class Gsm8kTool(BaseTool):
    """The answer check as a tool (verl's `Gsm8kTool`; name `calc_gsm8k_reward`)."""

    def __init__(self, config: dict[str, Any] | None, tool_schema: Any = None):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict[str, Any]] = {}

    def default_schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": "calc_gsm8k_reward",
                "description": "A tool for calculating the reward of gsm8k",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "answer": {
                            "type": "string",
                            "description": "The model's answer to the GSM8K math problem, "
                            "must be a digits",
                        }
                    },
                    "required": ["answer"],
                },
            },
        }

    async def create(
        self, instance_id: str | None = None, ground_truth: Any = None, **kwargs
    ) -> tuple[str, ToolResponse]:
        """Open an instance for one row: its `ground_truth` (given directly, as verl 0.4,
        or in `create_kwargs`, as verl 0.9's loop passes it)."""
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        if ground_truth is None:
            raise ValueError(
                "calc_gsm8k_reward needs the row's answer: put it in extra_info.tools_kwargs"
                ".calc_gsm8k_reward.create_kwargs.ground_truth"
            )
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = {"response": "", "ground_truth": str(ground_truth),
                                        "reward": 0.0}  # fmt: skip
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[ToolResponse, float, dict]:
        answer = str(parameters.get("answer", ""))
        state = self._instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instances[instance_id]
        return float(
            gsm8k.compute_score(state["response"], state["ground_truth"], method="flexible")
        )

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)
