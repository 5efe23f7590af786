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
import types
import typing
from importlib import metadata
from typing import Any, Iterable, Literal, Sequence, Union

import attrs
import pluggy

from grpo_core import hookspecs

GROUP = "grpo_core"
KINDS = ("backend", "weight_sync", "rollout", "reward", "advantage", "loss", "logger")
SINGLE_CHOICE = ("backend", "weight_sync", "rollout", "advantage", "loss")


class PluginError(Exception):
    """A plugin cannot be found, loaded or configured; the message is meant for the user."""


def option(default: Any = attrs.NOTHING, *, help: str, **kwargs: Any) -> Any:
    """A plugin option: an attrs field whose help shows in ``grpo-core plugins``."""
    return attrs.field(default=default, metadata={"help": help}, **kwargs)


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
    cls = entry.load()
    return instantiate(cls, entry.qualified_name, options)


def instantiate(cls: type, label: str, options: dict[str, Any]) -> Any:
    attrs.resolve_types(cls)
    fields = {f.name: f for f in attrs.fields(cls) if f.init}
    kwargs = {}
    for key, value in options.items():
        field = fields.get(key)
        if field is None:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            known = ", ".join(fields) or "none"
            raise PluginError(f"unknown option '{key}' for {label}{hint} options: {known}")
        try:
            kwargs[key] = coerce(value, field.type)
        except (TypeError, ValueError) as exc:
            raise PluginError(f"option '{key}' of {label}: {exc}") from exc
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise PluginError(f"{label}: {exc}") from exc


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
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for plugin in plugins:
        pm.register(plugin)
    return pm


def plugin_hooks(cls: type) -> list[str]:
    """Names of the hooks a plugin class implements."""
    marker = hookspecs.PROJECT + "_impl"
    return sorted(name for name in dir(cls) if hasattr(getattr(cls, name, None), marker))


def is_wrapper(plugin: Any, hook: str) -> bool:
    opts = getattr(getattr(plugin, hook, None), hookspecs.PROJECT + "_impl", None) or {}
    return bool(opts.get("wrapper") or opts.get("hookwrapper"))


def check_single_choice(selected: dict[str, list[Any]]) -> None:
    """Each single-choice stage must have exactly one (non-wrapper) implementation."""
    for kind in SINGLE_CHOICE:
        hook = {"backend": "make_trainer"}.get(kind, kind)
        impls = [p for p in selected.get(kind, []) if not is_wrapper(p, hook)]
        if len(impls) != 1:
            names = ", ".join(type(p).__name__ for p in impls) or "none"
            raise PluginError(f"exactly one {kind} plugin must be selected, got {len(impls)} ({names})")
