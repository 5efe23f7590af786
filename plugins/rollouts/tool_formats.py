"""How model families write tool calls, and how the ``multi_turn`` rollout reads them.

Each format reads a policy turn (decoded with its special tokens, less a final end-of-turn token)
into the calls it holds. A call that cannot be read is still a call: it carries the reason, which
the rollout answers as an ``error: ...`` tool message the policy sees (counted in
``tool/errors``), so a malformed call never stops a run.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

import attrs


@attrs.frozen
class ToolCall:
    """One call the policy wrote: a tool's name and arguments, or why it could not be read."""

    name: str | None = None
    arguments: dict[str, Any] | None = None
    error: str | None = None


class ToolFormat(Protocol):
    name: str
    stop: tuple[str, ...]
    """Stop strings that end a turn right after its call (the sampler keeps them)."""

    def calls(self, text: str) -> list[ToolCall]:
        """The calls in a turn; empty for a turn that is an answer."""
        ...


def call_from_object(call: Any, arguments_keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    """``{"name": ..., "arguments": {...}}`` (the arguments may be a JSON string) as a call."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(error='a tool call is a JSON object {"name": ..., "arguments": {...}}')
    name = call["name"]
    arguments = next((call[key] for key in arguments_keys if key in call), {})
    return call_with_arguments(name, arguments)


def call_with_arguments(name: str, arguments: Any) -> ToolCall:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return ToolCall(name=name, error=str(exc))
    if not isinstance(arguments, dict):
        return ToolCall(name=name, error=f"the arguments of {name} must be a JSON object")
    return ToolCall(name=name, arguments=arguments)


def call_from_json(text: str, arguments_keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    try:
        return call_from_object(json.loads(text), arguments_keys)
    except json.JSONDecodeError as exc:
        return ToolCall(error=str(exc))


def json_values(text: str) -> list[Any] | str:
    """The JSON values written one after another (separated by whitespace or ``;``), or why not."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as exc:
            return str(exc)
        values.append(value)


@attrs.frozen
class Hermes:
    """Hermes / Qwen 2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number."""

    name = "hermes"
    stop = ("</tool_call>",)
    pattern = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def calls(self, text: str) -> list[ToolCall]:
        return [
            call_from_json(body) if closed else ToolCall(error="the tool call is not closed with </tool_call>")
            for body, closed in self.pattern.findall(text)
        ]


@attrs.frozen
class Llama3:
    """Llama 3.1-3.3: a turn that is a JSON call ``{"name": ..., "parameters": {...}}`` (several
    separated by ``;``), or follows ``<|python_tag|>``. A turn that starts with ``{`` is read as
    calls; any other is an answer."""

    name = "llama3"
    stop = ()

    def calls(self, text: str) -> list[ToolCall]:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body.removeprefix("<|python_tag|>").strip()
        elif not body.startswith("{"):
            return []
        values = json_values(body)
        if isinstance(values, str):
            return [ToolCall(error=values)]
        return [call_from_object(v, ("parameters", "arguments")) for v in values] or [ToolCall(error="the tool call is empty")]


@attrs.frozen
class Mistral:
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3), or
    ``[TOOL_CALLS]name[ARGS]{...}`` once per call (Magistral, Mistral Small 3.2 and later)."""

    name = "mistral"
    stop = ()

    def calls(self, text: str) -> list[ToolCall]:
        if "[TOOL_CALLS]" not in text:
            return []
        calls = []
        for part in text.split("[TOOL_CALLS]")[1:]:
            part = part.strip()
            if "[ARGS]" in part:
                name, _, arguments = part.partition("[ARGS]")
                calls.append(call_with_arguments(name.strip(), arguments))
                continue
            values = json_values(part)
            if isinstance(values, str):
                calls.append(ToolCall(error=values))
            elif len(values) != 1 or not isinstance(values[0], list):
                calls.append(ToolCall(error="[TOOL_CALLS] is followed by a JSON list of calls, or name[ARGS]{...}"))
            else:
                calls += [call_from_object(v) for v in values[0]] or [ToolCall(error="the list of tool calls is empty")]
        return calls


@attrs.frozen
class DeepSeek:
    """DeepSeek V3 / R1: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` then the arguments in a
    ```json block, ``<｜tool▁call▁end｜>``; V3.1 and later write ``NAME<｜tool▁sep｜>{...}``. The calls
    sit between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``."""

    name = "deepseek"
    stop = ()
    begin, end, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    fenced = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)

    def calls(self, text: str) -> list[ToolCall]:
        if "<｜tool▁calls▁begin｜>" not in text:
            return []
        calls = []
        for part in text.split(self.begin)[1:]:
            body, closed, _ = part.partition(self.end)
            if not closed:
                calls.append(ToolCall(error=f"the tool call is not closed with {self.end}"))
                continue
            head, found, arguments = body.partition(self.sep)
            if not found:
                calls.append(ToolCall(error=f"a tool call is NAME{self.sep}{{arguments}}"))
                continue
            if head.strip() == "function":  # V3: function<sep>NAME\n```json\n{...}\n```
                name, _, arguments = arguments.partition("\n")
                fenced = self.fenced.match(arguments)
                if not fenced:
                    calls.append(ToolCall(name=name.strip(), error="the arguments of a tool call go in a ```json block"))
                    continue
                head, arguments = name, fenced.group(1)
            calls.append(call_with_arguments(head.strip(), arguments))
        return calls


@attrs.frozen
class Harmony:
    """gpt-oss (the harmony format): a message addressed to a function, on the commentary
    channel, ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``
    (the recipient may follow the role instead: ``<|start|>assistant to=functions.NAME<|channel|>``).
    A turn holds messages each opened by ``<|start|>`` (its first by the generation prompt):
    analysis, preambles, calls, the final answer; each addressed to a recipient other than the
    assistant is a call (``functions.`` dropped from its name; a call to a built-in tool such as
    ``python``, whose message is not JSON, is answered with an error)."""

    name = "harmony"
    stop = ("<|call|>",)
    recipient = re.compile(r"(?:^|\s)to=([^\s<]*)")
    message_end = re.compile(r"<\|(?:call|end|return)\|>")

    def calls(self, text: str) -> list[ToolCall]:
        calls = []
        for message in text.split("<|start|>"):
            header, has_body, body = message.partition("<|message|>")
            found = self.recipient.search(header)
            if not found or found.group(1) == "assistant":
                continue
            name = found.group(1).removeprefix("functions.")
            if not name:
                calls.append(ToolCall(error="a tool call is addressed to=functions.NAME"))
            elif not has_body:
                calls.append(ToolCall(name=name, error="the tool call has no <|message|> with its arguments"))
            else:
                calls.append(call_with_arguments(name, self.message_end.split(body)[0]))
        return calls


FORMATS = {f.name: f for f in (Hermes(), Llama3(), Mistral(), DeepSeek(), Harmony())}
MARKERS = (
    ("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<｜tool▁calls▁begin｜>", "deepseek"), ("<|channel|>", "harmony"),
    ("<|python_tag|>", "llama3"),
)  # fmt: skip
"""What in a chat template or a tokenizer's vocabulary shows a family's format, checked in order."""


def detect(template: str, added_tokens: Any) -> str | None:
    """The format a chat template (its text) or a tokenizer's added tokens (where the families'
    markers live) show, or None."""
    for marker, name in MARKERS:
        if marker in template:
            return name
    for marker, name in MARKERS:
        if marker in added_tokens:
            return name
    return None
