"""The HTTP client of an OpenAI-compatible inference server (vLLM, SGLang, a hosted deployment).

Every plugin that talks to such a server uses it: the ``openai`` sampler, the ``vllm`` weight
sync (which posts new weights through the sampler's own client), ``distill`` (a teacher's
logprobs). It owns retries, the reconnect hook a weight sync sets, the window of requests in
flight and the progress lines of a long wait; what a request means is its caller's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import math
import random
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any

import httpx

from grpo_core.errors import PluginError

TOKENIZER_PROBE = "Question: what is 12 plus 7?\nAnswer: 12 + 7 = 19\n#### 19\n\tcafé ∑ 🙂  (x_1, y-2) [OK]; 'q' \"r\""
"""Text tokenized on both sides at start: digits, spaces, newlines, tabs, punctuation, non-ASCII."""
RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
DROPPED = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
"""Transport errors that mean the server went away (killed, restarted, connection reset), after
which it may serve other weights than the last ones synced."""
KEEPALIVE_EXPIRY = 4.0
"""Seconds an idle connection is kept: under vLLM's (uvicorn's) 5 s keep-alive timeout, so the
client drops it first. A request sent on a connection the server is closing fails like a server
that went away: a retry, and a weight resync before it."""
LATENCY_TOLERANCE = 1.5
"""Under ``concurrency=auto`` the window grows while a request's seconds per completion token stay
within this factor of the best seen; past it the server is queueing, not batching, and it shrinks."""
LATENCY_SMOOTHING = 0.2
"""Weight of the newest request in the moving average of seconds per completion token."""
LATENCY_BACKOFF = 0.8
"""The window's factor on a latency blow-up (at most once per round of requests)."""
FAILURE_BACKOFF = 0.5
"""The window's factor on a failure to be retried: 429, 5xx, a timeout, a dropped connection."""
PROGRESS_EVERY = 30.0
"""Seconds between two progress lines while a call to the server waits (a slow answer, retries)."""


class ServerUnavailable(PluginError):
    """The server did not answer within the retry deadline."""

    def __init__(self, message: str, last_error: str = "") -> None:
        super().__init__(message)
        self.last_error = last_error


class ServerResponseError(PluginError):
    """The server answered, but not with what training needs (token ids, logprobs)."""


_call_counts: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar("grpo_core_server_call_counts", default=None)
"""The counts of the ``ServerClient.call`` a request is made for (tasks inherit it from the call's)."""


async def _counted(coroutine: Coroutine[Any, Any, Any], counts: dict[str, int]) -> Any:
    _call_counts.set(counts)
    return await coroutine


