"""Rollouts driven by a scripted sampler, for the tests of the multi-turn rollout and its tool formats.

- ``ScriptedSampler(tokenizer, script)``: a sampler that answers each round from a script; a text ending
  in ``EOS`` ends with the eos token; its logprobs are ``policy_logprobs(n)``.
- ``ids(tokenizer, text)``: the token ids of ``text`` without special tokens.
- ``run(rollout, prompts, num_samples, sampler, ...)``: one rollout, its recorded metrics appended to ``RECORDED``.
- ``retry_math(**options)``: the ``retry_math`` environment as the rollout calls it.
- ``Endless``: an environment that never ends the episode; ``FakeTool``: a tool that records its calls.
"""

from __future__ import annotations

import json
import time
from typing import Any

import attrs

from grpo_core import Completion, SamplingParams, make_plugin
from grpo_core.metrics import Metrics, scope
from grpo_core.types import EnvStep


@attrs.define
class ScriptedSampler:
    """Answers each round of a rollout from a script: round r, conversation i -> a text, or
    (tokens, finish reason).

    A text ending in ``EOS`` ends with the tokenizer's eos token (finish "stop"); one ending in
    ``</tool_call>`` stops there ("stop", as the stop string does); any other is cut ("length"),
    as is a reply longer than the round's max_tokens. Each sampled token's logprob is
    -(its position + 1) / 100, so tests can find them.
    """

    tokenizer: Any
    script: list[list[str | tuple[list[int], str]]]
    max_context: int | None = None
    version: int = 0
    calls: list[tuple[list[list[int]], int, SamplingParams]] = attrs.field(factory=list)

    def sample(self, prompts, num_samples, params):
        round_ = self.script[len(self.calls)]
        self.calls.append(([list(p) for p in prompts], num_samples, params))
        replies = iter(round_)
        groups = []
        for _ in prompts:
            group = []
            for _ in range(num_samples):
                reply = next(replies)
                tokens, finish = reply if isinstance(reply, tuple) else self.encode(reply)
                if len(tokens) > params.max_tokens:
                    tokens, finish = tokens[: params.max_tokens], "length"
                group.append(Completion(tokens=tokens, logprobs=[-(i + 1) / 100 for i in range(len(tokens))], finish_reason=finish))
            groups.append(group)
        return groups

    def encode(self, text: str) -> tuple[list[int], str]:
        if text.endswith(EOS):
            return self.tokenizer(text[: -len(EOS)], add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id], "stop"
        tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return tokens, "stop" if text.endswith("</tool_call>") else "length"


EOS = "<EOS>"


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def policy_logprobs(n: int) -> list[float]:
    return [-(i + 1) / 100 for i in range(n)]


RECORDED: list[Metrics] = []
"""What each ``run`` below recorded for the step's metrics, the last one last."""


def run(rollout, prompts, num_samples, sampler, env=None, tools=None, max_tokens=32, **params):
    with scope() as recorded:
        groups = rollout.rollout(
            prompts=prompts, num_samples=num_samples, sampler=sampler,
            params=SamplingParams(max_tokens=max_tokens, **params), env=env, tools=tools or {},
        )  # fmt: skip
    RECORDED.append(recorded)
    return groups


def retry_math(**options):
    env = make_plugin("retry_math", **options)
    return lambda prompt: env.env_reset(prompt=prompt)


@attrs.define
class Endless:
    """An environment that never ends the episode and answers each turn with one short line."""

    messages: list = attrs.field(factory=lambda: [{"role": "user", "content": "Question: count\nAnswer:"}])
    steps: int = 0

    def step(self, text, tokens):
        self.steps += 1
        return EnvStep(messages=[{"role": "user", "content": "more\nAnswer:"}], reward=0.25)


@attrs.define
class FakeTool:
    name: str = "fake"
    delay: float = 0.0
    calls: list = attrs.field(factory=list)

    def tool_spec(self):
        return {"name": self.name, "description": "test", "parameters": {"type": "object", "properties": {}}}

    def tool_call(self, arguments):
        self.calls.append(arguments)
        if arguments.get("fail"):
            raise ValueError("asked to fail")
        time.sleep(self.delay)
        return f"got {json.dumps(arguments, sort_keys=True)}"
