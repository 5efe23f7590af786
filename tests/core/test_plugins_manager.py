from __future__ import annotations

from typing import Literal

import attrs
import pytest

from grpo_core import PluginError, hookimpl, make_plugin, option
from grpo_core.plugins_manager import build_manager, catalog, check_single_choice, coerce, find, instantiate


def test_catalog_lists_builtins_through_entry_points():
    names = {(e.kind, e.name): e for e in catalog()}
    assert ("loss", "grpo") in names and ("advantage", "grpo") in names
    entry = names[("backend", "local")]
    assert entry.distribution == "grpo-core" and entry.version == "0.1.0"
    assert entry.target == "grpo_core.plugins.backends.local:LocalBackend"


def test_unknown_name_suggests_the_closest_and_lists_available():
    with pytest.raises(PluginError) as err:
        find("grpoo", "loss")
    assert "unknown loss 'grpoo'; did you mean 'grpo'?" in str(err.value)
    assert "available:" in str(err.value) and "grpo" in str(err.value)


def test_ambiguous_name_asks_for_the_kind():
    with pytest.raises(PluginError, match="names several plugins"):
        make_plugin("grpo")
    assert type(make_plugin("grpo", kind="advantage")).__name__ == "GRPOAdvantage"
    assert type(make_plugin("loss.grpo")).__name__ == "GRPOLoss"


def test_make_plugin_validates_options():
    loss = make_plugin("loss.grpo", eps_low="0.1", kl_estimator="k1")
    assert loss.eps_low == 0.1 and loss.kl_estimator == "k1"
    with pytest.raises(PluginError, match="unknown option 'eps_lo' for loss.grpo; did you mean 'eps_low'"):
        make_plugin("loss.grpo", eps_lo=0.1)
    with pytest.raises(PluginError, match="expected a number, got 'abc'"):
        make_plugin("loss.grpo", eps_low="abc")
    with pytest.raises(PluginError, match="expected one of 'k1', 'k2', 'k3'"):
        make_plugin("loss.grpo", kl_estimator="k4")
    with pytest.raises(PluginError, match="expected a number"):
        make_plugin("loss.grpo", eps_low=[1])


@pytest.mark.parametrize(
    ("value", "annotation", "expected"),
    [
        ("3", int, 3),
        ("2.5", float, 2.5),
        (2, float, 2.0),
        ("true", bool, True),
        ("off", bool, False),
        ("none", int | None, None),
        ("4", int | None, 4),
        ("a,b", list[str], ["a", "b"]),
        ("x", Literal["x", "y"], "x"),
    ],
)
def test_coerce_converts_cli_strings(value, annotation, expected):
    assert coerce(value, annotation) == expected


@pytest.mark.parametrize(("value", "annotation"), [("1.5", int), (True, int), ("maybe", bool), (3, str), ("z", Literal["x"])])
def test_coerce_rejects_wrong_types(value, annotation):
    with pytest.raises((TypeError, ValueError)):
        coerce(value, annotation)


@attrs.define
class _Loss:
    """A test loss."""

    scale: float = option(1.0, help="scale")

    @hookimpl
    def loss(self, inputs):
        return self.scale


@attrs.define
class _Wrapper:
    @hookimpl(wrapper=True)
    def loss(self, inputs):
        return (yield) * 10


def test_manager_calls_exactly_the_registered_instances_and_wrappers_compose():
    pm = build_manager([instantiate(_Loss, "loss.test", {"scale": "2"}), _Wrapper()])
    assert pm.hook.loss(inputs=None) == 20.0


def test_single_choice_stages_need_exactly_one_implementation():
    base = {kind: [object()] for kind in ("backend", "weight_sync", "rollout", "advantage")}
    with pytest.raises(PluginError, match="exactly one loss plugin must be selected, got 2"):
        check_single_choice({**base, "loss": [_Loss(), _Loss()]})
    with pytest.raises(PluginError, match="exactly one loss plugin must be selected, got 0"):
        check_single_choice({**base, "loss": [_Wrapper()]})
    check_single_choice({**base, "loss": [_Loss(), _Wrapper()]})