class ServerClient:
    """An httpx client on an event loop of its own thread: the sync ``call`` runs a coroutine there.

    Every request is retried on 429/5xx/timeouts/dropped connections with exponential backoff and
    jitter until ``retry_deadline`` seconds after its first failure. After a dropped connection
    ``on_reconnect`` (set by a weight sync) runs once, before any request is sent again: a server
    that restarted serves the weights it was started with, not the last ones synced.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str = "",
        timeout: float = 600.0,
        concurrency: int | ConcurrencyWindow = 32,
        retry_deadline: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
        backoff: tuple[float, float] = (0.5, 10.0),
        progress_every: float = PROGRESS_EVERY,
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.timeout = timeout
        self.retry_deadline = retry_deadline
        self.backoff_first, self.backoff_max = backoff
        self.on_reconnect: Callable[[], None] | None = None
        self.counts = {"requests": 0, "retries": 0, "reconnects": 0}
        self.progress_every = progress_every
        self._last_progress = 0.0
        self.last_error = ""
        """The last error a request was retried for (shown in the progress lines)."""
        self._epoch = 0
        """Counts dropped connections handled; a request that saw a drop at epoch e resyncs unless
        another request already did so since."""
        self._jitter = random.Random()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpo-core-sampler-http", daemon=True)
        self._thread.start()
        self.window = concurrency if isinstance(concurrency, ConcurrencyWindow) else ConcurrencyWindow(concurrency)
        """The completions requests in flight at once, shared by every call."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

        async def make_client() -> httpx.AsyncClient:
            return httpx.AsyncClient(
                base_url=self.base_url,
                headers=headers,
                timeout=timeout,
                limits=httpx.Limits(
                    max_connections=self.window.high, max_keepalive_connections=self.window.high, keepalive_expiry=KEEPALIVE_EXPIRY
                ),
                transport=transport,
            )

        self._http = self.call(make_client())
        self._lock = self.call(_make_lock())

    def call(self, coroutine: Coroutine[Any, Any, Any], counts: dict[str, int] | None = None) -> Any:
        """Run ``coroutine`` on the client's loop; ``counts`` (keys as ``self.counts``) gets the
        requests, retries and reconnects made for it alone, whatever else runs at the same time."""
        if counts is not None:
            coroutine = _counted(coroutine, counts)
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        started = time.monotonic()
        while True:
            try:
                return future.result(timeout=self.progress_every)
            except concurrent.futures.TimeoutError:
                self.progress(f"waiting for an answer for {time.monotonic() - started:.0f}s")

    def progress(self, what: str) -> None:
        """One line on stderr about a long wait, at most every ``progress_every`` seconds (all callers together)."""
        now = time.monotonic()
        if now - self._last_progress >= self.progress_every:
            self._last_progress = now
            retries = self.counts["retries"]
            last = f"; last error: {self.last_error}" if retries and self.last_error else ""
            print(
                f"sampler server {self.base_url}: {what} ({self.counts['requests']} requests, {retries} retries so far{last})",
                file=sys.stderr,
                flush=True,
            )

    def first_contact(self, deadline: float) -> list[dict[str, Any]]:
        """The cards of the models served (GET /v1/models) within ``deadline`` seconds in all, each
        attempt's wait included; else one line saying what to check: a server that is down or
        never answers stops the run at once."""
        try:
            return (self.call(self.request("GET", "/v1/models", None, deadline=deadline)) or {}).get("data", [])
        except ServerUnavailable as exc:
            raise ServerUnavailable(
                f"the sampler server at {self.base_url} did not answer GET /v1/models within {deadline:g}s "
                f"(--sampler-opt connect_deadline): {exc.last_error}; check that the server is running and ready, "
                "and that base_url is its address and port"
            ) from None

    def _count(self, key: str) -> None:
        self.counts[key] += 1
        counts = _call_counts.get()
        if counts is not None:
            counts[key] += 1

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self.call(self._http.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def get(self, path: str, resync: bool = True) -> Any:
        return self.call(self.request("GET", path, None, resync))

    def post(self, path: str, body: dict[str, Any], resync: bool = True, text: bool = False) -> Any:
        """The decoded JSON answer; ``text``: the answer's text (vLLM's /v1/load_lora_adapter answers in words)."""
        return self.call(self.request("POST", path, body, resync, text=text))

    async def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        resync: bool = True,
        deadline: float | None = None,
        on_failure: Callable[[], None] | None = None,
        text: bool = False,
    ) -> Any:
        """The decoded JSON answer; retried until the deadline, then :class:`ServerUnavailable`.

        ``deadline``: seconds from the first attempt the request may take in all, each attempt's
        wait for an answer included (the first contact's bound); else each attempt may take
        ``timeout`` and failures are retried for ``retry_deadline``. ``on_failure`` runs on each
        failure that is retried or ends the request. ``text``: the answer's text, not decoded."""
        started = time.monotonic()
        limit = self.retry_deadline if deadline is None else deadline
        first_failure: float | None = None
        dropped_at: int | None = None
        attempt = 0
        while True:
            if dropped_at is not None and resync:
                await self._reconnect(dropped_at)
                dropped_at = None
            self._count("requests")
            retry_after = None
            try:
                timeout = self.timeout if deadline is None else max(0.01, min(self.timeout, started + deadline - time.monotonic()))
                response = await self._http.request(method, path, json=body, timeout=timeout)
            except httpx.TransportError as exc:
                if isinstance(exc, DROPPED):
                    dropped_at = self._epoch
                error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                if response.is_success:
                    if text:
                        return response.text
                    if not response.content:
                        return None
                    try:
                        return response.json()
                    except ValueError:
                        raise ServerResponseError(
                            f"{method} {self.base_url}{path} answered with something that is not JSON: {response.text[:200]!r}"
                        ) from None
                if response.status_code not in RETRY_STATUS:
                    raise ServerResponseError(
                        f"{method} {self.base_url}{path} failed with HTTP {response.status_code}: {_server_message(response)}"
                    )
                error = f"HTTP {response.status_code}: {_server_message(response)}"
                retry_after = _retry_after(response)
            if on_failure is not None:
                on_failure()
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            give_up_at = first_failure + limit if deadline is None else started + limit
            if now >= give_up_at:
                raise ServerUnavailable(
                    f"{method} {self.base_url}{path} kept failing for {now - first_failure:.0f}s "
                    f"({attempt + 1} attempts, retry deadline {limit:g}s); last error: {error}",
                    last_error=error,
                )
            self._count("retries")
            self.last_error = error
            delay = min(self.backoff_max, self.backoff_first * 2**attempt)
            # Equal jitter: clients that failed together do not all come back at the same instant.
            delay = delay / 2 + self._jitter.uniform(0, delay / 2)
            if retry_after is not None:
                delay = max(delay, min(retry_after, self.backoff_max))
            await asyncio.sleep(min(delay, max(0.0, give_up_at - now)))
            attempt += 1

    async def _reconnect(self, dropped_at: int) -> None:
        async with self._lock:
            if self._epoch != dropped_at:
                return
            if self.on_reconnect is not None:
                # The weight sync posts through this same loop, which stays free meanwhile.
                await asyncio.to_thread(self.on_reconnect)
            self._epoch += 1
            self._count("reconnects")

    def only_model(self, cards: list[dict[str, Any]]) -> str:
        # A LoRA adapter's card names its base as parent: one a weight sync left loaded is not a second model.
        models = [m["id"] for m in cards if not m.get("parent")]
        if len(models) != 1:
            raise PluginError(f"the server at {self.base_url} serves {models or 'no models'}; choose one with --sampler-opt model=NAME")
        return models[0]

    def max_model_len(self, cards: list[dict[str, Any]], model: str) -> int | None:
        cards = [m for m in cards if m.get("id") == model]
        if not cards:
            raise PluginError(f"the server at {self.base_url} does not serve model '{model}'")
        return cards[0].get("max_model_len")


