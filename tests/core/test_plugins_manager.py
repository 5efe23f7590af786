from __future__ import annotations

from typing import Literal

import attrs
import pytest

from grpo_core import PluginError, hookimpl, make_plugin, option
from grpo_core.options import coerce, coerce_options, instantiate, is_secret
from grpo_core.plugins_manager import (
    build_manager,
    catalog,
    check_single_choice,
    find,
    plugin_problems,
    redact,
    redact_plugin_options,
)


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
    ("option", "allowed"), [("optimizer_kernel", "'auto', 'compiled', 'eager'"), ("reference", "'auto', 'memory', 'offload'")]
)
def test_an_option_an_attrs_validator_refuses_is_its_message_alone_not_the_attribute(option, allowed):
    with pytest.raises(PluginError) as refused:
        make_plugin("backend.local", **{option: "bogus"})
    assert str(refused.value) == f"backend.local: '{option}' must be in ({allowed}) (got 'bogus')"


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


def test_single_choice_errors_name_plugins_as_users_type_them():
    base = {kind: {"x": object()} for kind in ("backend", "sampler", "weight_sync", "rollout", "advantage")}
    with pytest.raises(PluginError, match=r"^exactly one loss plugin must be selected, got 2 \(cispo, grpo\)$"):
        check_single_choice({**base, "loss": {"cispo": _Loss(), "grpo": _Loss()}})
    with pytest.raises(PluginError, match=r"^exactly one loss plugin must be selected, got 0 \(none; tis only wraps one\)$"):
        check_single_choice({**base, "loss": {"tis": _Wrapper()}})
    with pytest.raises(PluginError, match=r"exactly one rollout plugin must be selected, got 0 \(none\)"):
        check_single_choice({**base, "rollout": {}, "loss": {"grpo": _Loss()}})
    check_single_choice({**base, "loss": {"grpo": _Loss(), "tis": _Wrapper()}})


@attrs.define
class _Misspelled:
    @hookimpl
    def rewards(self, prompt, samples):
        return [1.0 for _ in samples]


@attrs.define
class _WrongArgument:
    @hookimpl
    def reward(self, prompt, sample):
        return [1.0]


@attrs.define
class _Hookless:
    """A loss that forgot its hook."""

    def loss(self, inputs):
        return 0.0


@attrs.define
class _HalfBackend:
    @hookimpl
    def make_trainer(self, config):
        return None


@attrs.define
class _StepLogger:
    @hookimpl
    def on_step(self, step, metrics, state):
        pass

    @hookimpl(optionalhook=True)
    def on_something_later(self):
        pass


def test_plugin_problems_find_a_misspelled_hook_and_say_what_the_kind_needs():
    assert plugin_problems("reward", _Misspelled, "reward.x") == [
        "method 'rewards' is marked @hookimpl but no hook has that name (did you mean 'reward'?)",
        "a reward plugin must implement @hookimpl def reward(self, prompt, samples) (missing: reward)",
    ]


def test_plugin_problems_find_a_wrong_argument_and_a_missing_hook():
    assert plugin_problems("reward", _WrongArgument, "reward.x") == [
        "hookimpl definition: reward(self, prompt, sample); "
        "Argument(s) {'sample'} are declared in the hookimpl but can not be found in the hookspec"
    ]
    assert plugin_problems("loss", _Hookless, "loss.x") == ["a loss plugin must implement @hookimpl def loss(self, inputs) (missing: loss)"]
    (backend,) = plugin_problems("backend", _HalfBackend, "backend.x")
    assert backend == (
        "a backend plugin must implement all of @hookimpl def load_tokenizer(self, config); "
        "@hookimpl def make_trainer(self, config, needs_reference) (missing: load_tokenizer)"
    )
    # A logger may observe only steps; an optional hook is no error.
    assert plugin_problems("logger", _StepLogger, "logger.x") == []
    # A valid plugin of the wrong kind is still refused: a reward is not a loss.
    assert plugin_problems("loss", type(make_plugin("format")), "loss.format")[-1].startswith("a loss plugin must implement")


