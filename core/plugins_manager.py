"""Plugin catalog and manager.

Every plugin, built-in or third-party, is an entry point of the group ``grpo_core`` named
``<kind>.<name>`` (``loss.cispo = "grpo_core.plugins.losses.cispo:CISPOLoss"``): ``name`` is
what users type (``--loss cispo``). The kind is part of the entry-point name because one
name may serve two kinds (``grpo`` is a loss and an advantage).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import os
import re
import types
import typing
from collections.abc import Iterable, Sequence
from importlib import metadata
from typing import Any, Literal, Union

import attrs
import pluggy

from grpo_core import hookspecs

GROUP = "grpo_core"
KINDS = ("backend", "sampler", "weight_sync", "rollout", "env", "tool", "reward", "advantage", "loss", "logger")
SINGLE_CHOICE = ("backend", "sampler", "weight_sync", "rollout", "advantage", "loss")
KIND_HOOKS = {
    "backend": ("load_tokenizer", "make_trainer", "make_reference"),
    "sampler": ("make_sampler",),
    "weight_sync": ("weight_sync",),
    "rollout": ("rollout",),
    "env": ("env_reset",),
    "tool": ("tool_spec", "tool_call"),
    "reward": ("reward",),
    "advantage": ("advantage",),
    "loss": ("loss",),
    "logger": ("on_run_start", "on_step", "on_run_end"),
}
"""The hooks a plugin of each kind may implement; it must implement at least one of them."""
REQUIRED_HOOKS = {"backend": ("load_tokenizer", "make_trainer"), "tool": ("tool_spec", "tool_call")}
"""Kinds that need more than one of their hooks (a run checks prompts with the tokenizer, then
trains; a tool is described to the policy, then called)."""
SECRET_NAME = re.compile(
    r"^(.*_)?(api_?key|password|passwd|secret|secret_key|access_key|private_key|credentials?)$"
    r"|^((auth|access|api|bearer|hf|refresh|secret)_)?token$"
)
"""Option names that hold secrets even when not declared ``secret=True`` (``max_tokens`` does not match)."""
REDACTED = "***"
ENV_PREFIX = "env:"


class PluginError(Exception):
    """A plugin cannot be found, loaded or configured; the message is meant for the user."""


def option(default: Any = attrs.NOTHING, *, help: str, secret: bool | None = None, **kwargs: Any) -> Any:
    """A plugin option: an attrs field whose help shows in ``grpo-core plugins``.

    ``secret=True`` keeps the value out of config.json and logs (``***``) and lets the user
    give it as ``env:NAME`` (read from the environment when the plugin is made). Options
    named like ``api_key``, ``token``, ``password`` or ``secret`` are secret unless
    ``secret=False``.
    """
    return attrs.field(default=default, metadata={"help": help, "secret": secret}, **kwargs)


def is_secret(name: str, field: attrs.Attribute | None = None) -> bool:
    declared = field.metadata.get("secret") if field is not None else None
    return bool(SECRET_NAME.match(name)) if declared is None else declared


@attrs.frozen
class PluginEntry:
    kind: str
    name: str
    target: str
    """``module:Class``."""
    distribution: str
    version: str

    @property
    def qualified_name(self) -> str:
        return f"{self.kind}.{self.name}"

    @property
    def label(self) -> str:
        """How messages name the plugin: what users type and where it comes from."""
        return f"{self.kind} plugin '{self.name}' from {self.distribution} {self.version}"

    def load(self) -> type:
        """Import the plugin class; a failure names the distribution that ships it."""
        module_name, _, attr = self.target.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except Exception as exc:
            raise PluginError(
                f"{self.kind} plugin '{self.name}' from {self.distribution} {self.version} "
                f"failed to import ({self.target}): {type(exc).__name__}: {exc}"
            ) from exc
        if not attrs.has(cls):
            raise PluginError(
                f"{self.kind} plugin '{self.name}' ({self.target}) is not an attrs class; "
                "decorate it with @attrs.define so its fields become its options"
            )
        return cls

    def load_valid(self) -> type:
        """Import the plugin class and refuse it when its hooks cannot work (see :func:`plugin_problems`)."""
        cls = self.load()
        problems = plugin_problems(self.kind, cls, self.qualified_name)
        if problems:
            raise PluginError(f"{self.label} ({self.target}) cannot be used: {'; '.join(problems)}")
        return cls


@functools.lru_cache(maxsize=1)
def catalog() -> tuple[PluginEntry, ...]:
    """Every installed plugin, from entry points, sorted by kind then name.

    Cached: scanning every installed distribution's metadata costs tens of milliseconds.
    """
    entries: dict[tuple[str, str], PluginEntry] = {}
    for ep in metadata.entry_points(group=GROUP):
        kind, dot, name = ep.name.partition(".")
        if not dot or kind not in KINDS:
            continue
        dist = ep.dist
        entries[(kind, name)] = PluginEntry(
            kind=kind,
            name=name,
            target=ep.value,
            distribution=dist.metadata["Name"] if dist else "?",
            version=dist.version if dist else "?",
        )
    return tuple(sorted(entries.values(), key=lambda e: (KINDS.index(e.kind), e.name)))


def find(name: str, kind: str | None = None) -> PluginEntry:
    """The entry for ``name`` (or ``kind.name``), with a did-you-mean error when unknown."""
    if kind is None and "." in name:
        kind, name = name.split(".", 1)
    if kind is not None and kind not in KINDS:
        raise PluginError(f"unknown plugin kind '{kind}'; kinds: {', '.join(KINDS)}")
    candidates = [e for e in catalog() if kind is None or e.kind == kind]
    matches = [e for e in candidates if e.name == name]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        options = ", ".join(f"'{m.qualified_name}'" for m in matches)
        raise PluginError(f"'{name}' names several plugins ({options}); say which, e.g. make_plugin('{matches[0].qualified_name}')")
    what = f"{kind} " if kind else "plugin "
    available = sorted({e.name for e in candidates})
    close = difflib.get_close_matches(name, available, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise PluginError(f"unknown {what}'{name}'{hint} available: {', '.join(available) or 'none'}")


def make_plugin(name: str, kind: str | None = None, **options: Any) -> Any:
    """Instantiate a plugin by name with validated options.

    ``make_plugin("cispo", eps_high=0.28)``; ``make_plugin("loss.grpo")`` or ``kind="loss"``
    where a name serves several kinds. Options given as strings (from the CLI or TOML) are
    converted to the option's type; a wrong type or unknown option raises PluginError.
    """
    entry = find(name, kind)
    cls = entry.load_valid()
    return instantiate(cls, entry.qualified_name, options)


def instantiate(cls: type, label: str, options: dict[str, Any]) -> Any:
    """``cls(**options)`` with options coerced to their types and ``env:NAME`` secrets read."""
    kwargs = coerce_options(cls, label, options)
    fields = option_fields(cls)
    for key, value in kwargs.items():
        if is_secret(key, fields[key]) and isinstance(value, str) and value.startswith(ENV_PREFIX):
            variable = value[len(ENV_PREFIX) :]
            if variable not in os.environ:
                raise PluginError(f"option '{key}' of {label} is read from the environment variable {variable}, which is not set")
            kwargs[key] = _coerce_option(label, key, fields[key], os.environ[variable])
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise PluginError(f"{label}: {exc}") from exc


def option_fields(cls: type) -> dict[str, attrs.Attribute]:
    attrs.resolve_types(cls)
    return {f.name: f for f in attrs.fields(cls) if f.init}


def coerce_options(cls: type, label: str, options: dict[str, Any]) -> dict[str, Any]:
    """Options converted to their declared types (what config.json stores); unknown ones raise.

    A secret given as ``env:NAME`` stays a reference here, so the value itself is only read
    when the plugin is made.
    """
    fields = option_fields(cls)
    coerced = {}
    for key, value in options.items():
        field = fields.get(key)
        if field is None:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            known = ", ".join(fields) or "none"
            raise PluginError(f"unknown option '{key}' for {label}{hint} options: {known}")
        if is_secret(key, field) and isinstance(value, str) and value.startswith(ENV_PREFIX):
            coerced[key] = value
        else:
            coerced[key] = _coerce_option(label, key, field, value)
    return coerced


def _coerce_option(label: str, key: str, field: attrs.Attribute, value: Any) -> Any:
    try:
        return coerce(value, field.type)
    except (TypeError, ValueError) as exc:
        # The error quotes the value; a secret's value must not reach the terminal or a log.
        reason = f"not a valid {_type_name(field.type)} (value hidden: secret option)" if is_secret(key, field) else exc
        raise PluginError(f"option '{key}' of {label}: {reason}") from None


def _type_name(annotation: Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def redact(kind: str, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options of one plugin with secret values shown as ``***`` (an ``env:NAME`` reference is kept).

    Declared secrets are read from the plugin class; a plugin that cannot be loaded is
    redacted by option names alone.
    """
    try:
        fields: dict[str, attrs.Attribute] = option_fields(find(name, kind).load())
    except PluginError:
        fields = {}
    return {
        key: REDACTED if is_secret(key, fields.get(key)) and not (isinstance(value, str) and value.startswith(ENV_PREFIX)) else value
        for key, value in options.items()
    }


