"""The shipped tools and the tool YAML: the calculator computes arithmetic and refuses
everything else (no eval), verl's gsm8k answer check, and the registry's loading and errors."""

import asyncio
import copy
import json
import logging
import types

import pytest

from jaxrl.agent import ToolCall, ToolRunner, load_tools
from jaxrl.agent.tools.base import schema_dict
from jaxrl.agent.tools.calculator import CalculationError, Calculator, calculate, format_number
from jaxrl.agent.tools.gsm8k import Gsm8kTool
from jaxrl.agent.tools.registry import ToolConfigError
from jaxrl.testing.reference import import_reference, reference_method


@pytest.mark.parametrize(
    "expression, value",
    [("123 + 456", 579), ("2*(3+4)", 14), ("7 / 2", 3.5), ("-2 ** 3", -8), ("17 // 5 % 3", 0),
     ("1.5e3 - 0.5", 1499.5), ("((((1))))", 1)],
)  # fmt: skip
def test_the_calculator_computes(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression, problem",
    [("__import__('os').system('true')", "not Call"), ("x + 1", "not Name"),
     ("(1).real", "not Attribute"), ("'a' * 3", "not 'a'"), ("1 < 2", "not Compare"),
     ("9 ** 9 ** 9", "exponents are limited"), ("10 ** 99 * 10 ** 99", "limited to 100 digits"),
     ("1 / 0", "division by zero"), ("2 +", "cannot read"), ("", "give an arithmetic"),
     ("1" * 300, "longer than 200"), ("(-8) ** 0.5", "not a real number")],
)  # fmt: skip
def test_the_calculator_refuses(expression, problem):
    with pytest.raises(CalculationError, match=problem):
        calculate(expression)


def test_the_calculator_tool_answers_errors_in_text():
    tool = Calculator({})
    assert asyncio.run(tool.execute("i", {"expression": "6*7"}))[0].text == "42"
    response, _, metrics = asyncio.run(tool.execute("i", {"expression": "os"}))
    assert response.text.startswith("Error: only numbers") and metrics == {"calculator/errors": 1.0}
    assert format_number(2.0) == "2" and format_number(1 / 3) == "0.333333333333"


def test_gsm8k_tool_scores_answers_as_verl():
    tool = Gsm8kTool({})
    instance, _ = asyncio.run(tool.create(create_kwargs={"ground_truth": "72"}))
    response, step_reward, _ = asyncio.run(tool.execute(instance, {"answer": "71"}))
    assert step_reward == -0.05 and "reward=0.0" in response.text
    response, step_reward, _ = asyncio.run(tool.execute(instance, {"answer": "72"}))
    assert step_reward == 0.0 and "reward=1.0" in response.text
    assert asyncio.run(tool.calc_reward(instance)) == 1.0
    asyncio.run(tool.release(instance))
    with pytest.raises(ValueError, match=r"tools_kwargs\.calc_gsm8k_reward"):
        asyncio.run(tool.create())


def write(tmp_path, text):
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    return path


def test_the_shipped_yaml_and_verl_class_paths_load(tmp_path):
    tools = load_tools("configs/tools/calculator.yaml")
    assert list(tools) == ["calculator"] and isinstance(tools["calculator"], Calculator)
    path = write(tmp_path, "tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n"
                           "    config: {type: native}\n")  # fmt: skip
    assert isinstance(load_tools(path)["calc_gsm8k_reward"], Gsm8kTool)


@pytest.mark.parametrize(
    "text, problem",
    [("tools: 3", "top-level `tools:` list"), ("tools:\n  - config: {}", "needs class_name"),
     ("tools:\n  - class_name: Calculator", "not a dotted path"),
     ("tools:\n  - class_name: nowhere.Calc", "cannot import 'nowhere'"),
     ("tools:\n  - class_name: jaxrl.agent.tools.calculator.Nope", "has no class 'Nope'"),
     ("tools:\n  - class_name: jaxrl.agent.tools.base.BaseTool", "has no default schema"),
     ("tools:\n  - class_name: jaxrl.agent.tools.calculator.Calculator\n    config: {type: mcp}",
      "native"),
     ("tools:\n  - class_name: jaxrl.agent.tools.calculator.Calculator\n"
      "  - class_name: jaxrl.agent.tools.calculator.Calculator", "a second tool named"),
     ("tools:\n  - class_name: jaxrl.agent.tools.calculator.Calculator\n"
      "    tool_schema: {type: function, function: {description: x}}", "has no name"),
     ("tools: [", "not valid YAML")],
)  # fmt: skip
def test_bad_tool_yaml_is_named(tmp_path, text, problem):
    with pytest.raises(ToolConfigError, match=problem) as info:
        load_tools(write(tmp_path, text))
    assert "tools.yaml" in str(info.value)
    with pytest.raises(ToolConfigError, match="no such file"):
        load_tools(tmp_path / "missing.yaml")


VERL_TOOL = """
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse


class Echo(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text=str(parameters.get("text"))), 0.5, {}
"""


