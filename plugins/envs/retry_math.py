"""The ``retry_math`` environment: answer, hear "incorrect, try again", answer again."""

from __future__ import annotations

from typing import Any

import attrs

from grpo_core import Prompt, hookimpl, option
from grpo_core.errors import PluginError
from grpo_core.plugins.rewards.gsm8k import score
from grpo_core.types import EnvStep


def _positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


def _unit(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1], got {value}")


@attrs.define
class RetryMathEnv:
    """A math question answered in up to max_turns tries: a wrong answer is told the feedback
    ("Incorrect, try again.") and, with restate, the question again. A right answer (the final
    number, as the gsm8k reward reads it, equal to the row's) ends the episode with reward
    discount**(tries - 1); no right answer in max_turns tries earns 0.
    """

    needs_answer = True
    """Not an option: every dataset row needs a reference answer."""

    max_turns: int = option(3, help="tries the policy gets", validator=_positive)
    discount: float = option(0.5, help="a right answer at try t earns discount**(t-1)", validator=_unit)
    feedback: str = option("Incorrect, try again.", help="what a wrong answer is told")
    restate: bool = option(True, help="repeat the question after the feedback (a small model answers the question it sees last)")
    strict: bool = option(False, help="require an explicit answer marker (#### or \\boxed{}), as gsm8k's strict")

    @hookimpl
    def env_reset(self, prompt: Prompt) -> RetryMathEpisode:
        if prompt.answer is None:
            raise PluginError(f"retry_math: prompt {prompt.id} has no reference answer")
        messages = [dict(m) for m in prompt.messages] if prompt.messages is not None else [{"role": "user", "content": prompt.text}]
        question = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
        return RetryMathEpisode(messages=messages, env=self, answer=prompt.answer, question=question)


@attrs.define
class RetryMathEpisode:
    messages: list[dict[str, Any]]
    env: RetryMathEnv
    answer: str
    question: str
    tries: int = 0

    def step(self, text: str, tokens: list[int]) -> EnvStep:
        self.tries += 1
        if score(text, self.answer, self.env.strict) == 1.0:
            return EnvStep(messages=[], reward=self.env.discount ** (self.tries - 1), done=True)
        if self.tries >= self.env.max_turns:
            return EnvStep(messages=[], reward=0.0, done=True)
        content = f"{self.env.feedback}\n{self.question}" if self.env.restate else self.env.feedback
        return EnvStep(messages=[{"role": "user", "content": content}])
