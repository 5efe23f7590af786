"""The agent gateway: an OpenAI-compatible HTTP server on 127.0.0.1 through which programs the run
starts sample from the run's policy, and which records the tokens and logprobs of every call.

Each program gets a session of its own, reached at ``/s/<session>/v1`` (its ``OPENAI_BASE_URL``);
every request carries the run's key (``Authorization: Bearer <key>``, its ``OPENAI_API_KEY``) or
is answered 401. It serves ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``
(tools, tool calls, ``stream: true`` as server-sent events). The whole reply is generated before
the first byte is sent: a stream is the same reply cut into chunks.

Token-in/token-out: a prompt whose text extends an earlier call's prompt and reply (an agent sends
its conversation back with the reply appended) keeps that call's tokens as they were sampled and
encodes only the text after them, so the policy's tokens are never re-tokenized and the call's
prompt extends the earlier call's tokens (:class:`Context`). What the chat template renders and how
tool calls are read are the session's :class:`Chat`, which the rollout supplies.
"""

from __future__ import annotations

import hmac
import json
import math
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import urlsplit

import attrs

from grpo_core.types import Completion, SamplingParams

HOST = "127.0.0.1"
"""Programs on this machine only: the gateway answers with the policy, and takes no other address."""

ROUTE = re.compile(r"/s/([A-Za-z0-9_-]+)/v1/(models|completions|chat/completions)")

NEUTRAL = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "best_of": 1, "echo": False, "suffix": None, "logit_bias": None}
"""Request fields that would change what is sampled, and the only values the gateway takes for them."""