def test_a_tool_written_for_verl_runs_as_it_is(tmp_path, monkeypatch):
    """A subclass of verl's own BaseTool (pydantic schema, async methods, verl's
    ToolResponse) loads from the YAML and answers through the runner."""
    import_reference("verl.tools.base_tool")
    (tmp_path / "verl_echo.py").write_text(VERL_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, "tools:\n  - class_name: verl_echo.Echo\n    config: {type: native}\n"
                           "    tool_schema: {type: function, function: {name: echo, description:"
                           " e, parameters: {type: object, properties: {text: {type: string}},"
                           " required: [text]}}}\n")  # fmt: skip
    with ToolRunner(load_tools(path)) as runner:
        result = runner.submit(ToolCall("echo", {"text": "hi"})).result(timeout=30)
    assert (result.text, result.reward, result.error) == ("hi", 0.5, None)


VERL_BROKEN = """
from verl.tools.base_tool import BaseTool


class Broken(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("the tool broke")
"""


def test_answers_to_an_unknown_and_a_failing_tool_are_verls(tmp_path, monkeypatch):
    """verl 0.9.1's own `ToolAgentLoop._call_tool` (compiled from its source: its module
    imports the vLLM server's client) and jaxrl's runner answer a call of an unknown tool and
    of a tool that raises with the same text."""
    function_tool = import_reference("verl.tools.function_tool")
    verl_schemas = import_reference("verl.tools.schemas")
    (tmp_path / "verl_broken.py").write_text(VERL_BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, "tools:\n  - class_name: verl_broken.Broken\n"
                           "    config: {type: native}\n"
                           "    tool_schema: {type: function, function: {name: broken, description:"
                           " b, parameters: {type: object, properties: {text: {type: string}},"
                           " required: [text]}}}\n"
                           "  - class_name: jaxrl.agent.tools.calculator.Calculator\n"
                           "    config: {type: native}\n")  # fmt: skip
    tools = load_tools(path)
    call_tool = reference_method(
        "experimental/agent_loop/tool_agent_loop.py", "ToolAgentLoop", "_call_tool",
        {"json": json, "logger": logging.getLogger("verl_reference"),
         "FunctionTool": function_tool.FunctionTool, "ToolResponse": verl_schemas.ToolResponse,
         "normalize_function_tool_return": function_tool.normalize_function_tool_return},
    )  # fmt: skip
    loop = types.SimpleNamespace(
        tools=tools, max_tool_response_length=10_000, tool_response_truncate_side="middle"
    )
    with ToolRunner(tools) as runner:
        for name, arguments in (("search", {"query": "x"}), ("broken", {"text": "x"})):
            call = types.SimpleNamespace(name=name, arguments=json.dumps(arguments))
            want, _, _ = asyncio.run(call_tool(loop, call, {}, types.SimpleNamespace()))
            got = runner.submit(ToolCall(name, arguments)).result(timeout=30)
            assert got.text == want.text, name
            assert got.error == ("unknown_tool" if name == "search" else "exception")
            assert ("['broken', 'calculator']" in got.text) is (name == "search")


def test_schema_keys_are_in_verls_order_and_items_are_kept():
    """A tool YAML's schema keys in any order: the prompt's tool JSON lists them as verl's
    schema models do (its tokens equal verl's); a property's `items`, which verl's model
    drops, is kept after the keys verl knows (a documented difference)."""
    verl_schemas = import_reference("verl.tools.schemas")
    shuffled = {
        "function": {
            "parameters": {
                "required": ["query"],
                "properties": {
                    "query": {"description": "What to look for.", "type": "string"},
                    "tags": {"items": {"type": "string"}, "type": "array", "description": "t"},
                },
                "type": "object",
            },
            "description": "Search the notes.",
            "name": "search",
        },
        "type": "function",
    }
    model = verl_schemas.OpenAIFunctionToolSchema.model_validate(shuffled)
    want = model.model_dump(exclude_unset=True, exclude_none=True)  # verl's prompt's schema
    ours = schema_dict(copy.deepcopy(shuffled))
    tags = ours["function"]["parameters"]["properties"]["tags"]
    assert list(tags) == ["type", "description", "items"]
    del tags["items"]
    assert json.dumps(ours) == json.dumps(want)
    assert schema_dict(model) == want  # a verl model: dumped, already in its order


class Stalled(Calculator):
    """The calculator whose `execute` never returns by itself; counts its instances created
    and released."""

    created = released = 0

    async def create(self, instance_id=None, **kwargs):
        Stalled.created += 1
        return await super().create(instance_id, **kwargs)

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(3600)

    async def release(self, instance_id, **kwargs):
        Stalled.released += 1


def test_close_cancels_the_calls_in_flight_and_releases_their_instances(caplog):
    """A run that ends with tool calls in flight (an episode aborted at the end): `close`
    cancels them, each instance is released, and no task is left pending on the closed loop
    (asyncio reports those as destroyed when they are collected)."""
    import gc
    import time

    runner = ToolRunner({"calculator": Stalled({})}, timeout=3600)
    futures = [runner.submit(ToolCall("calculator", {"expression": "1+1"})) for _ in range(8)]
    for future in futures[:4]:  # as an aborted episode does: some cancelled just before
        future.cancel()
    began = time.monotonic()
    while Stalled.created < 4 and time.monotonic() - began < 30:  # the others running
        time.sleep(0.01)
    began = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        runner.close()
        del runner
        gc.collect()
    assert time.monotonic() - began < 5
    assert Stalled.created >= 4 and Stalled.released == Stalled.created
    assert all(f.cancelled() for f in futures)
    assert not [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()]
