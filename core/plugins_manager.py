"""Plugin catalog and manager.

Every plugin, built-in or third-party, is an entry point of the group ``grpo_core`` named
``<kind>.<name>`` (``loss.cispo = "grpo_core.plugins.losses.cispo:CISPOLoss"``): ``name`` is
what users type (``--loss cispo``). The kind is part of the entry-point name because one
name may serve two kinds (``grpo`` is a loss and an advantage).
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import functools
import importlib
import inspect
import json
from collections.abc import Collection, Iterable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import pluggy

from grpo_core import hookspecs
from grpo_core.errors import PluginError

if TYPE_CHECKING:
    from grpo_core.config import RunConfig
    from grpo_core.loss import LossInputs, LossOutput

from grpo_core.options import ENV_PREFIX, REDACTED, instantiate, is_secret, option_fields

GROUP = "grpo_core"


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
    """Every installed plugin, from entry points, sorted by kind then name; a name two
    distributions declare is there twice (``find`` refuses it, ``grpo-core plugins`` shows both).

    Cached: scanning every installed distribution's metadata costs tens of milliseconds.
    """
    entries: dict[tuple[str, str, str, str], PluginEntry] = {}
    for ep in metadata.entry_points(group=GROUP):
        kind, dot, name = ep.name.partition(".")
        if not dot or kind not in hookspecs.KIND_TABLE:
            continue
        dist = ep.dist
        entry = PluginEntry(
            kind=kind,
            name=name,
            target=ep.value,
            distribution=dist.metadata["Name"] if dist else "?",
            version=dist.version if dist else "?",
        )
        # One distribution found twice on the path (an editable install and a copy) is one plugin.
        entries[(kind, name, entry.target, entry.distribution)] = entry
    order = list(hookspecs.KIND_TABLE)
    return tuple(sorted(entries.values(), key=lambda e: (order.index(e.kind), e.name)))


def find(name: str, kind: str | None = None) -> PluginEntry:
    """The entry for ``name`` (or ``kind.name``), with a did-you-mean error when unknown."""
    if kind is None and "." in name:
        kind, name = name.split(".", 1)
    if kind is not None and kind not in hookspecs.KIND_TABLE:
        raise PluginError(f"unknown plugin kind '{kind}'; kinds: {', '.join(hookspecs.KIND_TABLE)}")
    candidates = [e for e in catalog() if kind is None or e.kind == kind]
    matches = [e for e in candidates if e.name == name]
    if len(matches) == 1:
        return matches[0]
    if len({m.kind for m in matches}) == 1 and matches:
        raise PluginError(f"{matches[0].kind} '{name}' is declared by several installed plugins: {claims(matches)}; uninstall all but one")
    if len(matches) > 1:
        options = ", ".join(f"'{m.qualified_name}'" for m in matches)
        raise PluginError(f"'{name}' names several plugins ({options}); say which, e.g. make_plugin('{matches[0].qualified_name}')")
    what = f"{kind} " if kind else "plugin "
    available = sorted({e.name for e in candidates})
    close = difflib.get_close_matches(name, available, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise PluginError(f"unknown {what}'{name}'{hint} available: {', '.join(available) or 'none'}")


def plugin_label(plugin: Any) -> str:
    """How messages name a plugin instance: as users select it, with its distribution."""
    cls = type(plugin)
    target = f"{cls.__module__}:{cls.__qualname__}"
    entry = next((e for e in catalog() if e.target == target), None)
    return entry.label if entry is not None else f"plugin {target}"


def claims(entries: Sequence[PluginEntry]) -> str:
    """``grpo-core 0.1.0 (module:Class), other 1.0 (module:Class)``: who declares a name."""
    return ", ".join(f"{e.distribution} {e.version} ({e.target})" for e in entries)


_provided: contextvars.ContextVar[dict[tuple[str, str], Any] | None] = contextvars.ContextVar("grpo_core_provided", default=None)


@contextlib.contextmanager
def provided_plugins(instances: dict[tuple[str, str], Any]) -> Iterator[None]:
    """Within the block, a config naming ``(kind, name)`` of ``instances`` selects that instance
    (checked as a plugin class is) instead of a plugin found by name: the Python API's plugins."""
    for (kind, name), instance in instances.items():
        problems = plugin_problems(kind, type(instance), name)
        if problems:
            raise PluginError(f"{kind} '{name}' ({type(instance).__name__} instance) cannot be used: {'; '.join(problems)}")
    token = _provided.set({**(_provided.get() or {}), **instances})
    try:
        yield
    finally:
        _provided.reset(token)


def provided(kind: str, name: str) -> Any:
    """The instance :func:`provided_plugins` gives for ``kind`` ``name``, else None."""
    return (_provided.get() or {}).get((kind, name))


def plugin_class(name: str, kind: str) -> type:
    """The class of the plugin a config names: a provided instance's, else the catalog's."""
    instance = provided(kind, name)
    return type(instance) if instance is not None else find(name, kind).load_valid()