class Chat(Protocol):
    """How a session writes chat requests as prompt text and reads replies (the rollout's)."""

    tokenizer: Any

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        """The conversation as the chat template writes it, ending with the next assistant header."""

    def stop(self, tools: list[dict[str, Any]]) -> list[str]:
        """Stop strings that end a turn right after a tool call (none without tools)."""

    def reply(self, tokens: list[int], tools: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
        """A reply's content and OpenAI ``tool_calls`` (empty when it calls no tool)."""


Generate = Callable[[list[int], SamplingParams], tuple[Completion, int]]
"""One completion of a prompt's tokens, and the policy version it was sampled from."""


class RequestError(Exception):
    """A request the gateway cannot serve: answered with ``status`` and the message, never raised further."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code = status, code


@attrs.define
class Call:
    """One generation a program asked for: its prompt as the policy saw it and what was sampled."""

    prompt_tokens: list[int]
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int
    content: str | None
    """The reply as the program got it (its text; a chat reply's content, less its tool calls)."""


@attrs.frozen
class Context:
    """A call's prompt and reply as text and tokens: what a later prompt's text may extend."""

    text: str
    tokens: list[int]
    special: str
    """The text of a special token that ended the reply (its end of turn), which the text omits
    and a chat template writes next: '' when the reply ended otherwise."""


@attrs.define(eq=False)
class Session:
    """One program's calls, sampled with ``generate`` from ``params`` (the run's settings)."""

    id: str
    generate: Generate
    chat: Chat
    params: SamplingParams
    max_context: int | None
    model: str
    override_sampling: bool = False
    calls: list[Call] = attrs.field(factory=list)
    contexts: list[Context] = attrs.field(factory=list)
    error: BaseException | None = None
    """The first error of the run's own (the sampler's), which the rollout raises: never the program's fault."""
    closed: bool = False
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    @property
    def tokenizer(self) -> Any:
        return self.chat.tokenizer

    def chat_completion(self, body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The reply to a ``/v1/chat/completions`` request and its stream chunks."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("messages must be a non-empty list of message objects")
        tools = body.get("tools") or []
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools):
            raise RequestError('tools must be a list of {"type": "function", "function": {...}}')
        if body.get("tool_choice", "auto") not in ("auto", None):
            raise RequestError("tool_choice: only auto is served (the policy decides whether to call a tool)")
        if body.get("top_logprobs"):
            raise RequestError("top_logprobs is not served (logprobs: true returns each sampled token's logprob)")
        plain = [_plain_message(m) for m in messages]
        try:
            text = self.chat.render(plain, tools)
        except Exception as exc:  # the template's own refusal (roles out of order, a missing field)
            raise RequestError(f"the chat template cannot write these messages: {type(exc).__name__}: {exc}") from exc
        prompt = self._encode_text(text)
        call = self._sample(body, prompt, self.chat.stop(tools), text)
        content, tool_calls = self.chat.reply(call.tokens, tools)
        call.content = content
        finish = "tool_calls" if tool_calls else call.finish_reason
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [self._token_logprob(t, lp) for t, lp in zip(call.tokens, call.logprobs)]}
        head = self._head("chat.completion")
        reply = {**head, "choices": [choice], "usage": _usage(call)}
        delta: dict[str, Any] = {"role": "assistant", "content": content or ""}
        if tool_calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)]
        chunk = {**head, "object": "chat.completion.chunk"}
        chunks = [
            {**chunk, "choices": [{"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}]},
            {**chunk, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}]},
        ]
        return reply, chunks + self._usage_chunk(body, chunk, call)

    def completion(self, body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The reply to a ``/v1/completions`` request (a prompt as text or token ids) and its stream chunks."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a batch of one
        if isinstance(prompt, str):
            text, tokens = prompt, self._encode_text(prompt, fresh_special_tokens=True)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, tokens = None, list(prompt)
        else:
            raise RequestError("prompt must be a string or a list of token ids (one prompt per request)")
        logprobs = body.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or logprobs != 0):
            raise RequestError("logprobs: only 0 is served (each sampled token's logprob, no alternatives)")
        call = self._sample(body, tokens, [], text)
        call.content = self.tokenizer.decode(call.tokens, skip_special_tokens=True)
        choice: dict[str, Any] = {"index": 0, "text": call.content, "finish_reason": call.finish_reason, "logprobs": None}
        if logprobs == 0:
            choice["logprobs"] = {
                "tokens": [self.tokenizer.decode([t]) for t in call.tokens],
                "token_logprobs": call.logprobs,
                "top_logprobs": None,
            }
        head = self._head("text_completion")
        chunks = [
            {**head, "choices": [{**choice, "finish_reason": None}]},
            {**head, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": call.finish_reason}]},
        ]
        return {**head, "choices": [choice], "usage": _usage(call)}, chunks + self._usage_chunk(body, head, call)

    def _encode_text(self, text: str, fresh_special_tokens: bool = False) -> list[int]:
        """The tokens of a prompt's text: an earlier call's tokens for the longest earlier prompt and
        reply it extends, then the rest encoded (a template writes its special tokens itself; a
        plain-text prompt of its own gets the tokenizer's, as a single-turn prompt does)."""
        with self.lock:
            extended = [c for c in self.contexts if text.startswith(c.text)]
        if not extended:
            return list(self.tokenizer(text, add_special_tokens=fresh_special_tokens)["input_ids"])
        context = max(extended, key=lambda c: len(c.text))
        rest = text[len(context.text) :]
        tokens = context.tokens
        if context.special:
            # The template closes the turn with the token that ended it: the sampled one stays.
            if rest.startswith(context.special):
                rest = rest[len(context.special) :]
            else:
                tokens = tokens[:-1]
        return tokens + list(self.tokenizer(rest, add_special_tokens=False)["input_ids"]) if rest else list(tokens)

    def _sample(self, body: dict[str, Any], prompt: list[int], stop: list[str], text: str | None) -> Call:
        params = self._params(body, len(prompt), stop)
        try:
            completion, version = self.generate(prompt, params)
        except Exception as exc:
            with self.lock:
                self.error = self.error or exc
            raise RequestError(f"the run's sampler failed: {type(exc).__name__}: {exc}", 503, "server_error") from exc
        call = Call(prompt, list(completion.tokens), list(completion.logprobs), completion.finish_reason, version, None)
        reply_text = self.tokenizer.decode(call.tokens, skip_special_tokens=True)
        ended = call.tokens[-1:] if call.tokens and call.tokens[-1] in self.tokenizer.all_special_ids else []
        with self.lock:
            if not self.closed:
                self.calls.append(call)
                if text is not None:
                    special = self.tokenizer.decode(ended, skip_special_tokens=False) if ended else ""
                    self.contexts.append(Context(text + reply_text, prompt + call.tokens, special))
        return call

    def _params(self, body: dict[str, Any], prompt_length: int, stop: list[str]) -> SamplingParams:
        """The run's sampling settings with the request's token limit and stop strings; a request
        that asks to sample otherwise is refused (the policy trains on what the run's settings draw)."""
        model = body.get("model")
        if model is not None and model != self.model:
            raise RequestError(f"model {model!r} is not served here: the policy is {self.model!r} (OPENAI_MODEL)", 404, "model_not_found")
        for key, neutral in NEUTRAL.items():
            if body.get(key) and body[key] != neutral:  # absent, null, 0, false or empty: as neutral
                raise RequestError(f"{key}={body[key]!r} is not served: the policy is sampled as the run samples it")
        run = self.params
        for key in ("temperature", "top_p", "top_k"):
            asked = body.get(key)
            if asked is not None and not self.override_sampling and not _same(asked, getattr(run, key)):
                raise RequestError(
                    f"{key}={asked!r} differs from the run's {key} {getattr(run, key)!r}: the policy trains on samples drawn as the "
                    f"run draws them; drop {key} from the request, or pass --rollout-opt override_sampling=true to sample every "
                    "request with the run's settings"
                )
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise RequestError(f"max_tokens must be a positive integer, got {limit!r}")
        room = run.max_tokens if self.max_context is None else min(run.max_tokens, self.max_context - prompt_length)
        if room < 1:
            raise RequestError(
                f"the prompt has {prompt_length} tokens, which leaves no room in the model's context of {self.max_context}",
                code="context_length_exceeded",
            )
        asked_stop = body.get("stop") or []
        asked_stop = [asked_stop] if isinstance(asked_stop, str) else asked_stop
        if not isinstance(asked_stop, list) or not all(isinstance(s, str) and s for s in asked_stop):
            raise RequestError("stop must be a string or a list of non-empty strings")
        return attrs.evolve(run, max_tokens=min(room, limit or room), stop=[*run.stop, *stop, *asked_stop])

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": f"grpo-{secrets.token_hex(8)}", "object": kind, "created": int(time.time()), "model": self.model}

    def _token_logprob(self, token: int, logprob: float) -> dict[str, Any]:
        piece = self.tokenizer.decode([token])
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode()), "top_logprobs": []}

    @staticmethod
    def _usage_chunk(body: dict[str, Any], head: dict[str, Any], call: Call) -> list[dict[str, Any]]:
        options = body.get("stream_options") or {}
        return [{**head, "choices": [], "usage": _usage(call)}] if isinstance(options, dict) and options.get("include_usage") else []