async def _make_lock() -> asyncio.Lock:
    return asyncio.Lock()


class ConcurrencyWindow:
    """How many requests may be in flight at once: fixed, or adapted (``low < high``) by AIMD on
    latency, used on the client's event loop only.

    Adapted, on the requests that end while the window is full: each within
    ``LATENCY_TOLERANCE`` of the best seconds per completion token seen (a moving average) grows
    it by 1/size (one request per round of requests); a slower one shrinks it by
    ``LATENCY_BACKOFF``, and any failure by ``FAILURE_BACKOFF``, once per round (only a request
    started after the last shrink counts). A server slower for good shrinks it to ``low``, where
    its time becomes the best to hold. Seconds per token, not per request: a request's time grows
    with its longest completion, and steps with shorter completions must not read as a faster
    server.
    """

    def __init__(self, size: int, low: int | None = None, high: int | None = None) -> None:
        self.low = size if low is None else low
        self.high = size if high is None else high
        if not 1 <= self.low <= size <= self.high:
            raise ValueError(f"the concurrency window {size} must lie in [{self.low}, {self.high}], with 1 <= {self.low}")
        self.size = float(size)
        self.in_flight = 0
        self.seconds_per_token: float | None = None
        """The recent seconds per completion token (a moving average)."""
        self.best_seconds_per_token = math.inf
        self._last_shrink = -math.inf
        self._waiting = 0
        self._cond: asyncio.Condition | None = None

    @property
    def adaptive(self) -> bool:
        return self.low < self.high

    @property
    def limit(self) -> int:
        return int(self.size)

    async def __aenter__(self) -> float:
        """Waits for a free slot; the time the request starts."""
        if self._cond is None:
            self._cond = asyncio.Condition()
        async with self._cond:
            self._waiting += 1
            try:
                await self._cond.wait_for(lambda: self.in_flight < self.limit)
            finally:
                self._waiting -= 1
            self.in_flight += 1
        return time.monotonic()

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        assert self._cond is not None
        async with self._cond:
            self.in_flight -= 1
            self._cond.notify(max(0, self.limit - self.in_flight))

    def on_success(self, started: float, longest_completion: int) -> None:
        if not self.adaptive or started < self._last_shrink:
            # It ran under the window before the last shrink, or failed first: its time says
            # nothing of the window now.
            return
        seconds_per_token = (time.monotonic() - started) / max(1, longest_completion)
        # Smoothed, so that one lucky fast answer does not set a best no round can match.
        if self.seconds_per_token is None:
            self.seconds_per_token = seconds_per_token
        self.seconds_per_token += LATENCY_SMOOTHING * (seconds_per_token - self.seconds_per_token)
        self.best_seconds_per_token = min(self.best_seconds_per_token, self.seconds_per_token)
        if not (self._waiting or self.in_flight >= self.limit):
            return  # a window that did not limit the requests is neither too small nor too large
        if self.seconds_per_token <= LATENCY_TOLERANCE * self.best_seconds_per_token:
            self.size = min(self.high, self.size + 1 / self.size)
        elif self.size <= self.low:
            # Nothing left to shed at the lowest window: the server itself became slower (other
            # load, longer prompts), so its time now is the best to hold.
            self.best_seconds_per_token = self.seconds_per_token
        else:
            self._shrink(started, LATENCY_BACKOFF)

    def on_failure(self, started: float) -> None:
        if self.adaptive:
            self._shrink(started, FAILURE_BACKOFF)

    def _shrink(self, started: float, factor: float) -> None:
        if started > self._last_shrink:
            self.size = max(self.low, self.size * factor)
            self._last_shrink = time.monotonic()


def _server_message(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:300] or response.reason_phrase
    error = data.get("error", data) if isinstance(data, dict) else data
    message = error.get("message", error) if isinstance(error, dict) else error
    return str(message)[:300]


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def prompt_logprobs(client: ServerClient, model: str, tokens: list[int], resync: bool = True) -> list[float]:
    """The server's logprob of each token given those before it (the first has none: 0.0)."""
    data = client.post(
        "/v1/completions",
        {"model": model, "prompt": [tokens], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0},
        resync=resync,
    )
    rows = (data.get("choices") or [{}])[0].get("prompt_logprobs")
    if rows is None or len(rows) != len(tokens):
        raise ServerResponseError("the server returned no prompt logprobs (vLLM's prompt_logprobs request field)")
    out = [0.0]
    for token, row in zip(tokens[1:], rows[1:]):
        entry = (row or {}).get(str(token))
        if entry is None:
            raise ServerResponseError(f"the server's prompt logprobs miss token {token}")
        out.append(float(entry["logprob"] if isinstance(entry, dict) else entry))
    return out
