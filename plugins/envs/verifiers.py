"""The ``verifiers`` environment: a taskset of the ``verifiers`` package (0.4, ``verifiers.v1``)
as a grpo-core environment, its tasks' own rewards as the reward."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from grpo_core import Prompt, hookimpl, option
from grpo_core.data import import_extra
from grpo_core.errors import PluginError
from grpo_core.types import EnvStep

ROLES = ("system", "user", "assistant")
"""The message roles a task may open with (a prompt's tool message would need its call's id)."""

INDEX_FIELD = "verifiers_idx"
"""The dataset row's field naming its task: the task's position in the taskset."""


@attrs.define
class VerifiersEnv:
    """A verifiers taskset (``verifiers.v1.Taskset``, the data half of a verifiers environment):
    each dataset row names one of its tasks (field ``verifiers_idx``; write the rows with
    ``python -m grpo_core.plugins.envs.verifiers MODULE:NAME rows.jsonl``). The conversation opens
    with the task's system prompt and prompt; the policy's answer ends the episode and is scored
    by the task's own ``@vf.reward`` functions and judges (``Task.score``), their weighted sum
    being the env reward. Needs the ``verifiers`` extra. verifiers' multi-turn protocol (an
    ``Env.run`` driving agents, tools served over MCP) is not adapted: one policy turn per task.
    """

    taskset: str = option(
        "", help="MODULE:NAME, NAME a verifiers Taskset class (built with its default config) or a function returning a taskset"
    )

    tasks: list[Any] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self.tasks = load_tasks(self.taskset)

    @hookimpl
    def env_reset(self, prompt: Prompt) -> VerifiersEpisode:
        index = (prompt.metadata or {}).get(INDEX_FIELD)
        if not isinstance(index, int) or isinstance(index, bool):
            raise PluginError(
                f"verifiers: row {prompt.id} has no integer field '{INDEX_FIELD}' naming its task; write the rows with "
                f"python -m grpo_core.plugins.envs.verifiers {self.taskset} rows.jsonl"
            )
        if not 0 <= index < len(self.tasks):
            raise PluginError(f"verifiers: row {prompt.id} names task {index}, but the taskset {self.taskset} has {len(self.tasks)}")
        return VerifiersEpisode(self.tasks[index])


@attrs.define
class VerifiersEpisode:
    """One task: its opening messages, then the policy's answer scored by the task."""

    task: Any
    messages: list[dict[str, Any]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.messages = opening(self.task)

    def step(self, text: str, tokens: list[int]) -> EnvStep:
        return EnvStep(messages=[], reward=score(self.task, [*self.messages, {"role": "assistant", "content": text}]), done=True)


def load_tasks(spec: str) -> list[Any]:
    """The tasks of the taskset ``MODULE:NAME`` names, in the taskset's order."""
    vf = import_extra("verifiers.v1", "verifiers", "the verifiers environment")
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise PluginError(f"verifiers: taskset must be MODULE:NAME (a Taskset class or a function returning one), got {spec!r}")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"verifiers: cannot load taskset {spec}: {exc}") from None
    if isinstance(found, type) and issubclass(found, vf.Taskset):
        from verifiers.v1.utils.generic import concrete_type  # noqa: PLC0415 (optional extra)

        taskset = found((concrete_type(found, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig)())
    elif callable(found) and not isinstance(found, type):
        taskset = found()
    else:
        taskset = found
    if not isinstance(taskset, vf.Taskset):
        raise PluginError(f"verifiers: {spec} is {taskset!r}, not a verifiers Taskset (verifiers.v1.Taskset)")
    if not taskset.bounded:
        raise PluginError(f"verifiers: the taskset {spec} is infinite; bound it (taskset.take(N)) in a function and name that")
    tasks = list(taskset)
    if not tasks:
        raise PluginError(f"verifiers: the taskset {spec} has no tasks")
    return tasks


def opening(task: Any) -> list[dict[str, Any]]:
    """The task's system prompt and prompt as chat messages."""
    data = task.data
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages += [m.model_dump(include={"role", "content"}) for m in data.prompt]
        if roles := {m["role"] for m in messages} - set(ROLES):
            raise PluginError(
                f"verifiers: task {data.idx} opens with {', '.join(sorted(roles))} messages; only {', '.join(ROLES)} are adapted"
            )
    else:
        raise PluginError(f"verifiers: task {data.idx} has no prompt (a task the user opens needs verifiers' own Env.run)")
    return messages


def score(task: Any, messages: Sequence[dict[str, Any]]) -> float:
    """The task's weighted reward for the conversation, through its own ``Task.score``."""
    vf = import_extra("verifiers.v1", "verifiers", "the verifiers environment")
    from verifiers.v1.graph import MessageNode  # noqa: PLC0415 (optional extra)

    typed = dict(zip(ROLES, (vf.SystemMessage, vf.UserMessage, vf.AssistantMessage)))
    nodes = [
        MessageNode(parent=i - 1 if i else None, message=typed[m["role"]](content=m["content"]), sampled=m["role"] == "assistant")
        for i, m in enumerate(messages)
    ]
    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data), agent=vf.AgentInfo(config=vf.AgentConfig()), nodes=nodes)
    try:
        asyncio.run(task.score(trace))
    except vf.TaskError as exc:
        raise PluginError(f"verifiers: scoring task {task.data.idx} failed: {exc}") from None
    return float(trace.reward)


def rows(spec: str) -> list[dict[str, Any]]:
    """The dataset rows of a taskset: each task's opening messages and its index."""
    return [{"messages": opening(task), INDEX_FIELD: index} for index, task in enumerate(load_tasks(spec))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m grpo_core.plugins.envs.verifiers", description="Write a verifiers taskset's rows as a JSONL dataset."
    )
    parser.add_argument("taskset", help="MODULE:NAME, as the env's taskset option")
    parser.add_argument("output", type=Path, help="the JSONL file to write")
    args = parser.parse_args(argv)
    try:
        written = rows(args.taskset)
    except PluginError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    args.output.write_text("".join(json.dumps(row) + "\n" for row in written))
    print(f"{len(written)} rows written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
