"""A number-guessing game where every question narrows the answer: the information task for IGPO."""

from __future__ import annotations

import re
from typing import Any

import attrs

from grpo_core import PluginError, Prompt, hookimpl, option
from grpo_core.types import EnvStep

QUESTION = re.compile(r"Is it more than (-?\d+)\?")
ANSWER = re.compile(r"It is (-?\d+)\.")
HELP = "Ask: Is it more than N? Or say: It is N."


@attrs.define
class GuessNumberEnv:
    """Guess the number: the row's answer is a hidden integer in [low, high].

    Each turn the policy either asks "Is it more than N?" (answered "Yes." or "No.") or
    answers "It is N." (reward 1.0 when N is the hidden number, else 0.0; the episode ends).
    Anything else gets a reminder of the two forms. An episode that has not answered after
    ``max_turns`` turns ends with reward 0.0. Binary search wins within
    ceil(log2(high − low + 1)) questions; each question's answer raises the chance of the
    right guess, which is what IGPO (``--advantage igpo --advantage-opt
    "answer_template=It is {answer}."``) rewards turn by turn.
    """

    low: int = option(1, help="smallest number the game may hide")
    high: int = option(16, help="largest number the game may hide")
    max_turns: int = option(6, help="turns after which an episode without an answer ends with reward 0")

    def __attrs_post_init__(self) -> None:
        if self.high <= self.low:
            raise ValueError(f"high ({self.high}) must be larger than low ({self.low})")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {self.max_turns}")

    @hookimpl
    def env_reset(self, prompt: Prompt) -> GuessNumberEpisode:
        try:
            secret = int(str(prompt.answer).strip())
        except ValueError:
            raise PluginError(f"guess_number: the answer of prompt {prompt.id} must be an integer, got {prompt.answer!r}") from None
        if not self.low <= secret <= self.high:
            raise PluginError(f"guess_number: the answer of prompt {prompt.id} ({secret}) is outside [{self.low}, {self.high}]")
        return GuessNumberEpisode(secret=secret, low=self.low, high=self.high, max_turns=self.max_turns)


@attrs.define
class GuessNumberEpisode:
    """One game: the hidden number and the turns taken so far."""

    secret: int
    low: int
    high: int
    max_turns: int
    turns: int = 0
    messages: list[dict[str, Any]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.messages = [{"role": "user", "content": opening(self.low, self.high)}]

    def step(self, text: str, tokens: list[int]) -> EnvStep:
        self.turns += 1
        said = text.strip()
        guess = ANSWER.fullmatch(said)
        if guess:
            return EnvStep(messages=[], reward=float(int(guess.group(1)) == self.secret), done=True)
        out_of_turns = self.turns >= self.max_turns
        question = QUESTION.fullmatch(said)
        reply = ("Yes." if self.secret > int(question.group(1)) else "No.") if question else HELP
        return EnvStep(messages=[{"role": "user", "content": reply}], reward=0.0, done=out_of_turns)


def opening(low: int, high: int) -> str:
    return f"Guess my number from {low} to {high}."
