"""The ``verifiers`` environment: a taskset or an environment of the ``verifiers`` package (0.4,
``verifiers.v1``) as a grpo-core environment, its tasks' own rewards as the reward.

verifiers 0.4 runs an environment as ``Env.run(task, agents)``: a coroutine that plays its agent
seats through ``agent.run(task)`` or ``agent.interaction(task)``, whose ``turn(message)`` hands
the seat the next user message and returns its reply (TextArena games step their engine this
way). Here the one seat is grpo-core's policy: each ``turn`` the environment takes becomes an
observation of the ``multi_turn`` rollout, and the policy's sampled turn is the reply, so the
rollout keeps sampling token-in/token-out with its own chat template. verifiers' own agents
instead reach a model through a harness program (a uv script talking to an OpenAI-compatible
endpoint), which this adapter does not run: no harness, so no MCP tool servers.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import importlib
import json
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
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


def verifiers() -> Any:
    return import_extra("verifiers.v1", "verifiers", "the verifiers environment")


@attrs.define
class VerifiersEnv:
    """A verifiers taskset (``taskset``) or environment (``environment``): each dataset row names
    one of its tasks (field ``verifiers_idx``; write the rows with ``python -m
    grpo_core.plugins.envs.verifiers MODULE:NAME rows.jsonl``, or ``--environment ID rows.jsonl``).
    The conversation opens with the task's system prompt and prompt. With a taskset, the policy's
    answer ends the episode; with an environment, its ``Env.run`` plays the conversation, each of
    its seat's turns one policy turn (verifiers' multi-turn protocol; the seat's ``max_turns``
    holds). The task's ``@vf.reward`` functions and judges (``Task.score``), with what the
    environment records, make the episode's reward, given when it ends. Needs the ``verifiers``
    extra. Not adapted (refused): tasks with MCP tool servers or ``@vf.stop``/``@vf.intercept``
    hooks (they act in verifiers' harness programs and model endpoint, which the policy does not
    use), environments with several seats (a modeled user, a judge agent), with token limits on
    their seat, or that run their seat more than once per task.
    """

    taskset: str = option(
        "", help="MODULE:NAME, NAME a verifiers Taskset class (built with its default config) or a function returning a taskset"
    )
    environment: str = option(
        "",
        help=(
            "instead of taskset: a verifiers environment id (verifiers' --env.taskset.id: a module exporting its Taskset, "
            "and its Env when it has one, via __all__), built with its default config; its Env plays the conversation"
        ),
    )

    tasks: list[Any] = attrs.field(init=False, repr=False)
    env: Any = attrs.field(init=False, repr=False)
    """The verifiers Env playing each task, or None (a taskset: one policy turn)."""
    loop: EventLoop | None = attrs.field(init=False, default=None, repr=False)
    rollout_turns: int | None = attrs.field(init=False, default=None, repr=False)
    """The multi_turn rollout's max_turns: the policy turn after which the rollout stops asking."""

    def __attrs_post_init__(self) -> None:
        if self.environment:
            if self.taskset:
                raise PluginError("verifiers: give taskset or environment, not both")
            self.env = load_environment(self.environment)
            check_seat(self.env)
            self.tasks = bounded_tasks(self.env.taskset, self.environment)
        else:
            self.env = None
            self.tasks = load_tasks(self.taskset)

    @hookimpl
    def on_run_start(self, config: Any) -> None:
        if config.rollout == "multi_turn":
            from grpo_core.plugins.rollouts.multi_turn import MultiTurnRollout  # noqa: PLC0415 (its default, read where it is set)

            turns = config.options_for("rollout", "multi_turn").get("max_turns", attrs.fields(MultiTurnRollout).max_turns.default)
            self.rollout_turns = int(turns)

    @hookimpl
    def env_reset(self, prompt: Prompt) -> VerifiersEpisode:
        index = (prompt.metadata or {}).get(INDEX_FIELD)
        spec = self.environment or self.taskset
        if not isinstance(index, int) or isinstance(index, bool):
            raise PluginError(
                f"verifiers: row {prompt.id} has no integer field '{INDEX_FIELD}' naming its task; write the rows with "
                f"python -m grpo_core.plugins.envs.verifiers {'--environment ' if self.environment else ''}{spec} rows.jsonl"
            )
        if not 0 <= index < len(self.tasks):
            kind = "environment" if self.environment else "taskset"
            raise PluginError(f"verifiers: row {prompt.id} names task {index}, but the {kind} {spec} has {len(self.tasks)}")
        if self.loop is None:
            self.loop = EventLoop()
        return VerifiersEpisode(self.loop, self.tasks[index], self.env, self.rollout_turns)


