from __future__ import annotations

import pytest

from grpo_core import PluginError, make_plugin


def calc(expression, **options):
    return make_plugin("calculator", **options).tool_call(arguments={"expression": expression})


@pytest.mark.parametrize(
    "expression, result",
    [
        ("18 + 34", "52"),
        ("(18 + 34) * 2", "104"),
        ("9 * 7 - 3", "60"),
        ("10 / 4", "2.5"),
        ("1 / 3", "0.333333"),
        ("2 / 3", "0.666667"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** 10", "1024"),
        ("2 ** -2", "0.25"),
        ("-(3 - 5)", "2"),
        ("+4", "4"),
        ("0.1 + 0.2", "0.3"),
        ("6 / 3", "2"),
        (" 1 + 1 ", "2"),
    ],
)
def test_arithmetic_is_exact(expression, result):
    assert calc(expression) == result


@pytest.mark.parametrize(
    "expression, message",
    [
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("2 ** 0.5", "an exponent must be a whole number of at most 64"),
        ("2 ** 65", "an exponent must be a whole number of at most 64"),
        ("__import__('os')", "only numbers, \\+ - \\* / // % \\*\\* and parentheses are allowed, not \"__import__\\('os'\\)\""),
        ("x + 1", "not 'x'"),
        ("'a' * 3", "not \"'a'\""),
        ("1 +", "not an arithmetic expression: '1 \\+'"),
        ("1 < 2", "not '1 < 2'"),
    ],
)
def test_anything_else_is_refused_with_a_message(expression, message):
    with pytest.raises(ValueError, match=message):
        calc(expression)


def test_arguments_must_hold_an_expression():
    with pytest.raises(ValueError, match='calculator takes {"expression": "..."}'):
        make_plugin("calculator").tool_call(arguments={"expr": "1"})


def test_options():
    assert calc("1 / 3", decimals=2) == "0.33" and calc("2 / 3", decimals=0) == "1" and calc("21 / 2", decimals=0) == "10"
    assert calc("2 ** 65", max_exponent=70) == str(2**65)
    with pytest.raises(ValueError, match="at most 3 in size"):
        calc("2 ** 4", max_exponent=3)
    assert calc("1+1", max_length=3) == "2"
    with pytest.raises(ValueError, match="longer than 3 characters"):
        calc("1 + 1", max_length=3)
    with pytest.raises(PluginError, match="decimals must be >= 0"):
        make_plugin("calculator", decimals=-1)


def test_spec_names_the_tool_and_its_argument():
    spec = make_plugin("calculator").tool_spec()
    assert spec["name"] == "calculator" and spec["parameters"]["required"] == ["expression"]
    assert spec["parameters"]["properties"]["expression"]["type"] == "string"
