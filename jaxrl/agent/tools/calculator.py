"""A calculator tool: arithmetic on numbers, read by a small parser (no `eval`).

    {"name": "calculator", "arguments": {"expression": "(123 + 456) * 2"}}  ->  "1158"

The expression is parsed with `ast` in `eval` mode (a parse, nothing runs) and only numbers,
parentheses, unary +/- and the binary operators + - * / // % ** are walked; anything else
(names, calls, attributes, strings, comparisons) is refused with a message naming it. Sizes are
bounded so that no expression can stall the host: at most `max_length` characters, exponents
of at most `max_exponent`, and results of at most `max_digits` digits.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from jaxrl.agent.tools.base import BaseTool, ToolResponse

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculationError(ValueError):
    """An expression the calculator refuses or cannot compute (the message says why)."""


def calculate(
    expression: str, *, max_length: int = 200, max_exponent: int = 100, max_digits: int = 100
) -> int | float:
    """The value of an arithmetic `expression` (see the module doc); `CalculationError`
    names what is wrong."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculationError("give an arithmetic expression, e.g. 12 * (3 + 4)")
    if len(expression) > max_length:
        raise CalculationError(f"the expression is longer than {max_length} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculationError(f"cannot read {expression!r}: {e.msg}") from None
    limits = dict(max_exponent=max_exponent, max_digits=max_digits)
    return _value(tree.body, **limits)


def _value(node: ast.AST, *, max_exponent: int, max_digits: int) -> int | float:
    limits = dict(max_exponent=max_exponent, max_digits=max_digits)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value, max_digits)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand, **limits))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left, **limits), _value(node.right, **limits)
        if isinstance(node.op, ast.Pow) and abs(right) > max_exponent:
            raise CalculationError(f"exponents are limited to {max_exponent}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculationError("division by zero") from None
        except OverflowError:
            raise CalculationError("the result is too large") from None
        if isinstance(result, complex):
            raise CalculationError("the result is not a real number")
        return _bounded(result, max_digits)
    what = type(node).__name__ if not isinstance(node, ast.Constant) else repr(node.value)
    raise CalculationError(f"only numbers and + - * / // % ** ( ) are allowed, not {what}")


def _bounded(value: int | float, max_digits: int) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculationError("the result is not a finite number")
    if abs(value) >= 10**max_digits:
        raise CalculationError(f"results are limited to {max_digits} digits")
    return value


def format_number(value: int | float) -> str:
    """An integer as its digits; a float as an integer when whole, else to 12 significant
    digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


class Calculator(BaseTool):
    """The calculator as a tool; `config` options: `max_length`, `max_exponent`,
    `max_digits` (see `calculate`)."""

    def default_schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluate an arithmetic expression (+ - * / // % ** and "
                "parentheses) and return its value.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "expression": {
                            "type": "string",
                            "description": "The expression, e.g. 123 + 456",
                        }
                    },
                    "required": ["expression"],
                },
            },
        }

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[ToolResponse, float, dict]:
        options = {k: self.config[k] for k in ("max_length", "max_exponent", "max_digits")
                   if k in self.config}  # fmt: skip
        try:
            value = calculate(parameters.get("expression", ""), **options)
        except CalculationError as e:
            return ToolResponse(text=f"Error: {e}"), 0.0, {"calculator/errors": 1.0}
        return ToolResponse(text=format_number(value)), 0.0, {}