class EventLoop:
    """A thread running the event loop the episodes' coroutines share: a rollout waits on an
    episode from plain code, and may leave one unfinished (its conversation cut short)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="grpo-core-verifiers", daemon=True).start()


class Channel:
    """Where an episode's seat asks for the policy's reply: the messages it hands over, and the
    future the reply goes into."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.out_of_turns = False
        """The rollout takes no more policy turns: the seat's next turn ends the exchange."""
        self.ended_out_of_turns = False
        """The seat asked for a turn the rollout no longer takes: the rollout's max_turns ended the exchange."""
        self.asked: concurrent.futures.Future[tuple[list[dict[str, Any]], asyncio.Future[str]]] = concurrent.futures.Future()

    async def ask(self, messages: list[dict[str, Any]]) -> str:
        reply = self.loop.create_future()
        self.asked.set_result((messages, reply))
        return await reply


class VerifiersEpisode:
    """One task played to its end: each seat turn's new messages are an observation, the
    policy's turn its reply; the reward comes when the environment's run is over."""

    scored_at_end = True
    """The task's rubric scores the conversation when the run is over: one the rollout cuts short on
    its token budget is unscored (None, counted as failed), not 0.0."""

    def __init__(self, loop: EventLoop, task: Any, env: Any, rollout_turns: int | None = None) -> None:
        check_task(task)
        self.loop = loop.loop
        self.rollout_turns = rollout_turns
        self.turns = 0
        self.channel = Channel(self.loop)
        self.play = asyncio.run_coroutine_threadsafe(play(task, env, self.channel), self.loop)
        # A conversation the rollout ends early leaves its run waiting for a reply: cancel it.
        weakref.finalize(self, self.play.cancel)
        self.messages, done = self.advance()
        if done:
            raise PluginError(f"verifiers: task {task.data.idx} ended before the policy's first turn")

    def step(self, text: str, tokens: list[int]) -> EnvStep:
        _, reply = self.channel.asked.result()
        self.channel.asked = concurrent.futures.Future()
        self.turns += 1
        # The rollout's last turn: end the exchange as verifiers ends a seat out of turns (its
        # next turn() comes back terminated), so the environment's run, finalize and the task's
        # rubric score the conversation instead of leaving it unscored.
        self.channel.out_of_turns = self.rollout_turns is not None and self.turns >= self.rollout_turns
        self.loop.call_soon_threadsafe(reply.set_result, text)
        messages, done = self.advance()
        cut = done and self.channel.ended_out_of_turns
        return EnvStep(messages=messages, reward=self.play.result() if done else 0.0, done=done, cut_at_max_turns=cut)

    def advance(self) -> tuple[list[dict[str, Any]], bool]:
        """The seat's next messages, or the run's end."""
        concurrent.futures.wait([self.channel.asked, self.play], return_when=concurrent.futures.FIRST_COMPLETED)
        if self.channel.asked.done():
            return self.channel.asked.result()[0], False
        self.play.result()  # the run's error, if it failed
        return [], True


async def play(task: Any, env: Any, channel: Channel) -> float:
    """The environment's run of one task, its one seat played through ``channel``; the seat's reward."""
    vf = verifiers()
    config = env.config if env is not None else vf.SingleAgentEnvConfig()
    traces: list[Any] = []
    check_seat(env)
    agents = vf.Agents(config, lambda name, spec: PolicySeat(channel, spec, traces))
    try:
        if env is None:
            await agents.agent.run(task)
        else:
            await env.setup(agents)
            await env.run(task, agents)
            episode = vf.Episode(env=vf.EnvInfo(id=env.config.env_id), task=trace_task(task), traces=traces)
            await env.finalize(task, episode)
    except PluginError:
        raise
    except Exception as exc:  # noqa: BLE001 - the environment's own code: the run must say which task failed and why
        raise PluginError(f"verifiers: task {task.data.idx}: {type(exc).__name__}: {exc}") from exc
    if not traces:
        raise PluginError(f"verifiers: {type(env).__name__}.run() ended task {task.data.idx} without a turn of its seat")
    return float(traces[0].reward)


