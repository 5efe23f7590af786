"""What ``grpo-core plugins`` shows: every plugin, its origin, hooks and options."""

from __future__ import annotations

import inspect
from typing import Any

import attrs

from grpo_core.errors import PluginError
from grpo_core.options import is_secret
from grpo_core.plugins_manager import catalog, claims, plugin_hooks, plugin_problems


def describe_all() -> list[dict[str, Any]]:
    """One record per installed plugin; a plugin that fails to import carries its error, one
    whose hooks cannot work (see ``plugin_problems``) its ``problems``."""
    infos = []
    entries = catalog()
    for entry in entries:
        info: dict[str, Any] = {
            "kind": entry.kind,
            "name": entry.name,
            "distribution": entry.distribution,
            "version": entry.version,
            "target": entry.target,
        }
        rivals = [e for e in entries if (e.kind, e.name) == (entry.kind, entry.name) and e != entry]
        if rivals:
            info["conflict"] = f"also declared by {claims(rivals)}: grpo-core run refuses '{entry.name}' until one is uninstalled"
        try:
            cls = entry.load()
        except PluginError as exc:
            info["error"] = str(exc)
            infos.append(info)
            continue
        attrs.resolve_types(cls)
        info["help"] = inspect.cleandoc(cls.__doc__ or "")
        info["hooks"] = plugin_hooks(cls)
        info["problems"] = plugin_problems(entry.kind, cls, entry.qualified_name)
        info["options"] = [
            {
                "name": f.name,
                "type": f.type.__name__ if isinstance(f.type, type) else str(f.type).replace("typing.", ""),
                "default": None if f.default is attrs.NOTHING else _default(f.default),
                "help": f.metadata.get("help", ""),
                "secret": is_secret(f.name, f),
            }
            for f in attrs.fields(cls)
            if f.init
        ]
        infos.append(info)
    return infos


def _default(value: Any) -> Any:
    if isinstance(value, attrs.Factory):  # type: ignore[arg-type]
        return repr(value.factory())
    return value


def render(infos: list[dict[str, Any]]) -> None:
    import textwrap

    import click

    for info in infos:
        head = f"{info['kind']} {info['name']}  ({info['distribution']} {info['version']})"
        if "conflict" in info:
            head += "  CONFLICT"
        if "error" in info:
            click.echo(f"{head}  BROKEN\n    {info['error']}" + (f"\n    {info['conflict']}" if "conflict" in info else "") + "\n")
            continue
        flag = "  INVALID" if info["problems"] else ""
        click.echo(f"{head}  hooks: {', '.join(info['hooks']) or 'none'}{flag}")
        for problem in [*info["problems"], *([info["conflict"]] if "conflict" in info else [])]:
            click.echo(textwrap.fill(problem, width=100, initial_indent="    !!  ", subsequent_indent="        "))
        for line in info["help"].splitlines():
            click.echo(f"    {line}" if line else "")
        for o in info["options"]:
            secret = "  (secret: not written to config.json; env:NAME reads a variable)" if o["secret"] else ""
            text = f"{o['name']}={o['default']!r}  {o['help']}{secret}"
            click.echo(textwrap.fill(text, width=100, initial_indent="    --  ", subsequent_indent="        "))
        click.echo()