def _same(asked: Any, run: float) -> bool:
    return isinstance(asked, (int, float)) and not isinstance(asked, bool) and math.isclose(asked, run, rel_tol=1e-9, abs_tol=1e-12)


def _usage(call: Call) -> dict[str, int]:
    prompt, completion = len(call.prompt_tokens), len(call.tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _plain_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message with its content as text: a list of text parts (as the OpenAI clients may send) joined."""
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError("message content parts: only text parts are served")
        message = {**message, "content": "".join(p["text"] for p in content)}
    elif content is None:
        message = {**message, "content": ""}
    elif not isinstance(content, str):
        raise RequestError("message content must be a string or a list of text parts")
    if "tool_calls" in message:
        # The template reads arguments as an object (as they were sampled), the client sends them as JSON text.
        message["tool_calls"] = [_tool_call_object(c) for c in message["tool_calls"] or []]
    return message


def _tool_call_object(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError as exc:
        raise RequestError(f"tool call arguments must be JSON: {exc}") from exc
    return {**call, "function": {**function, "arguments": arguments}}


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError("the request body is a JSON object")
    return body


class Gateway:
    """The server: started on a free port of 127.0.0.1 with a new key, serving until :meth:`close`."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.key = secrets.token_urlsafe(32)
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer((HOST, 0), _Handler)
        self.server.daemon_threads = True
        self.server.gateway = self  # type: ignore[attr-defined]
        # A short poll: close() waits for the serving loop to look.
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, name="grpo-core-agent-gateway", daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.server.server_address[1]}"

    def base_url(self, session: Session) -> str:
        """The session's ``OPENAI_BASE_URL``."""
        return f"{self.url}/s/{session.id}/v1"

    def open(
        self, generate: Generate, chat: Chat, params: SamplingParams, max_context: int | None, override_sampling: bool = False
    ) -> Session:
        session = Session(secrets.token_urlsafe(12), generate, chat, params, max_context, self.model, override_sampling)
        with self._lock:
            self.sessions[session.id] = session
        return session

    def end(self, session: Session) -> list[Call]:
        """Close the session: later requests are refused and replies still generating are not recorded."""
        with self._lock:
            self.sessions.pop(session.id, None)
        with session.lock:
            session.closed = True
            return list(session.calls)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "grpo-core-gateway"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def _serve(self, method: str) -> None:
        gateway: Gateway = self.server.gateway  # type: ignore[attr-defined]
        session = None
        try:
            raw = self._raw_body() if method == "POST" else b"{}"
            if not hmac.compare_digest(self.headers.get("Authorization", "").encode(), f"Bearer {gateway.key}".encode()):
                raise RequestError("a request carries the run's key: Authorization: Bearer $OPENAI_API_KEY", 401, "invalid_api_key")
            found = ROUTE.fullmatch(urlsplit(self.path).path)
            if found is None:
                raise RequestError(f"no such endpoint: {self.path} (served: $OPENAI_BASE_URL/models, /completions, /chat/completions)", 404)
            session = gateway.sessions.get(found.group(1))
            if session is None:
                raise RequestError("this session has ended (its program's sample is done)", 404)
            endpoint = found.group(2)
            body = _json_object(raw)
            if (method == "GET") != (endpoint == "models"):
                raise RequestError(f"{method} {endpoint} is not served (models is GET, completions POST)", 405)
            if endpoint == "models":
                self._send(
                    200, {"object": "list", "data": [{"id": gateway.model, "object": "model", "created": 0, "owned_by": "grpo-core"}]}
                )
                return
            reply, chunks = session.chat_completion(body) if endpoint == "chat/completions" else session.completion(body)
            if body.get("stream"):
                stream = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
                self._send(200, stream.encode(), "text/event-stream")
            else:
                self._send(200, reply)
        except RequestError as exc:
            self._send(exc.status, {"error": {"message": str(exc), "type": exc.code, "code": exc.code}})
        except Exception as exc:  # the gateway's own bug: the program gets a 500, the rollout raises it
            if session is not None:
                with session.lock:
                    session.error = session.error or exc
            self._send(500, {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error", "code": "server_error"}})

    def _raw_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True  # what follows on the connection cannot be found
            raise RequestError("the request has no Content-Length", 411)
        return self.rfile.read(int(length))

    def _send(self, status: int, payload: Any, content_type: str = "application/json") -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the program ended (or was ended) while its reply was generated

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would drown the run's output

    def log_error(self, format: str, *args: Any) -> None:
        print(f"agent gateway: {format % args}", file=sys.stderr)
