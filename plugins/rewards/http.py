"""The ``http`` reward: scores from a reward service reached over HTTP.

:class:`JsonService` (POST JSON with retries, backoff, a deadline and a concurrency limit) is
shared with the ``judge`` reward.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import httpx

from grpo_core import PluginError, Prompt, Sample, hookimpl, option
from grpo_core.loss import validate_non_negative, validate_positive
from grpo_core.types import prompt_text

__all__ = ["HttpReward", "JsonService", "ServiceError", "parse_headers"]

T = TypeVar("T")
R = TypeVar("R")

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
"""Answers that say "try again later"; any other 4xx/5xx fails at once."""
DEADLINE_MARGIN = 0.1
"""A call stops waiting this share (at most 1 s) of the run's --reward-timeout before it runs out,
so the batches that did answer keep their scores instead of the run failing the whole group."""


class ServiceError(Exception):
    """A service's answer could not be used (after the retries); the message never holds the headers."""


class RewardServiceError(PluginError):
    """Every batch of a reward call failed: the run counts the call in ``reward/errors``."""


def parse_headers(text: str) -> dict[str, str]:
    """Request headers from an option's text: a JSON object, or ``Name: value`` entries separated
    by newlines or ``;``. Errors name the entry, never a value (headers hold secrets)."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError("headers: starts with '{' but is not a JSON object (value hidden: secret option)") from None
        if not isinstance(parsed, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in parsed.items()):
            raise ValueError("headers: the JSON object must map header names to strings (value hidden: secret option)")
        return parsed
    headers = {}
    for i, entry in enumerate(e for e in text.replace("\n", ";").split(";") if e.strip()):
        name, sep, value = entry.partition(":")
        if not sep or not name.strip() or any(c.isspace() for c in name.strip()):
            raise ValueError(f"headers: entry {i + 1} is not 'Name: value' (value hidden: secret option)")
        headers[name.strip()] = value.strip()
    return headers


def _check_url(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"{attribute.name} must be an http:// or https:// address, got {value!r}")


class JsonService:
    """POSTs JSON to one URL, at most ``concurrency`` requests in flight (across every call that
    shares it); retries 408/409/425/429/5xx, timeouts and refused connections ``retries`` times,
    waiting ``backoff`` s, then twice as long each time (with jitter), never past a call's deadline.

    Requests run in daemon threads: one still waiting on a service the run gave up on (past its
    deadline, or after ``close``) holds no other call, and not the process at exit.
    """

    def __init__(self, url: str, headers: dict[str, str], request_timeout: float, retries: int, backoff: float, concurrency: int) -> None:
        self.url = url
        self.headers = {"content-type": "application/json", **headers}
        self.request_timeout = request_timeout
        self.retries = retries
        self.backoff = backoff
        self.concurrency = concurrency
        self._slots = threading.BoundedSemaphore(concurrency)
        self._client: httpx.Client | None = None
        self._closes = 0
        """How many times ``close`` ran: a call that started before the last one stops."""
        self._changed = threading.Condition()

    def _client_now(self) -> httpx.Client:
        with self._changed:
            if self._client is None:
                limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
                self._client = httpx.Client(limits=limits)
            return self._client

    def post(self, body: Any, deadline: float | None) -> Any:
        """The JSON the service answers to ``body``; ServiceError when it cannot be had by ``deadline``
        (a ``time.monotonic()`` value; None: only the per-request timeout and the retries bound it)."""
        client = self._client_now()
        content = json.dumps(body, default=str)  # a dataset row may hold dates and the like
        problem = ""
        for attempt in range(self.retries + 1):
            timeout = self.request_timeout
            if deadline is not None:
                timeout = min(timeout, deadline - time.monotonic())
                if timeout <= 0:
                    raise ServiceError(f"out of time (the run's --reward-timeout) after {attempt} attempt(s); last: {problem or 'none'}")
            if client.is_closed:
                raise ServiceError("the run ended before the service answered")
            try:
                response = client.post(self.url, content=content, headers=self.headers, timeout=timeout)
            except httpx.TimeoutException:
                problem = f"no answer within {timeout:.3g} s"
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if response.status_code in RETRY_STATUS:
                    problem = f"HTTP {response.status_code}"
                elif response.status_code >= 400:
                    raise ServiceError(f"HTTP {response.status_code}: {response.text[:200]!r}")
                else:
                    try:
                        return response.json()
                    except ValueError:
                        raise ServiceError(f"the answer is not JSON: {response.text[:200]!r}") from None
            if attempt < self.retries:
                wait = self.backoff * 2**attempt * random.uniform(0.5, 1.0)
                if deadline is not None:
                    wait = min(wait, max(deadline - time.monotonic(), 0.0))
                time.sleep(wait)
        raise ServiceError(f"{problem} (after {self.retries} retries)" if self.retries else problem)

    def map(self, fn: Callable[[T], R], items: Sequence[T], deadline: float | None) -> list[R | Exception]:
        """``fn(item)`` for every item, at most ``concurrency`` at once: its result, or the exception
        it raised (a ServiceError for one not done by ``deadline`` or when ``close`` runs)."""
        outcomes: list[R | Exception | None] = [None] * len(items)
        finished = [False] * len(items)
        closes = self._closes

        def remaining() -> float | None:
            return None if deadline is None else max(deadline - time.monotonic(), 0.0)

        def run(i: int, item: T) -> None:
            outcome: R | Exception
            if not self._slots.acquire(timeout=remaining()):
                outcome = ServiceError("out of time (the run's --reward-timeout) waiting for a free connection")
            else:
                try:
                    outcome = fn(item) if self._closes == closes else ServiceError("the run ended before the service answered")
                except Exception as exc:
                    outcome = exc
                finally:
                    self._slots.release()
            with self._changed:
                outcomes[i], finished[i] = outcome, True
                self._changed.notify_all()

        for i, item in enumerate(items):
            threading.Thread(target=run, args=(i, item), daemon=True, name="grpo-core-reward-request").start()
        with self._changed:
            self._changed.wait_for(lambda: all(finished) or self._closes != closes, timeout=remaining())
            late = "the run ended" if self._closes != closes else "out of time (the run's --reward-timeout)"
            return [outcomes[i] if finished[i] else ServiceError(f"{late} before the service answered") for i in range(len(items))]

    def close(self) -> None:
        """Close the connections; calls still waiting return at once (a later call opens new ones)."""
        with self._changed:
            if self._client is not None:
                self._client.close()
            self._client = None
            self._closes += 1
            self._changed.notify_all()


def completion_start(sample: Sample) -> int:
    """The index of the sample's first trained token: where its completion starts in ``tokens``."""
    return next((i for i, m in enumerate(sample.loss_mask) if m), len(sample.tokens))