def test_every_builtin_plugin_is_valid():
    for entry in catalog():
        assert plugin_problems(entry.kind, entry.load(), entry.qualified_name) == [], entry


def test_build_manager_names_a_rejected_plugin_by_its_class_not_a_number():
    with pytest.raises(PluginError) as err:
        build_manager([_WrongArgument()])
    assert str(err.value) == (
        "plugin tests.core.test_plugins_manager:_WrongArgument: hookimpl definition: reward(prompt, sample); "
        "Argument(s) {'sample'} are declared in the hookimpl but can not be found in the hookspec"
    )


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("api_key", True), ("openai_api_key", True), ("apikey", True), ("token", True), ("hf_token", True),
        ("access_token", True), ("password", True), ("db_password", True), ("secret", True), ("client_secret", True),
        ("max_tokens", False), ("stop_token", False), ("tokens", False), ("top_k", False), ("secretary", False), ("url", False),
    ],
)  # fmt: skip
def test_secret_option_names(name, secret):
    assert is_secret(name) is secret


@attrs.define
class _Remote:
    """A reward that calls a service."""

    url: str = option("http://localhost", help="service", secret=True)
    api_key: str = option("", help="key")
    token: str = option("", help="not a secret here, whatever its name", secret=False)
    retries: int = option(1, help="attempts")
    pin: int = option(0, help="a numeric secret", secret=True)


def test_secrets_are_read_from_the_environment_when_the_plugin_is_made(monkeypatch):
    monkeypatch.setenv("GRPO_TEST_KEY", "sk-123")
    monkeypatch.setenv("GRPO_TEST_PIN", "42")
    options = {"api_key": "env:GRPO_TEST_KEY", "pin": "env:GRPO_TEST_PIN", "retries": "3", "token": "env:NOT_READ"}
    # What config.json stores: typed values, and the reference, not the secret.
    assert coerce_options(_Remote, "reward.remote", options) == {
        "api_key": "env:GRPO_TEST_KEY",
        "pin": "env:GRPO_TEST_PIN",
        "retries": 3,
        "token": "env:NOT_READ",
    }
    plugin = instantiate(_Remote, "reward.remote", options)
    assert (plugin.api_key, plugin.pin, plugin.retries, plugin.token) == ("sk-123", 42, 3, "env:NOT_READ")
    monkeypatch.delenv("GRPO_TEST_KEY")
    with pytest.raises(
        PluginError, match="^option 'api_key' of reward.remote is read from the environment variable GRPO_TEST_KEY, which is not set$"
    ):
        instantiate(_Remote, "reward.remote", options)


def test_a_bad_secret_value_is_not_echoed():
    with pytest.raises(PluginError) as err:
        instantiate(_Remote, "reward.remote", {"pin": "sk-secret-1234"})
    assert "sk-secret-1234" not in str(err.value)
    assert str(err.value) == "option 'pin' of reward.remote: not a valid int (value hidden: secret option)"
    with pytest.raises(PluginError, match="expected an integer, got 'many'"):
        instantiate(_Remote, "reward.remote", {"retries": "many"})


def test_redact_hides_secrets_and_keeps_environment_references():
    options = {"api_key": "sk-123", "password": "env:DB_PASS", "max_tokens": 5, "scale": 0.3}
    # Not installed: secrets by name alone.
    assert redact("reward", "not_installed", options) == {"api_key": "***", "password": "env:DB_PASS", "max_tokens": 5, "scale": 0.3}
    assert redact_plugin_options({"reward": {"not_installed": options}, "loss": {"grpo": {"kl_beta": 0.01}}}) == {
        "reward": {"not_installed": {"api_key": "***", "password": "env:DB_PASS", "max_tokens": 5, "scale": 0.3}},
        "loss": {"grpo": {"kl_beta": 0.01}},
    }


