"""Turn a config's plugin names into instances on a fresh manager, checked before any work."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from typing import Any

import attrs
import pluggy

from grpo_core.config import RunConfig, selected_names_from
from grpo_core.errors import PluginError
from grpo_core.hookspecs import KIND_TABLE, declared
from grpo_core.options import DEFAULT_CHOICE, coerce_options, instantiate
from grpo_core.plugins_manager import build_manager, check_single_choice, find, is_wrapper, plugin_class, provided


@attrs.define
class WeightedReward:
    name: str
    weight: float
    plugin: Any


@attrs.define
class Selection:
    manager: pluggy.PluginManager
    plugins: dict[str, list[Any]]
    """kind -> selected instances."""
    rewards: list[WeightedReward]
    loss: Any
    """The one (non-wrapper) loss plugin (None where the recipe selects no loss: ``grpo-core sft``)."""
    env_name: str | None = None
    tools: dict[str, Any] = attrs.field(factory=dict)
    """The selected tool plugins by the name the policy calls them (their ``tool_spec()["name"]``)."""
    group_filters: dict[str, Any] = attrs.field(factory=dict)
    """The selected group filters by name, in the order given (``--group-filter``)."""

    @property
    def env(self) -> Callable[[Any], Any] | None:
        """``env(prompt)`` -> a new episode of the selected environment, or None (the rollout's ``env``)."""
        if not self.plugins.get("env"):
            return None
        return lambda prompt: self.manager.hook.env_reset(prompt=prompt)

    @property
    def rollout_args(self) -> dict[str, Any]:
        """What a loop passes to the rollout hook besides prompts, group size, sampler and params."""
        return {"env": self.env, "tools": self.tools}

    @property
    def needs_reference(self) -> bool:
        return declared(self.loss, "loss", "needs_reference")

    @property
    def rewards_needing_answer(self) -> list[str]:
        """Names of the selected rewards, and environment, that compare against a row's answer
        (``needs_answer = True``)."""
        env = [f"{self.env_name} (environment)" for p in self.plugins.get("env", []) if declared(p, "env", "needs_answer")]
        return [r.name for r in self.rewards if declared(r.plugin, "reward", "needs_answer")] + env


def select_plugins(config: RunConfig, kinds: Collection[str] | None = None) -> Selection:
    """Find, check and instantiate the plugins the config names, before anything heavy loads;
    ``kinds``: those a recipe runs (``grpo-core sft``: a backend, the rollout that encodes
    prompts, loggers); None: every kind.

    Each plugin's options are stored back into ``config.plugin_options`` converted to their
    types, so config.json holds ``0.3`` whether the option came from a flag or a TOML file.
    """
    given = attrs.asdict(config)
    names: dict[str, list[str]] = {}
    classes: dict[str, type] = {}
    for kind, spec in KIND_TABLE.items():
        if kinds is not None and kind not in kinds:
            continue
        chosen = selected_names_from(given, kind)
        if spec.default_from:
            # The kinds that name the default come earlier in the table, so their names are known.
            for source in spec.default_from:
                classes.setdefault(source, plugin_class(names[source][0], source))
            if chosen is None:
                chosen = [next(d for source in spec.default_from if (d := declared(classes[source], source, f"default_{kind}")))]
            # --sampler-opt KEY=VALUE without --sampler: the options of the default, now named.
            by_name = config.plugin_options.get(kind, {})
            if DEFAULT_CHOICE in by_name:
                by_name[chosen[0]] = {**by_name.pop(DEFAULT_CHOICE), **by_name.get(chosen[0], {})}
        if spec.runs == "one or more" and not chosen:
            weight = "[:WEIGHT]" if spec.weighted else ""
            raise PluginError(f"no {kind} selected: pass --{kind.replace('_', '-')} NAME{weight}")
        names[kind] = chosen or []

    plugins: dict[str, dict[str, Any]] = {}
    typed_options: dict[str, dict[str, dict[str, Any]]] = {}
    # Registered in this order, which decides the order hooks every plugin implements run in
    # (pluggy calls the last registered first): the config's own choices, then defaults, then rewards.
    for kind in sorted(names, key=lambda kind: (bool(KIND_TABLE[kind].default_from), KIND_TABLE[kind].weighted)):
        kind_names = names[kind]
        if len(set(kind_names)) != len(kind_names):
            raise PluginError(f"{kind} plugins selected twice: {', '.join(kind_names)}")
        for name in kind_names:
            instance = provided(kind, name)
            if instance is not None:
                if config.options_for(kind, name):
                    raise PluginError(f"{kind} '{name}' is passed as an instance: set its options on the instance, not as plugin options")
                plugins.setdefault(kind, {})[name] = instance
                continue
            entry = find(name, kind)
            cls = entry.load_valid()
            options = coerce_options(cls, entry.qualified_name, config.options_for(kind, name))
            plugins.setdefault(kind, {})[name] = instantiate(cls, entry.qualified_name, options)
            if options:
                typed_options.setdefault(kind, {})[name] = options
    unknown = {f"{kind}.{name}" for kind, opts in config.plugin_options.items() for name in opts if name not in names.get(kind, [])}
    if unknown:
        raise PluginError(f"options given for plugins that are not selected: {', '.join(sorted(unknown))}")
    check_single_choice(plugins, kinds)
    config.plugin_options = typed_options

    rewards = [WeightedReward(name, weight, plugins["reward"][name]) for name, weight in config.reward.items() if "reward" in names]
    check_conversation(config, plugins, rewards)
    check_per_trajectory(config, plugins["rollout"][config.rollout])
    loss = next((p for p in plugins.get("loss", {}).values() if not is_wrapper(p, "loss")), None)
    manager = build_manager(p for by_name in plugins.values() for p in by_name.values())
    return Selection(
        manager=manager,
        plugins={kind: list(by_name.values()) for kind, by_name in plugins.items()},
        rewards=rewards,
        loss=loss,
        env_name=config.env,
        tools=tools_by_name(plugins.get("tool", {})),
        group_filters=dict(plugins.get("group_filter", {})),
    )


def check_conversation(config: RunConfig, plugins: dict[str, dict[str, Any]], rewards: list[WeightedReward]) -> None:
    """An environment or tools need a rollout that takes them, and a reward of the environment needs one."""
    rollout = plugins["rollout"][config.rollout]
    takes = inspect.signature(rollout.rollout).parameters
    for arg, flag, given in (("env", "--env", config.env), ("tools", "--tool", config.tool)):
        if given and arg not in takes:
            raise PluginError(
                f"rollout '{config.rollout}' does not take {'an environment' if arg == 'env' else 'tools'}, "
                f"so {flag} would do nothing: choose a multi-turn rollout (--rollout multi_turn)"
            )
    needing_env = [r.name for r in rewards if declared(r.plugin, "reward", "needs_env")]
    if needing_env and not config.env:
        raise PluginError(f"reward {', '.join(needing_env)} scores what an environment gave: select one with --env NAME")


def check_per_trajectory(config: RunConfig, rollout: Any) -> None:
    """A rollout's ``per_trajectory`` given as an option only changes the async loop's scheduling,
    which --loop sync and --synchronous-training do not have: each rolls out a whole batch per call."""
    if "per_trajectory" not in config.options_for("rollout", config.rollout) or not declared(rollout, "rollout", "per_trajectory"):
        return
    if config.loop == "async" and not config.synchronous_training:
        return
    mode = "--synchronous-training" if config.loop == "async" else f"--loop {config.loop}"
    raise PluginError(
        f"--rollout-opt per_trajectory=true makes the async loop roll out each conversation as its own task; {mode} rolls out "
        "a step's batch in one call, so it would do nothing: drop it, or use --loop async without --synchronous-training"
    )


def tools_by_name(tools: dict[str, Any]) -> dict[str, Any]:
    """The tool plugins by the name in their spec; two tools may not share one."""
    by_name: dict[str, Any] = {}
    for selected, plugin in tools.items():
        spec = plugin.tool_spec()
        name = spec.get("name") if isinstance(spec, dict) else None
        if not isinstance(name, str) or not name:
            raise PluginError(f"tool '{selected}': tool_spec() must return a dict with a non-empty 'name', got {spec!r}")
        if name in by_name:
            raise PluginError(f"tools '{selected}' and another selected tool are both called '{name}'")
        by_name[name] = plugin
    return by_name