LIMITS = ("max_input_tokens", "max_output_tokens", "max_total_tokens")
"""A seat's token limits: verifiers counts them at its model endpoint, which the policy does not use."""


def check_seat(env: Any) -> None:
    """An environment the adapter can play: one seat (the policy), no token limits on it."""
    from verifiers.v1.configs.agent import agent_config_fields  # noqa: PLC0415 (optional extra)

    if env is None:
        return
    seats = agent_config_fields(env.config)
    if len(seats) != 1:
        raise PluginError(
            f"verifiers: {type(env).__name__} has seats {', '.join(seats)}; only environments with one seat (the policy) are adapted"
        )
    ((name, seat),) = seats.items()
    if limits := [limit for limit in LIMITS if getattr(seat, limit) is not None]:
        raise PluginError(
            f"verifiers: {type(env).__name__}'s seat {name} sets {', '.join(limits)}, which are not adapted "
            "(limit the policy's tokens with --max-completion-tokens and --rollout-opt max_total_tokens)"
        )


def check_task(task: Any) -> None:
    """A task the adapter can play: no tools or hooks that act where verifiers' harness calls its model."""
    from verifiers.v1.utils.decorators import discover_decorated  # noqa: PLC0415 (optional extra)

    unadapted = [
        what
        for what, present in (
            ("MCP tool servers (Task.toolsets)", type(task).toolsets(task.config)),
            ("@vf.stop hooks", task.hooks("stop")),
            ("@vf.intercept hooks", discover_decorated(task, "intercept")),
        )
        if present
    ]
    if unadapted:
        raise PluginError(
            f"verifiers: task {task.data.idx} ({type(task).__name__}) has {', '.join(unadapted)}, which act in verifiers' "
            "harness and model endpoint; not adapted (grpo-core's own tools: --tool NAME)"
        )


def trace_task(task: Any) -> Any:
    return verifiers().TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash)


class PolicySeat:
    """An environment's seat played by the policy (what ``Env.run`` calls ``agents.NAME``)."""

    def __init__(self, channel: Channel, config: Any, traces: list[Any]) -> None:
        self.channel = channel
        self.config = config
        self.traces = traces
        self.trainable = True

    async def run(self, task: Any) -> Any:
        """One policy turn on the task's prompt, scored."""
        if task.data.prompt is None:
            raise PluginError(f"verifiers: task {task.data.idx} has no prompt (a task the user opens needs an Env that opens it)")
        async with self.interaction(task) as chat:
            await chat.turn()
        return chat.trace

    @asynccontextmanager
    async def interaction(self, task: Any) -> AsyncIterator[PolicyInteraction]:
        if self.traces:
            raise PluginError("verifiers: the environment runs its seat more than once per task; one conversation per task is adapted")
        chat = PolicyInteraction(self.channel, task, self.config)
        self.traces.append(chat.trace)
        yield chat
        await chat.close()


