"""Option coercion at the edges its code draws: the message for an unknown option, values at type boundaries."""

import re
import typing
from typing import Any, Literal

import pytest

from grpo_core import PluginError, make_plugin
from grpo_core.options import coerce


def test_an_unknown_option_lists_the_plugins_options():
    with pytest.raises(PluginError) as error:
        make_plugin("loss.reinforce", beta=1.0)
    assert str(error.value).endswith("options: kl_beta, kl_estimator, agg")


def test_an_unknown_option_of_a_plugin_without_options_says_none():
    with pytest.raises(PluginError, match=re.escape("unknown option 'std' for advantage.dr_grpo options: none")):
        make_plugin("advantage.dr_grpo", std="population")


@pytest.mark.parametrize("value", ["text", 3, [1, "a"], None])
def test_an_undeclared_or_any_type_passes_the_value_through(value):
    assert coerce(value, None) == value
    assert coerce(value, Any) == value


def test_a_literal_of_numbers_takes_the_number_or_its_cli_text():
    assert coerce(2, Literal[1, 2]) == 2
    assert coerce("2", Literal[1, 2]) == 2
    with pytest.raises(ValueError, match="expected one of 1, 2, got '3'"):
        coerce("3", Literal[1, 2])


def test_list_items_are_coerced_to_the_item_type_and_an_untyped_list_keeps_them():
    assert coerce("1,2", list[int]) == [1, 2]
    assert coerce(["0.5", 2], list[float]) == [0.5, 2.0]
    assert coerce("a,1", typing.List) == ["a", "1"]  # noqa: UP006 (the unsubscripted form has no item type)


@pytest.mark.parametrize(("value", "annotation", "expected"), [(True, bool, True), (False, bool, False), (7, int, 7), (0, int, 0)])
def test_a_value_already_of_the_declared_type_is_kept(value, annotation, expected):
    result = coerce(value, annotation)
    assert result == expected and type(result) is annotation


def test_a_non_string_for_a_string_option_is_named_as_such():
    with pytest.raises(TypeError, match="^expected a string, got 3$"):
        coerce(3, str)
    assert coerce("3", str) == "3"


class Endpoint:
    """An option type that is neither a builtin nor a typing construct."""


def test_an_option_of_a_class_type_takes_an_instance_and_refuses_anything_else():
    endpoint = Endpoint()
    assert coerce(endpoint, Endpoint) is endpoint
    with pytest.raises(TypeError, match="^expected Endpoint, got 'http://x'$"):
        coerce("http://x", Endpoint)