def test_redact_reads_declared_secrets_from_the_plugin_class(monkeypatch):
    from grpo_core import plugins_manager
    from grpo_core.plugins_manager import PluginEntry

    entry = PluginEntry("reward", "remote", "tests.core.test_plugins_manager:_Remote", "test-dist", "0.1")
    monkeypatch.setattr(plugins_manager, "catalog", lambda: (entry,))
    redacted = redact("reward", "remote", {"url": "http://user:pw@host", "token": "visible", "api_key": "sk", "retries": 2})
    assert redacted == {"url": "***", "token": "visible", "api_key": "***", "retries": 2}


def test_make_plugin_refuses_an_invalid_plugin_naming_its_distribution(monkeypatch):
    from grpo_core import plugins_manager
    from grpo_core.plugins_manager import PluginEntry

    entry = PluginEntry("loss", "hookless", "tests.core.test_plugins_manager:_Hookless", "grpo-loss-x", "0.2")
    monkeypatch.setattr(plugins_manager, "catalog", lambda: (entry,))
    with pytest.raises(PluginError) as err:
        make_plugin("hookless")
    assert str(err.value) == (
        "loss plugin 'hookless' from grpo-loss-x 0.2 (tests.core.test_plugins_manager:_Hookless) cannot be used: "
        "a loss plugin must implement @hookimpl def loss(self, inputs) (missing: loss)"
    )


def test_a_tool_needs_both_its_hooks_and_an_env_its_reset():
    @attrs.define
    class CallOnly:
        @hookimpl
        def tool_call(self, arguments):
            return ""

    @attrs.define
    class NoReset:
        @hookimpl
        def env_rest(self, prompt):
            return None

    assert plugin_problems("tool", CallOnly, "tool.x") == [
        "a tool plugin must implement all of @hookimpl def tool_spec(self); @hookimpl def tool_call(self, arguments) (missing: tool_spec)"
    ]
    assert plugin_problems("env", NoReset, "env.x") == [
        "method 'env_rest' is marked @hookimpl but no hook has that name (did you mean 'env_reset'?)",
        "an env plugin must implement @hookimpl def env_reset(self, prompt) (missing: env_reset)",
    ]


@attrs.define
class Picky:
    """A plugin of a kind the table gains in a test."""

    strict: str = option("yes", help="declared bool by the toy kind, so wrongly typed")

    @hookimpl
    def keep_group(self, prompt, samples):
        return True


@attrs.define
class Silent:
    @hookimpl
    def on_step(self, step, metrics, state):
        pass


@pytest.fixture
def judge_kind(monkeypatch):
    """A kind added the way CONTRIBUTING says: one entry in the kind table, with an installed plugin of it."""
    import sys
    import types
    from importlib import metadata

    from grpo_core import hookspecs
    from grpo_core import plugins_manager as manager

    monkeypatch.setitem(
        hookspecs.KIND_TABLE,
        "judge",
        hookspecs.Kind(
            hooks=("keep_group",), runs="at most one", attributes={"strict": hookspecs.Attribute("bool", False, "judges strictly")}
        ),
    )
    module = types.ModuleType("toy_judges")
    module.Picky, module.Silent = Picky, Silent
    monkeypatch.setitem(sys.modules, "toy_judges", module)
    toy = [
        metadata.EntryPoint(name, f"toy_judges:{cls}", manager.GROUP)
        for name, cls in (("judge.picky", "Picky"), ("judge.silent", "Silent"))
    ]
    real = metadata.entry_points
    monkeypatch.setattr(manager.metadata, "entry_points", lambda group: [*real(group=group), *toy])
    catalog.cache_clear()
    yield
    catalog.cache_clear()


