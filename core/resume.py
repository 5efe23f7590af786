"""``--resume``: the config of a run to continue, with the changes resuming allows.

Apart from ``grpo_core.config`` because a plugin option may be resumable (fsdp's ``nproc``), which
only its plugin class tells: this module reads the catalog, which the config must not.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo_core.config import (
    RunConfig,
    check_given,
    cli_fields,
    given_value,
    parse_plugin_opts,
    read_stored_config,
    resumable_fields,
    selected_names_from,
    typed_value,
)
from grpo_core.errors import PluginError
from grpo_core.options import DEFAULT_CHOICE, REDACTED, coerce_options, option_fields
from grpo_core.plugins_manager import plugin_class


def resumable_option(kind: str, name: str, key: str) -> Callable[[Any], Any] | None:
    """How to read a value of option ``key`` of plugin ``name`` that ``--resume`` may change
    (declared ``resumable``), or None."""
    cls = plugin_class(name, kind)
    field = option_fields(cls).get(key)
    if field is None or not field.metadata.get("resumable"):
        return None
    return lambda value: coerce_options(cls, f"{kind} '{name}'", {key: value})[key]


def load_resumed(
    run_dir: str, overrides: dict[str, Any], plugin_opts: dict[str, list[str]], config_class: type[RunConfig] = RunConfig
) -> RunConfig:
    """The config of the run in ``run_dir``, with the changes ``--resume`` allows; a run of another
    command (``grpo-core sft``'s for ``run``) is refused, naming the command that continues it.

    Flags that would change what a step computes are refused unless they repeat the stored
    value; plugin options may only supply secrets, which config.json never holds.
    """
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise PluginError(f"--resume {run_dir}: no config.json there; is it a grpo-core run directory?")
    stored = read_stored_config(path)
    command = stored.pop("command", RunConfig.command)
    if command != config_class.command:
        raise PluginError(f"--resume {run_dir}: it is a grpo-core {command} run; continue it with grpo-core {command} --resume {run_dir}")
    fields = {f.name: f for f in cli_fields(config_class)}
    refused = []
    resumable = resumable_fields(config_class)
    for key, value in overrides.items():
        if key not in fields:
            raise PluginError(f"unknown config key '{key}'")
        try:
            value = given_value(fields[key], value)
            changed = key not in stored or value != typed_value(fields[key], stored[key])
        except (TypeError, ValueError) as exc:
            raise PluginError(f"config '{key}': {exc}") from None
        if key in resumable:
            stored[key] = value
        elif changed:
            refused.append(f"--{key.replace('_', '-')}")
    if refused:
        allowed = ", ".join(f"--{k.replace('_', '-')}" for k in resumable)
        raise PluginError(f"--resume continues the run as it was configured: {', '.join(refused)} cannot change (allowed: {allowed})")
    options: dict[str, dict[str, dict[str, Any]]] = stored.pop("plugin_options", {}) or {}
    for kind, items in plugin_opts.items():
        # A default plugin (--sampler not given) is named in config.json by its options, if it had any.
        selected = selected_names_from(stored, kind)
        selected = (list(options.get(kind, {})) or None) if selected is None else selected
        for name, given in parse_plugin_opts(kind, items, selected).items():
            for key, value in given.items():
                resumable = resumable_option(kind, name, key)
                if options.get(kind, {}).get(name, {}).get(key) != REDACTED and resumable is None:
                    option = key if name == DEFAULT_CHOICE else f"{name}.{key}"
                    raise PluginError(
                        f"--resume: --{kind}-opt {option} cannot change; only secret options, which are not saved, "
                        "and options that do not change what a step computes (as fsdp's nproc) are given again"
                    )
                options.setdefault(kind, {}).setdefault(name, {})[key] = value if resumable is None else resumable(value)
    missing = [f"{kind}.{name}.{key}" for kind, by in options.items() for name, o in by.items() for key, v in o.items() if v == REDACTED]
    if missing:
        raise PluginError(f"--resume: secret options were not saved; give them again ({', '.join(missing)}), e.g. as env:VARIABLE")
    stored["run_dir"] = str(run_dir)
    try:
        config = config_class(**{k: typed_value(fields[k], v) for k, v in stored.items() if k in fields})
    except (TypeError, ValueError) as exc:
        raise PluginError(f"{path}: {exc}") from None
    config.plugin_options = options
    check_given(config, overrides)
    return config
