"""Plugin options: how a plugin declares them, how values given as text become their types,
which of them are secrets.

Imports nothing of the core, so the config and the plugin catalog can both use it.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Union

import attrs

from grpo_core.errors import PluginError

SECRET_NAME = re.compile(
    r"^(.*_)?(api_?key|password|passwd|secret|secret_key|access_key|private_key|credentials?)$"
    r"|^((auth|access|api|bearer|hf|refresh|secret)_)?token$"
)
"""Option names that hold secrets even when not declared ``secret=True`` (``max_tokens`` does not match)."""
DEFAULT_CHOICE = "(default)"
"""Where ``--sampler-opt KEY=VALUE`` waits for the default's name, which the plugin catalog knows
(``grpo_core.selection``), not the config; no entry point can be named so."""
REDACTED = "***"
ENV_PREFIX = "env:"


def option(default: Any = attrs.NOTHING, *, help: str, secret: bool | None = None, resumable: bool = False, **kwargs: Any) -> Any:
    """A plugin option: an attrs field whose help shows in ``grpo-core plugins``.

    ``secret=True`` keeps the value out of config.json and logs (``***``) and lets the user
    give it as ``env:NAME`` (read from the environment when the plugin is made). Options
    named like ``api_key``, ``token``, ``password`` or ``secret`` are secret unless
    ``secret=False``. ``resumable=True``: ``--resume`` may change it (it does not change what
    a step computes, as the fsdp backend's number of ranks).
    """
    return attrs.field(default=default, metadata={"help": help, "secret": secret, "resumable": resumable}, **kwargs)


def missing_folder(model: str) -> bool:
    """Whether a model's name can only be a local folder, and none is there: a hub name is ``name`` or
    ``owner/name``, never absolute, relative to ``.`` or ``~``, deeper, or ending in ``/``."""
    path_like = Path(model).is_absolute() or model.startswith((".", "~")) or model.count("/") > 1 or model.endswith("/") or "\\" in model
    return path_like and not Path(model).expanduser().exists()


def is_secret(name: str, field: attrs.Attribute | None = None) -> bool:
    declared = field.metadata.get("secret") if field is not None else None
    return bool(SECRET_NAME.match(name)) if declared is None else declared


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
        # attrs' validators (in_, instance_of) raise with (message, attribute, ...): the message is the user's.
        reason = exc.args[0] if len(exc.args) > 1 and isinstance(exc.args[0], str) else exc
        raise PluginError(f"{label}: {reason}") from exc


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
        return _number(value, int, "an integer")
    if annotation is float:
        return _number(value, float, "a number")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise TypeError(f"expected a string, got {value!r}")
    if isinstance(annotation, type) and not isinstance(value, annotation):
        raise TypeError(f"expected {annotation.__name__}, got {value!r}")
    return value


def _number(value: Any, kind: type, expected: str) -> Any:
    """``value`` as an int or float; a bool is refused (True is no count), text is parsed, NaN and inf are refused."""
    if isinstance(value, bool):
        raise TypeError(f"expected {expected}, got {value!r}")
    if isinstance(value, int) or (kind is float and isinstance(value, float)):
        number = kind(value)
    elif isinstance(value, str):
        try:
            number = kind(value)
        except ValueError:
            raise ValueError(f"expected {expected}, got {value!r}") from None
    else:
        raise TypeError(f"expected {expected}, got {value!r}")
    if not math.isfinite(number):
        # No setting means anything by NaN or inf: `--grad-clip-norm nan` would silently not clip.
        raise ValueError(f"expected a finite number, got {value!r}")
    return number
