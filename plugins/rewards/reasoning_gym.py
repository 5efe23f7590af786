from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from grpo_core import PluginError, Prompt, Sample, hookimpl, option
from grpo_core.data import import_extra
from grpo_core.plugins.rewards import gsm8k

ANSWER_FORMATS = ("tag", "number")


def _tag_name(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not re.fullmatch(r"[A-Za-z_][\w.-]*", value):
        raise ValueError(f"{attribute.name} must be a tag name such as answer, got {value!r}")


@attrs.define
class ReasoningGymReward:
    """A reasoning-gym task's own scorer: the score its ``score_answer`` gives the completion's answer.

    The answer is the text inside the completion's last <answer>...</answer> pair, stripped
    (reasoning-gym's ``extract_answer``; answer_tag names another tag), or, with
    ``answer_format=number``, the completion's final number as the gsm8k reward reads it
    (``#### N``, ``The answer is N``, ``\\boxed{N}``, else its last number): for tasks whose
    answers are numbers and policies that do not write tags (the embedded model writes
    ``#### N``). A completion without an answer scores 0, and so does an answer the task's scorer raises on (a few parse it without
    checking: prime_factorization, boxnet). The scorer is that of the task named by the row's
    ``metadata.source_dataset``, given the row as the entry it scores: the rows of
    ``--dataset reasoning_gym:TASK`` are such entries, and so are reasoning-gym entries written
    to a JSONL file. A right answer scores 1.0, a wrong one 0.0; some tasks give partial credit
    for a near answer.

    Needs the reasoning-gym extra: pip install 'grpo-core[reasoning-gym]'.
    """

    needs_answer = False

    answer_tag: str = option("answer", help="the tag around the final answer: <answer_tag>...</answer_tag>", validator=_tag_name)
    answer_format: str = option(
        "tag",
        help="tag: the text inside the last answer_tag pair; number: the final number as the gsm8k reward reads it (#### N, ...)",
        validator=attrs.validators.in_(ANSWER_FORMATS),
    )
    _reasoning_gym: Any = attrs.field(init=False, default=None)
    _scorers: dict[str, Callable[[str | None, dict[str, Any]], float]] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.answer_format == "number" and self.answer_tag != "answer":
            raise PluginError("reasoning_gym reward: answer_tag is read only with answer_format=tag; drop one of them")
        self._reasoning_gym = import_extra("reasoning_gym", "reasoning-gym", "the reasoning_gym reward")

    def _scorer(self, prompt: Prompt) -> Callable[[str | None, dict[str, Any]], float]:
        task = (prompt.metadata or {}).get("metadata", {}).get("source_dataset")
        if not isinstance(task, str):
            raise ValueError(
                f"reasoning_gym reward: prompt {prompt.id!r} is not a reasoning-gym entry (no metadata.source_dataset); "
                "use --dataset reasoning_gym:TASK or rows written from reasoning-gym entries"
            )
        if task not in self._scorers:
            try:
                self._scorers[task] = self._reasoning_gym.get_score_answer_fn(task)
            except ValueError:
                raise ValueError(f"reasoning_gym reward: prompt {prompt.id!r}: reasoning-gym has no task {task!r}") from None
        return self._scorers[task]

    @hookimpl
    def reward(self, prompt: Prompt, samples: Sequence[Sample]) -> list[float | None]:
        score_answer = self._scorer(prompt)
        return [_score(score_answer, self._answer(sample.text), prompt.metadata) for sample in samples]

    def _answer(self, text: str) -> str | None:
        if self.answer_format == "number":
            return gsm8k.extract_answer(text)
        return self._reasoning_gym.utils.extract_answer(text, tag_name=self.answer_tag)


def _score(score_answer: Callable[[str | None, dict[str, Any]], float], answer: str | None, entry: dict[str, Any]) -> float:
    try:
        return float(score_answer(answer, entry))
    except Exception:  # noqa: BLE001 - the policy writes anything: an answer the scorer cannot parse is a wrong one, not a crash
        return 0.0