def redact_plugin_options(plugin_options: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``config.plugin_options`` (kind -> plugin -> options) safe to write to config.json and logs."""
    return {kind: {name: redact(kind, name, opts) for name, opts in by_name.items()} for kind, by_name in plugin_options.items()}


def coerce(value: Any, annotation: Any) -> Any:
    """Convert ``value`` to ``annotation`` (CLI strings parse; other mismatches raise)."""
    if annotation is None or annotation is Any:
        return value
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg)
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        raise ValueError("; ".join(errors))
    if origin is Literal:
        for choice in args:
            if value == choice or (isinstance(value, str) and str(choice) == value):
                return choice
        raise ValueError(f"expected one of {', '.join(map(repr, args))}, got {value!r}")
    if origin in (list, tuple, Sequence):
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise TypeError(f"expected a list, got {value!r}")
        inner = args[0] if args else Any
        return [coerce(v, inner) for v in items]
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ValueError(f"expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool):
            raise TypeError(f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"expected an integer, got {value!r}") from None
        raise TypeError(f"expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, bool):
            raise TypeError(f"expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"expected a number, got {value!r}") from None
        raise TypeError(f"expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise TypeError(f"expected a string, got {value!r}")
    if isinstance(annotation, type) and not isinstance(value, annotation):
        raise TypeError(f"expected {annotation.__name__}, got {value!r}")
    return value


def build_manager(plugins: Iterable[Any]) -> pluggy.PluginManager:
    """A fresh manager with the hookspecs and exactly the given plugin instances."""
    pm = _new_manager()
    for plugin in plugins:
        try:
            pm.register(plugin)
        except pluggy.PluginValidationError as exc:
            cls = type(plugin)
            raise PluginError(f"plugin {cls.__module__}:{cls.__qualname__}: {_validation_reason(exc)}") from None
    return pm


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def _validation_reason(exc: pluggy.PluginValidationError) -> str:
    # pluggy's first line names the plugin by its registration name (a number when unnamed);
    # the caller names it the way users do, so only the reason is kept.
    return "; ".join(str(exc).splitlines()[1:]) or str(exc)


def plugin_hooks(cls: type) -> list[str]:
    """Names of the methods of a plugin class marked ``@hookimpl`` (hooks or not)."""
    return sorted(name for name in dir(cls) if _impl_options(cls, name) is not None)


def _impl_options(cls: type, name: str) -> dict[str, Any] | None:
    return getattr(getattr(cls, name, None), hookspecs.PROJECT + "_impl", None)


def hook_names() -> list[str]:
    return sorted(name for name in dir(hookspecs) if hasattr(getattr(hookspecs, name), hookspecs.PROJECT + "_spec"))


def hook_signature(hook: str) -> str:
    """``reward(self, prompt, samples)``: how a plugin method implementing ``hook`` is declared."""
    params = inspect.signature(getattr(hookspecs, hook)).parameters
    return f"{hook}({', '.join(['self', *params])})"


def plugin_problems(kind: str, cls: type, name: str) -> list[str]:
    """Why a plugin class of ``kind`` cannot work, empty when it can.

    A method marked ``@hookimpl`` that is no hook (``rewards``), one whose arguments the hook
    does not have, and a class that implements none of its kind's hooks (a loss without
    ``loss``) are all found here, from the class alone, before anything is instantiated.
    """
    problems = []
    known = hook_names()
    marked = plugin_hooks(cls)
    for hook in marked:
        if hook not in known and not (_impl_options(cls, hook) or {}).get("optionalhook"):
            close = difflib.get_close_matches(hook, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            problems.append(f"method '{hook}' is marked @hookimpl but no hook has that name{hint}")
    try:
        _new_manager().register(cls, name=name)
    except pluggy.PluginValidationError as exc:
        problems.append(_validation_reason(exc))
    own = KIND_HOOKS[kind]
    required = REQUIRED_HOOKS.get(kind, ())
    if not any(hook in marked for hook in own) or any(hook not in marked for hook in required):
        needs = required or own
        how = "all of" if required else ("one of" if len(needs) > 1 else "")
        wanted = "; ".join(f"@hookimpl def {hook_signature(hook)}" for hook in needs)
        missing = [hook for hook in needs if hook not in marked]
        article = "an" if kind[0] in "aeiou" else "a"
        problems.append(f"{article} {kind} plugin must implement {how + ' ' if how else ''}{wanted} (missing: {', '.join(missing)})")
    return problems


def is_wrapper(plugin: Any, hook: str) -> bool:
    opts = getattr(getattr(plugin, hook, None), hookspecs.PROJECT + "_impl", None) or {}
    return bool(opts.get("wrapper") or opts.get("hookwrapper"))


def check_single_choice(selected: dict[str, dict[str, Any]]) -> None:
    """Each single-choice stage must have exactly one (non-wrapper) implementation.

    ``selected``: kind -> {name users typed: instance}.
    """
    for kind in SINGLE_CHOICE:
        hook = {"backend": "make_trainer", "sampler": "make_sampler"}.get(kind, kind)
        by_name = selected.get(kind, {})
        impls = [name for name, plugin in by_name.items() if not is_wrapper(plugin, hook)]
        if len(impls) != 1:
            wrappers = [name for name in by_name if name not in impls]
            names = ", ".join(impls) or "none"
            besides = f"; {', '.join(wrappers)} only wrap{'s' if len(wrappers) == 1 else ''} one" if wrappers else ""
            raise PluginError(f"exactly one {kind} plugin must be selected, got {len(impls)} ({names}{besides})")
