"""The ``calculator`` tool: exact arithmetic on an expression the policy writes."""

from __future__ import annotations

import ast
import operator
from fractions import Fraction
from typing import Any

import attrs

from grpo_core import hookimpl, option

OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def _non_negative(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


@attrs.define
class CalculatorTool:
    """Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses,
    e.g. {"expression": "(18 + 34) * 2"}. Division is exact (a fraction), shown as a decimal
    rounded to `decimals`; anything else (names, calls) is refused with a message.
    """

    decimals: int = option(6, help="decimals shown for a result that is not a whole number", validator=_non_negative)
    max_exponent: int = option(64, help="largest exponent allowed in ** (keeps a call from running for ever)", validator=_non_negative)
    max_length: int = option(200, help="longest expression accepted, in characters", validator=_non_negative)

    @hookimpl
    def tool_spec(self) -> dict[str, Any]:
        return {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "the expression, e.g. (18 + 34) * 2"}},
                "required": ["expression"],
            },
        }

    @hookimpl
    def tool_call(self, arguments: dict[str, Any]) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise ValueError('calculator takes {"expression": "..."}')
        if len(expression) > self.max_length:
            raise ValueError(f"the expression is longer than {self.max_length} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError:
            raise ValueError(f"not an arithmetic expression: {expression!r}") from None
        return self._show(self._evaluate(tree.body))

    def _evaluate(self, node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            value = self._evaluate(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            base, exponent = self._evaluate(node.left), self._evaluate(node.right)
            if exponent.denominator != 1 or abs(exponent) > self.max_exponent:
                raise ValueError(f"an exponent must be a whole number of at most {self.max_exponent} in size")
            if base == 0 and exponent < 0:
                raise ValueError("division by zero")
            return base ** int(exponent)
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = self._evaluate(node.left), self._evaluate(node.right)
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise ValueError("division by zero")
            return Fraction(OPERATORS[type(node.op)](left, right))
        raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.unparse(node)!r}")

    def _show(self, value: Fraction) -> str:
        if value.denominator == 1:
            return str(value.numerator)
        shown = f"{float(round(value, self.decimals)):.{self.decimals}f}"
        return shown.rstrip("0").rstrip(".") if "." in shown else shown