def make_plugin(name: str, kind: str | None = None, **options: Any) -> Any:
    """Instantiate a plugin by name with validated options.

    ``make_plugin("cispo", eps_high=0.28)``; ``make_plugin("loss.grpo")`` or ``kind="loss"``
    where a name serves several kinds. Options given as strings (from the CLI or TOML) are
    converted to the option's type; a wrong type or unknown option raises PluginError.
    """
    entry = find(name, kind)
    cls = entry.load_valid()
    return instantiate(cls, entry.qualified_name, options)


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


def write_config(config: RunConfig, path: Path, run_info: dict[str, dict[str, str]] | None = None) -> None:
    """The resolved config as JSON (``config.json``), secret plugin options shown as ``***``, and
    ``run_info``: what the trainer and the sampler say of how they run (their declared ``run_info``)."""
    data = {
        **config.to_dict(),
        "command": config.command,
        "plugin_options": redact_plugin_options(config.plugin_options),
        "run_info": run_info or {},
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


def redact_plugin_options(plugin_options: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``config.plugin_options`` (kind -> plugin -> options) safe to write to config.json and logs."""
    return {kind: {name: redact(kind, name, opts) for name, opts in by_name.items()} for kind, by_name in plugin_options.items()}


def secret_values(plugin_options: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The secrets themselves among plugin options (what ``redact_plugin_options`` hides), for
    scrubbing text that may quote them (a command line)."""
    redacted = redact_plugin_options(plugin_options)
    return [
        str(value)
        for kind, by_name in plugin_options.items()
        for name, options in by_name.items()
        for key, value in options.items()
        if redacted[kind][name][key] == REDACTED and value not in ("", REDACTED)
    ]


def scrubbed(text: str, secrets: Iterable[str]) -> str:
    """``text`` with each secret shown as ``***``."""
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text


def call_loss(plugins: Sequence[Any], inputs: LossInputs) -> LossOutput:
    """Run the ``loss`` hook of the given plugin instances, exactly as a training run does."""
    out = build_manager(plugins).hook.loss(inputs=inputs)
    if out is None:
        raise ValueError("no loss plugin among the given plugins: pass one loss, e.g. make_plugin('loss.grpo')")
    return out


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
    problems.extend(attribute_problems(kind, cls))
    own = hookspecs.KIND_TABLE[kind].hooks
    required = hookspecs.KIND_TABLE[kind].required
    if not any(hook in marked for hook in own) or any(hook not in marked for hook in required):
        needs = required or own
        how = "all of" if required else ("one of" if len(needs) > 1 else "")
        wanted = "; ".join(f"@hookimpl def {hook_signature(hook)}" for hook in needs)
        missing = [hook for hook in needs if hook not in marked]
        article = "an" if kind[0] in "aeiou" else "a"
        problems.append(f"{article} {kind} plugin must implement {how + ' ' if how else ''}{wanted} (missing: {', '.join(missing)})")
    return problems


def attribute_problems(kind: str, cls: type) -> list[str]:
    """A declared attribute (``hookspecs.KIND_TABLE``) the class sets with a value of another type:
    a class attribute, or an option's default. A property is read, and checked, on the instance."""
    problems = []
    fields = {f.name: f for f in attrs.fields(cls)} if attrs.has(cls) else {}
    for name, attribute in hookspecs.attributes_of(kind).items():
        if name in fields:
            value = fields[name].default
            if value is attrs.NOTHING or isinstance(value, attrs.Factory):  # type: ignore[arg-type]
                continue
        elif hasattr(cls, name):
            value = inspect.getattr_static(cls, name)
            if isinstance(value, property) or (attribute.type == "callable | None" and inspect.isfunction(value)):
                continue
        else:
            continue
        if not attribute.accepts(value):
            problems.append(f"attribute '{name}' must be {attribute.type} (declared in grpo_core.hookspecs), got {value!r}")
    return problems


def is_wrapper(plugin: Any, hook: str) -> bool:
    opts = getattr(getattr(plugin, hook, None), hookspecs.PROJECT + "_impl", None) or {}
    return bool(opts.get("wrapper") or opts.get("hookwrapper"))


def check_single_choice(selected: dict[str, dict[str, Any]], kinds: Collection[str] | None = None) -> None:
    """Each kind of which one plugin runs (``hookspecs.KIND_TABLE``; of ``kinds``, those a recipe
    runs, when given) has exactly one (non-wrapper) implementation of its own hook, a kind of which at most
    one runs no more than one.

    ``selected``: kind -> {name users typed: instance}.
    """
    for kind, spec in hookspecs.KIND_TABLE.items():
        if spec.runs not in ("one", "at most one") or (kinds is not None and kind not in kinds):
            continue
        by_name = selected.get(kind, {})
        impls = [name for name, plugin in by_name.items() if not is_wrapper(plugin, spec.hooks[0])]
        if len(impls) != 1 and (spec.runs == "one" or impls):
            wrappers = [name for name in by_name if name not in impls]
            names = ", ".join(impls) or "none"
            besides = f"; {', '.join(wrappers)} only wrap{'s' if len(wrappers) == 1 else ''} one" if wrappers else ""
            exactly = "exactly" if spec.runs == "one" else "at most"
            raise PluginError(f"{exactly} one {kind} plugin must be selected, got {len(impls)} ({names}{besides})")
