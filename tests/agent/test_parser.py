"""Hermes tool calls: nested JSON, several calls in one turn, malformed calls kept with their
error, arguments checked against the schema; and a property: any calls rendered as the chat
template renders them parse back to themselves."""

import json

from hypothesis import given
from hypothesis import strategies as st

from jaxrl.agent.parser import argument_problems, parse_hermes
from jaxrl.agent.tools.calculator import Calculator


def test_nested_json_and_two_calls():
    text = (
        'Let me check. <tool_call>\n{"name": "search", "arguments": {"query": {"terms": '
        '["a", "b"], "filter": {"year": 2024}}, "k": 3}}\n</tool_call> and '
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2*(3+4)"}}</tool_call>'
    )
    content, calls = parse_hermes(text)
    assert content == "Let me check.  and "
    assert [c.name for c in calls] == ["search", "calculator"]
    assert calls[0].arguments == {"query": {"terms": ["a", "b"], "filter": {"year": 2024}}, "k": 3}
    assert calls[1].arguments == {"expression": "2*(3+4)"} and not any(c.error for c in calls)


def test_malformed_calls_are_kept_with_their_error():
    _, calls = parse_hermes(
        "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'
        '<tool_call>{"name": "g", "arguments": "{\\"x\\": 1}"}</tool_call>'
        '<tool_call>{"name": "h", "arguments": {}'
    )
    errors = [c.error for c in calls]
    assert "not valid JSON" in errors[0]
    assert 'needs a "name"' in errors[1]
    assert "must be a JSON object" in errors[2]
    assert errors[3] is None and calls[3].arguments == {"x": 1}  # arguments as a JSON string
    assert "without </tool_call>" in errors[4]
    assert parse_hermes("no calls here") == ("no calls here", [])


def test_required_arguments_are_checked():
    schema = Calculator({}).tool_schema
    assert argument_problems({"expression": "1+1"}, schema) == []
    assert argument_problems({}, schema) == ["missing required argument 'expression'"]
    assert argument_problems({"expression": 5, "digits": 3}, schema) == []  # the tool's business


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
_call = st.tuples(st.from_regex(r"[a-z_]{1,10}", fullmatch=True),
                  st.dictionaries(st.text(max_size=6), _json, max_size=3))  # fmt: skip


@given(st.lists(_call, min_size=1, max_size=3), st.text(max_size=20).filter(
    lambda t: "<tool_call>" not in t and "</tool_call>" not in t))  # fmt: skip
def test_rendered_calls_parse_back(calls, prose):
    """Calls written as Qwen2.5's template writes them (json.dumps between the tags, after any
    text) parse back to the same names and arguments, in order."""
    text = prose + "".join(
        f"\n<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls
    )
    content, parsed = parse_hermes(text)
    assert content.strip() == prose.strip()
    assert [(c.name, c.arguments, c.error) for c in parsed] == [(n, a, None) for n, a in calls]
