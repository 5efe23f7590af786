"""The ``agent`` rollout: the user's own program, any OpenAI client, trained through the gateway."""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import attrs

from grpo_core import Completion, Prompt, Sample, SamplingParams, hookimpl, option
from grpo_core.async_loop import SharedSampler
from grpo_core.backend import Sampler
from grpo_core.config import RunConfig
from grpo_core.errors import PluginError
from grpo_core.images import has_images
from grpo_core.loss import validate_positive
from grpo_core.metrics import record
from grpo_core.plugins.rollouts.multi_turn import chat_template, decode, render, tool_format_name, without_end_of_turn
from grpo_core.plugins.rollouts.tool_formats import FORMATS, MARKERS, ToolFormat
from grpo_core.remote.gateway import Call, Gateway
from grpo_core.types import Turn


@attrs.frozen
class AgentChat:
    """How the gateway writes a chat request as the policy's prompt and reads its reply."""

    tokenizer: Any
    template: str | None
    """grpo-core's plain template, or None for the tokenizer's own."""
    tool_format: ToolFormat

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        return render(self.tokenizer, self.template, messages, tools)

    def stop(self, tools: list[dict[str, Any]]) -> list[str]:
        return list(self.tool_format.stop) if tools else []

    def reply(self, tokens: list[int], tools: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
        """The reply's text, or, where it holds tool calls that all read, what precedes them and the calls.

        A call that cannot be read leaves the reply as text: the program sees what the policy wrote."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if not tools:
            return text, []
        written = decode(self.tokenizer, without_end_of_turn(tokens, self.tokenizer))
        calls = self.tool_format.calls(written)
        if not calls or any(c.error is not None for c in calls):
            return text, []
        at = min((written.find(m) for m, name in MARKERS if name == self.tool_format.name and m in written), default=0)
        tool_calls = [
            {"id": f"call_{secrets.token_hex(8)}", "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in calls
        ]
        return written[:at].strip() or None, tool_calls


@attrs.define
class Outcome:
    """One program's run: its calls, its reward line, and why it failed (None: it did not)."""

    calls: list[Call]
    reward: float | None = None
    failure: str | None = None
    timed_out: bool = False


@attrs.define
class Segment:
    """Calls that extend each other, flattened as one trajectory."""

    tokens: list[int]
    logprobs: list[float]
    mask: list[float]
    turns: list[Turn] = attrs.field(factory=list)
    versions: list[int] = attrs.field(factory=list)
    finish_reason: str = "stop"


def segments_of(calls: Sequence[Call]) -> tuple[list[Segment], int]:
    """The calls as trajectories, and the prefix breaks: a call whose prompt extends the tokens of a
    trajectory so far (its prompts and replies) continues it, the tokens between the two untrained;
    any other call opens a trajectory of its own, a prefix break when one was open already."""
    segments: list[Segment] = []
    breaks = 0
    for call in calls:
        prompt = call.prompt_tokens
        segment = next((s for s in reversed(segments) if prompt[: len(s.tokens)] == s.tokens), None)
        if segment is None:
            breaks += bool(segments)
            segment = Segment(list(prompt), [0.0] * len(prompt), [0.0] * len(prompt))
            segments.append(segment)
        else:
            added = prompt[len(segment.tokens) :]
            segment.tokens += added
            segment.logprobs += [0.0] * len(added)
            segment.mask += [0.0] * len(added)
            segment.turns[-1].context_end = len(segment.tokens)
        start = len(segment.tokens)
        segment.tokens += call.tokens
        segment.logprobs += call.logprobs
        segment.mask += [1.0] * len(call.tokens)
        segment.turns.append(Turn(start=start, end=len(segment.tokens), context_end=len(segment.tokens)))
        segment.versions.append(call.version)
        segment.finish_reason = call.finish_reason
    return segments, breaks


def reward_line(stdout: str) -> tuple[float | None, str | None]:
    """The reward a program printed as its last stdout line, ``{"reward": x}``: (reward, None), (None, None)
    when the last line is no reward line, or (None, why) for a reward line whose reward is no number."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None, None
    try:
        printed = json.loads(lines[-1])
    except json.JSONDecodeError:
        return None, None
    if not isinstance(printed, dict) or "reward" not in printed:
        return None, None
    value = printed["reward"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None, f'its last stdout line {lines[-1][:200]} holds no finite number as "reward"'
    return float(value), None


@attrs.define
class AgentRollout:
    """Train an agent that is a program of its own: for each sample the run starts COMMAND, which
    samples from the policy through an OpenAI-compatible gateway with any OpenAI client, and trains
    on the tokens of every call it made (docs/agents.md).

    The program gets OPENAI_BASE_URL (the gateway, on 127.0.0.1 only), OPENAI_API_KEY (the run's
    key: a request without it is refused), OPENAI_MODEL (the served model's name) and GRPO_ROW
    (the dataset row as JSON: id, text or messages, answer, metadata). Its reward is the last line
    it prints, {"reward": x}, read by the agent reward (the default reward of this rollout); or
    --reward plugins score its final reply. A call whose prompt extends an earlier call's prompt and
    reply continues that trajectory (its tokens kept as sampled, what the program added untrained);
    any other opens a new one (agent/prefix_breaks), and every trajectory of a program is a sample
    with the program's reward. A program that exits non-zero, outlives its timeout (its process
    group is killed), makes no call or prints a malformed reward line is a failed sample: not
    trained on, counted in agent/failed, and stopping the run only when no program has succeeded.
    """

    command: str = option("", help="the program to run for each sample, as a command line (split like a shell, run without one)")
    timeout: float = option(
        300.0, help="seconds a program may run before its process group is killed (a failed sample)", validator=validate_positive
    )
    max_concurrent: int = option(8, help="most programs running at once", validator=validate_positive)
    template: Literal["auto", "tokenizer", "plain"] = option(
        "auto",
        help=(
            "the chat template chat requests are written with: the tokenizer's (an error if it has none), plain "
            "(contents in a row, answers closed by eos), or auto: the tokenizer's when it has one, else plain"
        ),
    )
    tool_format: Literal["auto", "hermes", "llama3", "mistral", "deepseek", "harmony"] = option(
        "auto",
        help=(
            "how the policy writes the tool calls a request with tools gets back as tool_calls (see the multi_turn "
            "rollout); auto: the one the chat template or the tokenizer's special tokens show, else hermes"
        ),
    )
    model_name: str = option("policy", help="the model name the gateway serves (OPENAI_MODEL); a request naming another is refused")
    override_sampling: bool = option(
        False,
        help=(
            "sample a request that sets temperature, top_p or top_k with the run's settings anyway (default: such a "
            "request is answered 400, since the policy trains on samples drawn as the run draws them)"
        ),
    )
    _gateway: Gateway | None = attrs.field(default=None, init=False, repr=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    _slots: threading.Semaphore = attrs.field(init=False, repr=False)
    _succeeded: int = attrs.field(default=0, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_concurrent)

    @property
    def argv(self) -> list[str]:
        try:
            argv = shlex.split(self.command)
        except ValueError as exc:
            raise PluginError(f"--rollout-opt command={self.command!r}: {exc}") from exc
        if not argv:
            raise PluginError('the agent rollout runs a program: pass --rollout-opt command="python my_agent.py"')
        return argv

    @hookimpl
    def check_config(self, config: RunConfig) -> None:
        program = self.argv[0]
        if shutil.which(program) is None:
            raise PluginError(f"--rollout-opt command: {program!r} is not a program found on PATH or at that path")
        if config.router_replay == "R3":
            raise PluginError("--router-replay R3 replays the sampler's routes, which the agent gateway does not record: use R2 or off")

    @hookimpl
    def rollout(self, prompts: Sequence[Prompt], num_samples: int, sampler: Sampler, params: SamplingParams) -> list[list[Sample]]:
        with_images = next((p for p in prompts if has_images(p)), None)
        if with_images is not None:
            raise PluginError(f"prompt {with_images.id} has images, which the agent rollout's gateway does not take (single_turn does)")
        tokenizer = sampler.tokenizer
        template = chat_template(tokenizer, self.template)
        chat = AgentChat(tokenizer, template, FORMATS[tool_format_name(tokenizer, template, self.tool_format)])
        shared = SharedSampler(sampler)

        def generate(tokens: list[int], call_params: SamplingParams) -> tuple[Completion, int]:
            # The version is the calling thread's: the oldest its generation used.
            shared.begin_rollout()
            completion = shared.sample([tokens], 1, call_params)[0][0]
            return completion, shared.version

        gateway = self.gateway()
        jobs = [prompt for prompt in prompts for _ in range(num_samples)]
        with ThreadPoolExecutor(max_workers=len(jobs) or 1, thread_name_prefix="grpo-core-agent") as pool:
            outcomes = list(pool.map(lambda p: self._run(gateway, p, generate, chat, params, sampler.max_context), jobs))
        return self._groups(prompts, num_samples, outcomes)

    def gateway(self) -> Gateway:
        """The run's gateway, started by the first rollout and closed at the end of the run."""
        with self._lock:
            if self._gateway is None:
                self._gateway = Gateway(self.model_name)
            return self._gateway

    @hookimpl
    def on_run_end(self) -> None:
        with self._lock:
            if self._gateway is not None:
                self._gateway.close()
                self._gateway = None

    def _run(
        self, gateway: Gateway, prompt: Prompt, generate: Any, chat: AgentChat, params: SamplingParams, max_context: int | None
    ) -> Outcome:
        """Run the program for one sample, bounded by its timeout; a session of its own records its calls."""
        with self._slots:
            session = gateway.open(generate, chat, params, max_context, self.override_sampling)
            env = {
                **os.environ,
                "OPENAI_BASE_URL": gateway.base_url(session),
                "OPENAI_API_KEY": gateway.key,
                "OPENAI_MODEL": self.model_name,
                "GRPO_ROW": json.dumps(row_of(prompt), default=str),
            }
            timed_out, stdout = False, None
            try:
                process = subprocess.Popen(
                    self.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    start_new_session=True, text=True, errors="replace",
                )  # fmt: skip
            except OSError as exc:
                gateway.end(session)
                return Outcome([], failure=f"it could not start: {exc}")
            try:
                stdout, stderr = process.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                # Past the deadline: its own, or that of what it started and left holding its output.
                timed_out = process.poll() is None
            finally:
                # Its own process group: what it started ends with it.
                with contextlib.suppress(ProcessLookupError, PermissionError):  # the group has ended already
                    os.killpg(process.pid, signal.SIGKILL)
            if stdout is None:  # its output, once nothing holds it any more
                stdout, stderr = process.communicate()
            calls = gateway.end(session)
        if session.error is not None:
            # The sampler's (or the gateway's) error, not the program's: raised as a rollout's own would be.
            raise session.error
        reward, bad_reward = reward_line(stdout)
        failure = (
            f"it ran past its timeout of {self.timeout:g} s" if timed_out
            else f"it exited with {_exit(process.returncode)}{_last_line(stderr)}" if process.returncode != 0
            else bad_reward if bad_reward is not None
            else "it made no call to the gateway" if not calls
            else None
        )  # fmt: skip
        return Outcome(calls, reward, failure, timed_out)

    def _groups(self, prompts: Sequence[Prompt], num_samples: int, outcomes: list[Outcome]) -> list[list[Sample]]:
        """Each prompt's samples: every trajectory of each program that succeeded; the metrics of all."""
        groups: list[list[Sample]] = []
        breaks = 0
        for index, prompt in enumerate(prompts):
            group: list[Sample] = []
            for outcome in outcomes[index * num_samples : (index + 1) * num_samples]:
                if outcome.failure is not None:
                    print(f"agent: a program for prompt {prompt.id} failed: {outcome.failure}", file=sys.stderr)
                    continue
                segments, broken = segments_of(outcome.calls)
                breaks += broken
                final = outcome.calls[-1].content or ""
                group += [
                    Sample(
                        prompt=prompt,
                        tokens=s.tokens,
                        sampling_logprobs=s.logprobs,
                        loss_mask=s.mask,
                        text=final,
                        finish_reason=s.finish_reason,
                        policy_version=min(s.versions),
                        turns=s.turns,
                        env_reward=outcome.reward,
                    )  # fmt: skip
                    for s in segments
                ]
            groups.append(group)
        failed = [o for o in outcomes if o.failure is not None]
        n = max(len(outcomes), 1)
        record("agent/calls_mean", sum(len(o.calls) for o in outcomes) / n, "mean", weight=len(outcomes))
        record("agent/completion_tokens_mean", sum(len(c.tokens) for o in outcomes for c in o.calls) / n, "mean", weight=len(outcomes))
        record("agent/failed", len(failed), "sum")
        record("agent/timeouts", sum(o.timed_out for o in outcomes), "sum")
        record("agent/prefix_breaks", breaks, "sum")
        with self._lock:
            self._succeeded += len(outcomes) - len(failed)
            succeeded = self._succeeded
        if failed and len(failed) == len(outcomes) and not succeeded:
            raise PluginError(
                f"every agent program failed ({len(failed)} of {len(outcomes)}; {sum(o.timed_out for o in failed)} timed out) and none "
                f"has succeeded in this run; the last: {failed[-1].failure}"
            )
        return groups


def row_of(prompt: Prompt) -> dict[str, Any]:
    """The dataset row as the program reads it from GRPO_ROW."""
    row: dict[str, Any] = {"id": prompt.id, "text": prompt.text, "messages": prompt.messages, "answer": prompt.answer}
    return {**{k: v for k, v in row.items() if v is not None}, "metadata": prompt.metadata}


def _exit(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def _last_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return f": {lines[-1][:300]}" if lines else ""
