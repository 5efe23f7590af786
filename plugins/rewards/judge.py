"""The ``judge`` reward: an LLM judge on an OpenAI-compatible chat endpoint."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from typing import Literal

import attrs
import httpx

from grpo_core import Prompt, Sample, hookimpl, option
from grpo_core.loss import validate_non_negative, validate_positive
from grpo_core.plugins.rewards.http import JsonService, RewardServiceError, ServiceError, ServiceReward, parse_headers
from grpo_core.types import prompt_text

__all__ = ["JudgeReward", "parse_group_scores", "parse_score"]

POINTWISE_RUBRIC = """\
Grade the response to the task below from 0 to 10: 10 for a correct, complete and clear answer, 0 for a wrong or empty one.

Task:
{prompt}

Response:
{completion}

Explain your grade in a few sentences, then end with a line "Score: N" where N is from 0 to 10."""

GROUP_RUBRIC = """\
Below are {n} responses to the same task. Grade each from 0 to 10, comparing them with one another: \
the best response gets the highest score, a wrong or empty one 0, equally good ones the same score.

Task:
{prompt}

{completions}

Explain your grades in a few sentences, then end with a JSON object {"scores": [...]} holding one score per \
response, in the order of the responses."""

SCORE_PATTERN = r"(?i)score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)"
PLACEHOLDERS = {"pointwise": ("{prompt}", "{answer}", "{completion}"), "group": ("{prompt}", "{answer}", "{completions}", "{n}")}
REQUIRED = {"pointwise": "{completion}", "group": "{completions}"}


class UnparseableReply(ServiceError):
    """The judge answered, but its reply holds no usable score."""


def parse_score(reply: str, pattern: re.Pattern[str], low: float, high: float) -> float:
    """The last match of ``pattern`` in ``reply``, mapped from [low, high] to [0, 1]; UnparseableReply
    when there is none or it is outside the range."""
    matches = pattern.findall(reply)
    if not matches:
        raise UnparseableReply(f"no score in the reply (score_pattern): {reply[-200:]!r}")
    try:
        value = float(matches[-1])
    except ValueError:
        raise UnparseableReply(f"the score {matches[-1]!r} is not a number") from None
    if not low <= value <= high:
        raise UnparseableReply(f"the score {value:g} is outside [{low:g}, {high:g}]")
    return (value - low) / (high - low)


def parse_group_scores(reply: str, n: int, low: float, high: float) -> list[float]:
    """The ``{"scores": [...]}`` object last in ``reply`` (n numbers in [low, high]), mapped to [0, 1]."""
    decoder = json.JSONDecoder()
    found = None
    for start in (m.start() for m in re.finditer(r"\{", reply)):
        try:
            value, _ = decoder.raw_decode(reply, start)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and "scores" in value:
            found = value["scores"]
    if not isinstance(found, list):
        raise UnparseableReply(f'no {{"scores": [...]}} object in the reply: {reply[-200:]!r}')
    if len(found) != n:
        raise UnparseableReply(f"the reply has {len(found)} scores for {n} responses")
    scores = []
    for value in found:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise UnparseableReply(f"a score is not a number in [{low:g}, {high:g}]: {value!r}")
        scores.append((value - low) / (high - low))
    return scores


def _compiles_with_a_group(instance: object, attribute: attrs.Attribute, value: str) -> None:
    try:
        groups = re.compile(value).groups
    except re.error as exc:
        raise ValueError(f"score_pattern {value!r} is not a regular expression: {exc}") from None
    if groups != 1:
        raise ValueError(f"score_pattern must have exactly one group (the number), {value!r} has {groups}")


@attrs.define
class JudgeReward(ServiceReward):
    """An LLM judge: each completion is graded by one or more models on an OpenAI-compatible chat
    endpoint (POST base_url/v1/chat/completions), and the grade, mapped from
    [min_score, max_score] to [0, 1], is the reward; several `models` are averaged.

    mode=pointwise sends one request per completion with the `rubric`, where {prompt},
    {completion} and {answer} (the row's reference answer) are replaced; the score is the last
    match of `score_pattern` in the reply ("Score: 7"). mode=group (like ART's RULER) sends the
    whole group in one request ({completions}: the numbered responses, {n}: how many) and reads
    the last {"scores": [...]} JSON object of the reply: the judge grades the completions against
    each other. An empty rubric is the mode's built-in one (see docs/rewards.md).

    A reply without a usable score (no match, out of range, a wrong count) fails the sample:
    it is not trained on and counts in reward/failed, as do requests that fail after the
    retries; a sample gets a score only when every judge gave one, and a call in which no sample
    got one counts in reward/errors with the reason. Identical requests within a step are sent
    once (cache). Each sample's reply shows in samples.jsonl as reward_detail/judge. Requests
    stop just before the run's --reward-timeout. A rubric with {answer} makes every dataset row
    need an answer.
    """

    base_url: str = option("http://127.0.0.1:8000", help="the chat server's address (a trailing /v1 is accepted)")
    models: list[str] = option([], help="the judge model(s), comma-separated: several are averaged (empty: the server's only model)")
    api_key: str = option("", help="bearer token for the server; give it as env:NAME", secret=True, repr=False)
    mode: Literal["pointwise", "group"] = option("pointwise", help="pointwise: one request per completion; group: the group in one request")
    rubric: str = option("", help="the judge's prompt with {prompt}, {completion} / {completions}, {answer}, {n}; empty: built in")
    score_pattern: str = option(
        SCORE_PATTERN, help="pointwise: regex whose one group is the score; its last match counts", validator=_compiles_with_a_group
    )
    min_score: float = option(0.0, help="the lowest score the rubric asks for (maps to 0)")
    max_score: float = option(10.0, help="the highest score the rubric asks for (maps to 1)")
    temperature: float = option(0.0, help="the judge's sampling temperature", validator=validate_non_negative)
    max_tokens: int = option(512, help="the most tokens of one reply", validator=validate_positive)
    cache: bool = option(True, help="send identical requests once per step (the same completion twice, a group scored again)")
    concurrency: int = option(8, help="requests in flight at once, across all reward calls", validator=validate_positive)
    request_timeout: float = option(120.0, help="seconds one request may take before it is retried", validator=validate_positive)
    retries: int = option(
        2, help="retries of a request that timed out, could not connect or got 408/429/5xx", validator=validate_non_negative
    )
    backoff: float = option(1.0, help="seconds before the first retry; each next one waits twice as long", validator=validate_non_negative)

    _pattern: re.Pattern[str] = attrs.field(init=False, repr=False)
    _cache: dict[tuple[str, str], str] = attrs.field(init=False, factory=dict, repr=False)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock, repr=False)
    _served_model: str | None = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        if not self.max_score > self.min_score:
            raise ValueError(f"max_score ({self.max_score:g}) must be above min_score ({self.min_score:g})")
        if self.mode == "group" and self.score_pattern != SCORE_PATTERN:
            raise ValueError('score_pattern is for mode=pointwise; mode=group reads a {"scores": [...]} object')
        self.rubric = self.rubric or (POINTWISE_RUBRIC if self.mode == "pointwise" else GROUP_RUBRIC)
        if REQUIRED[self.mode] not in self.rubric:
            raise ValueError(f"rubric for mode={self.mode} must contain {REQUIRED[self.mode]}")
        unfilled = [p for p in ("{completion}", "{completions}", "{n}") if p in self.rubric and p not in PLACEHOLDERS[self.mode]]
        if unfilled:
            raise ValueError(f"rubric for mode={self.mode} has {unfilled[0]}, which only the other mode fills")
        self._pattern = re.compile(self.score_pattern)
        base = self.base_url.rstrip("/").removesuffix("/v1")
        headers = parse_headers(f"Authorization: Bearer {self.api_key}") if self.api_key else {}
        self._service = JsonService(
            f"{base}/v1/chat/completions", headers, self.request_timeout, self.retries, self.backoff, self.concurrency
        )

    @property
    def needs_answer(self) -> bool:
        """Declared attribute: the rubric shows the reference answer, so every row needs one."""
        return "{answer}" in self.rubric

    @hookimpl
    def on_step(self, step: int) -> None:
        with self._lock:
            self._cache.clear()

    @hookimpl
    def reward(self, prompt: Prompt, samples: Sequence[Sample]) -> list[float | None]:
        deadline = self.deadline()
        models = self.models or [self._only_model()]
        if self.mode == "pointwise":
            contents = [self._render(prompt, completion=s.text) for s in samples]
        else:
            contents = [self._render(prompt, completions=[s.text for s in samples])]
        requests = [(model, content) for model in models for content in contents]
        replies = self._ask(requests, deadline)
        # per sample: each judge's score (None where it failed) and what it said
        scores: list[list[float | None]] = [[] for _ in samples]
        details: list[list[str]] = [[] for _ in samples]
        problems: list[Exception] = []
        for j, model in enumerate(models):
            judge_replies = replies[j * len(contents) : (j + 1) * len(contents)]
            for i, (score, detail) in enumerate(self._read(judge_replies, len(samples), problems)):
                scores[i].append(score)
                details[i].append(f"[{model}] {detail}" if len(models) > 1 else detail)
        for sample, said in zip(samples, details):
            sample.reward_details["judge"] = "\n\n".join(said)
        totals = [None if any(s is None for s in per_judge) else sum(per_judge) / len(per_judge) for per_judge in scores]
        if samples and all(t is None for t in totals) and problems:
            raise RewardServiceError(f"judge at {self._service.url}: {problems[0]}")
        return totals

    def _read(self, replies: list[str | Exception], n: int, problems: list[Exception]) -> list[tuple[float | None, str]]:
        """(score, detail) per sample from one judge's replies (n of them, or one for the group)."""
        low, high = self.min_score, self.max_score
        if self.mode == "group":
            reply = replies[0]
            if isinstance(reply, Exception):
                problems.append(reply)
                return [(None, f"(failed: {reply})")] * n
            try:
                return [(score, reply) for score in parse_group_scores(reply, n, low, high)]
            except UnparseableReply as exc:
                problems.append(exc)
                return [(None, reply)] * n
        read = []
        for reply in replies:
            if isinstance(reply, Exception):
                problems.append(reply)
                read.append((None, f"(failed: {reply})"))
                continue
            try:
                read.append((parse_score(reply, self._pattern, low, high), reply))
            except UnparseableReply as exc:
                problems.append(exc)
                read.append((None, reply))
        return read

    def _render(self, prompt: Prompt, completion: str = "", completions: Sequence[str] = ()) -> str:
        values = {
            "{prompt}": prompt_text(prompt),
            "{answer}": "" if prompt.answer is None else str(prompt.answer),
            "{completion}": completion,
            "{completions}": "\n\n".join(f"Response {i + 1}:\n{text}" for i, text in enumerate(completions)),
            "{n}": str(len(completions)),
        }
        # One pass, so a completion that contains "{answer}" is not filled in.
        placeholders = PLACEHOLDERS[self.mode]
        return re.sub("|".join(re.escape(p) for p in placeholders), lambda m: values[m.group()], self.rubric)

    def _ask(self, requests: list[tuple[str, str]], deadline: float | None) -> list[str | Exception]:
        """The reply to each (model, content); with cache, identical requests are sent once a step."""
        if not self.cache:
            return self._service.map(lambda request: self._chat(*request, deadline), requests, deadline)
        with self._lock:
            known: dict[tuple[str, str], str | Exception] = dict(self._cache)
        unique = [r for r in dict.fromkeys(requests) if r not in known]
        answered = dict(zip(unique, self._service.map(lambda request: self._chat(*request, deadline), unique, deadline)))
        with self._lock:
            self._cache.update((r, reply) for r, reply in answered.items() if isinstance(reply, str))
        known.update(answered)
        return [known[r] for r in requests]

    def _chat(self, model: str, content: str, deadline: float | None) -> str:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        reply = self._service.post(body, deadline)
        try:
            text = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise ServiceError(f"not a chat completion: {json.dumps(reply)[:200]}") from None
        if not isinstance(text, str):
            raise ServiceError(f"the reply's content is not text: {text!r}")
        return text

    def _only_model(self) -> str:
        if self._served_model is not None:
            return self._served_model
        base = self._service.url.removesuffix("/chat/completions")
        try:
            response = httpx.get(f"{base}/models", headers=self._service.headers, timeout=self.request_timeout)
            names = [m["id"] for m in response.json()["data"]]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise RewardServiceError(f"judge: could not list the models of {base} ({exc}); name one: --reward-opt models=NAME") from None
        if len(names) != 1:
            raise RewardServiceError(f"judge: {base} serves {len(names)} models ({', '.join(names)}); name one: --reward-opt models=NAME")
        self._served_model = names[0]
        return names[0]