def test_a_kind_added_to_the_table_is_cataloged_listed_and_checked(judge_kind):
    from grpo_core.plugin_info import describe_all

    entries = [(e.kind, e.name) for e in catalog()]
    # Listed after the kinds before it in the table, like every kind.
    assert entries[-2:] == [("judge", "picky"), ("judge", "silent")]
    assert find("picky", "judge").target == "toy_judges:Picky"
    with pytest.raises(PluginError, match=r"unknown plugin kind 'jduge'; kinds: backend, sampler, .*, logger, judge"):
        find("picky", "jduge")
    infos = {info["name"]: info for info in describe_all() if info["kind"] == "judge"}
    assert infos["picky"]["problems"] == ["attribute 'strict' must be bool (declared in grpo_core.hookspecs), got 'yes'"]
    assert infos["silent"]["problems"] == [
        "a judge plugin must implement @hookimpl def keep_group(self, prompt, samples) (missing: keep_group)"
    ]
    with pytest.raises(PluginError, match=r"judge plugin 'silent' .* cannot be used: a judge plugin must implement"):
        make_plugin("judge.silent")


def test_how_many_of_a_kind_run_comes_from_the_table(judge_kind):
    from grpo_core.hookspecs import KIND_TABLE

    one_each = {kind: {"x": object()} for kind, spec in KIND_TABLE.items() if spec.runs == "one"}
    check_single_choice({**one_each, "judge": {"a": Picky()}})
    check_single_choice(one_each)  # at most one: none is fine
    with pytest.raises(PluginError, match=r"^at most one judge plugin must be selected, got 2 \(a, b\)$"):
        check_single_choice({**one_each, "judge": {"a": Picky(), "b": Picky()}})
    with pytest.raises(PluginError, match=r"^exactly one rollout plugin must be selected, got 0 \(none\)$"):
        check_single_choice({**one_each, "rollout": {}})


def test_the_config_cli_api_and_docs_follow_the_kind_table():
    """Every place that names kinds agrees with the table: the config's selection settings have the
    shape the table gives, the CLI has --KIND-opt for each, and CONTRIBUTING's table says the same."""
    import re
    import typing
    from pathlib import Path

    from grpo_core.cli import run as run_command
    from grpo_core.config import RunConfig
    from grpo_core.hookspecs import KIND_TABLE

    fields = {f.name: f.type for f in attrs.fields(RunConfig)}
    for kind, spec in KIND_TABLE.items():
        shape = typing.get_origin(fields[kind]) or fields[kind]
        if spec.weighted:
            assert shape is dict, kind
        elif spec.listed:
            assert shape is list, kind
        elif spec.default_from or spec.runs == "at most one":
            assert set(typing.get_args(fields[kind])) == {str, type(None)}, kind
        else:
            assert fields[kind] is str, kind
    opts = {p.name for p in run_command.params}
    assert {f"{kind}_opt" for kind in KIND_TABLE} <= opts
    page = (Path(__file__).resolve().parents[2] / "CONTRIBUTING.md").read_text()
    rows = re.findall(r"^\| (\w+) \| (.*?) \| .* \|$", page.split("## Write a plugin")[1].split("\n\n")[2], re.M)
    assert [kind for kind, _ in rows[1:]] == list(KIND_TABLE)
    for kind, hooks in rows[1:]:
        assert set(re.findall(r"`(\w+)`", hooks)) == set(KIND_TABLE[kind].hooks), kind


def test_every_default_is_named_by_a_kind_that_declares_it():
    from grpo_core.hookspecs import KIND_TABLE

    for kind, spec in KIND_TABLE.items():
        for source in spec.default_from:
            assert list(KIND_TABLE).index(source) < list(KIND_TABLE).index(kind), (kind, source)
            assert f"default_{kind}" in KIND_TABLE[source].attributes, (kind, source)
        if spec.default_from:
            # The last one always names one, so a run always has its plugin.
            assert KIND_TABLE[spec.default_from[-1]].attributes[f"default_{kind}"].type == "str", kind