@attrs.define
class ServiceReward:
    """The part every reward backed by a :class:`JsonService` shares: the run's --reward-timeout
    (read at run start) bounds each reward call, and the service's connections close at run end.
    A subclass makes ``_service`` in its ``__attrs_post_init__``."""

    _reward_timeout: float = attrs.field(init=False, default=0.0, repr=False)
    _service: JsonService = attrs.field(init=False, repr=False)

    def deadline(self) -> float | None:
        """When a reward call that starts now stops waiting for the service (None: no run limit)."""
        if not self._reward_timeout:
            return None
        return time.monotonic() + self._reward_timeout - min(DEADLINE_MARGIN * self._reward_timeout, 1.0)

    @hookimpl
    def on_run_start(self, config: Any, run_dir: Path, total_steps: int | None, start_step: int) -> None:
        self._reward_timeout = float(config.reward_timeout)

    @hookimpl
    def on_run_end(self, summary: dict[str, Any], run_dir: Path) -> None:
        self._service.close()


@attrs.define
class HttpReward(ServiceReward):
    """Scores from a reward service: POSTs the group's samples as JSON, reads one score each.

    Request (POST to `url`): {"samples": [{"prompt": str, "completion": str, "answer": str|null,
    "row": {the dataset row's fields}}, ...]}; with token_ids=true each sample also carries
    "prompt_ids" and "completion_ids" (the tokens before and from its first trained token).
    Answer: {"scores": [float|null, ...]}, one per sample in order; null means the service cannot
    score that sample, which is then not trained on. Anything else (an HTTP error after the
    retries, a body that is not this JSON, a wrong number of scores, a score that is not a number)
    fails that batch's samples, counted in reward/failed; a call whose batches all fail counts in
    reward/errors and names the reason. Each call stops waiting just before the run's
    --reward-timeout, and failures count towards --max-reward-failures-in-a-row, as for any reward.
    A group goes in requests of `batch_size` samples, at most `concurrency` in flight at once.
    See examples/reward_server.py for a service in 20 lines.
    """

    url: str = option("http://127.0.0.1:8100/score", help="where the samples are POSTed (http:// or https://)", validator=_check_url)
    batch_size: int = option(32, help="samples per request; a larger group goes in several", validator=validate_positive)
    concurrency: int = option(4, help="requests in flight at once, across all reward calls", validator=validate_positive)
    headers: str = option(
        "",
        help="request headers: 'Name: value' entries separated by ';' (or a JSON object), e.g. 'Authorization: Bearer KEY'; "
        "give it as env:NAME",
        secret=True,
        repr=False,
    )
    request_timeout: float = option(60.0, help="seconds one request may take before it is retried", validator=validate_positive)
    retries: int = option(
        2, help="retries of a request that timed out, could not connect or got 408/429/5xx", validator=validate_non_negative
    )
    backoff: float = option(
        0.5, help="seconds before the first retry; each next one waits twice as long (with jitter)", validator=validate_non_negative
    )
    token_ids: bool = option(False, help="also send each sample's prompt_ids and completion_ids")

    def __attrs_post_init__(self) -> None:
        self._service = JsonService(
            self.url, parse_headers(self.headers), self.request_timeout, self.retries, self.backoff, self.concurrency
        )

    @hookimpl
    def reward(self, prompt: Prompt, samples: Sequence[Sample]) -> list[float | None]:
        deadline = self.deadline()
        batches = [list(samples[i : i + self.batch_size]) for i in range(0, len(samples), self.batch_size)]
        outcomes = self._service.map(lambda batch: self._score_batch(prompt, batch, deadline), batches, deadline)
        scores: list[float | None] = []
        problems = []
        for batch, outcome in zip(batches, outcomes):
            if isinstance(outcome, Exception):
                problems.append(outcome)
                scores.extend([None] * len(batch))
            else:
                scores.extend(outcome)
        if batches and len(problems) == len(batches):
            raise RewardServiceError(f"{self.url}: {problems[-1]}")
        return scores

    def _score_batch(self, prompt: Prompt, batch: list[Sample], deadline: float | None) -> list[float | None]:
        reply = self._service.post({"samples": [self._sample_json(prompt, s) for s in batch]}, deadline)
        return parse_scores(reply, len(batch))

    def _sample_json(self, prompt: Prompt, sample: Sample) -> dict[str, Any]:
        item: dict[str, Any] = {
            "prompt": prompt_text(prompt),
            "completion": sample.text,
            "answer": None if prompt.answer is None else str(prompt.answer),
            "row": prompt.metadata,
        }
        if self.token_ids:
            start = completion_start(sample)
            item["prompt_ids"], item["completion_ids"] = sample.tokens[:start], sample.tokens[start:]
        return item


def parse_scores(reply: Any, expected: int) -> list[float | None]:
    """The scores of ``{"scores": [float|null, ...]}`` with ``expected`` entries; ServiceError otherwise."""
    scores = reply.get("scores") if isinstance(reply, dict) else None
    if not isinstance(scores, list):
        raise ServiceError(f'the answer is not {{"scores": [...]}}: {json.dumps(reply)[:200]}')
    if len(scores) != expected:
        raise ServiceError(f"the answer has {len(scores)} scores for {expected} samples")
    bad = next((s for s in scores if s is not None and not _finite_number(s)), None)
    if bad is not None:
        raise ServiceError(f"a score is not a finite number or null: {bad!r}")
    return [None if s is None else float(s) for s in scores]


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