class PolicyInteraction:
    """verifiers' ``Interaction`` with the policy as the model: each ``turn`` is one policy turn."""

    def __init__(self, channel: Channel, task: Any, config: Any) -> None:
        vf = verifiers()
        from verifiers.v1.state import state_cls  # noqa: PLC0415 (optional extra)

        self.channel = channel
        self.task = task
        self.trace = vf.Trace(task=trace_task(task), state=state_cls(type(task))(), agent=vf.AgentInfo(config=config))
        self.max_turns = config.max_turns
        self.over = False

    async def turn(self, message: Any = None) -> Any:
        """The policy's reply to ``message`` (the task's prompt opens a prompted task: a bare ``turn()``)."""
        vf = verifiers()
        opened = bool(self.trace.nodes)
        prompted = not opened and self.task.data.prompt is not None
        if self.over:
            raise RuntimeError("the exchange is over (the seat's max_turns); read interaction.trace")
        if (message is None) == (not prompted):
            raise ValueError("a prompted task's first turn is a bare turn(); every other turn hands the seat a message")
        new = [] if opened else opening(self.task)
        if isinstance(message, str):
            new.append({"role": "user", "content": message})
        elif message is not None:
            new += [wire(m) for m in message]
        if self.channel.out_of_turns or (self.max_turns is not None and self.trace.num_turns >= self.max_turns):
            self.channel.ended_out_of_turns = self.channel.out_of_turns
            self.over = True
            return vf.Segment(messages=[], terminated=True)
        for m in new:
            self.add(m, sampled=False)
        reply = await self.channel.ask(new)
        self.add({"role": "assistant", "content": reply}, sampled=True)
        return vf.Segment(messages=[self.trace.nodes[-1].message])

    def add(self, message: dict[str, Any], sampled: bool) -> None:
        vf = verifiers()
        from verifiers.v1.graph import MessageNode  # noqa: PLC0415 (optional extra)

        typed = dict(zip(ROLES, (vf.SystemMessage, vf.UserMessage, vf.AssistantMessage)))[message["role"]]
        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(MessageNode(parent=parent, message=typed(content=message["content"]), sampled=sampled))

    async def close(self) -> None:
        """The exchange is over: the task scores it (verifiers' rollout does this at close)."""
        try:
            await self.task.score(self.trace)
        except verifiers().TaskError as exc:
            raise PluginError(f"verifiers: scoring task {self.task.data.idx} failed: {exc}") from None


def wire(message: Any) -> dict[str, Any]:
    """A message an environment hands its seat (a typed verifiers message or a dict) as a chat message."""
    raw = message if isinstance(message, dict) else message.model_dump(include={"role", "content"})
    if raw.get("role") not in ROLES or not isinstance(raw.get("content"), str):
        raise PluginError(f"verifiers: a seat's turn may hand it {', '.join(ROLES)} messages with text content, got {raw!r}")
    return {"role": raw["role"], "content": raw["content"]}


def load_tasks(spec: str) -> list[Any]:
    """The tasks of the taskset ``MODULE:NAME`` names, in the taskset's order."""
    vf = verifiers()
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise PluginError(
            f"verifiers: taskset must be MODULE:NAME (a Taskset class or a function returning one), got {spec!r}; "
            "or name a verifiers environment with environment=ID"
        )
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
    return bounded_tasks(taskset, spec)


def bounded_tasks(taskset: Any, spec: str) -> list[Any]:
    if not taskset.bounded:
        raise PluginError(f"verifiers: the taskset {spec} is infinite; bound it (taskset.take(N)) in a function and name that")
    tasks = list(taskset)
    if not tasks:
        raise PluginError(f"verifiers: the taskset {spec} has no tasks")
    return tasks


def load_environment(env_id: str) -> Any:
    """The verifiers Env of the environment ``env_id``, through verifiers' own loader."""
    vf = verifiers()
    try:
        return vf.load_environment(vf.resolve_env_config({"taskset": {"id": env_id}}))
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise PluginError(f"verifiers: cannot load environment {env_id}: {exc}") from None


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
    return messages


def rows(taskset: str = "", environment: str = "") -> list[dict[str, Any]]:
    """The dataset rows of a taskset or an environment's: each task's opening messages and its index."""
    tasks = VerifiersEnv(taskset=taskset, environment=environment).tasks
    return [{"messages": opening(task), INDEX_FIELD: index} for index, task in enumerate(tasks)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m grpo_core.plugins.envs.verifiers",
        description="Write a verifiers taskset's (or environment's) rows as a JSONL dataset.",
    )
    parser.add_argument("taskset", nargs="?", default="", help="MODULE:NAME, as the env's taskset option")
    parser.add_argument("output", type=Path, help="the JSONL file to write")
    parser.add_argument("--environment", default="", help="a verifiers environment id, as the env's environment option")
    args = parser.parse_args(argv)
    try:
        written = rows(args.taskset, args.environment)
    except PluginError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    args.output.write_text("".join(json.dumps(row) + "\n" for row in written))
    print(f"{len(written)} rows written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
