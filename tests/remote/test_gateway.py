"""The agent gateway over HTTP: its key, its address, the OpenAI endpoints and what it records."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from grpo_core import Completion, SamplingParams
from grpo_core.plugins.rollouts.agent import AgentChat
from grpo_core.plugins.rollouts.tool_formats import FORMATS
from grpo_core.remote.gateway import Gateway
from tests.plugins.rollouts.chat_templates import build_chat_tokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer("qwen3")


class Script:
    """A generate function that answers each call with the next reply: a text (ending in the
    tokenizer's eos token when it ends with ``<|im_end|>``) or token ids; logprob -0.5 per token."""

    def __init__(self, tokenizer, *replies):
        self.tokenizer, self.replies, self.seen = tokenizer, list(replies), []

    def __call__(self, tokens, params):
        self.seen.append((list(tokens), params))
        reply = self.replies.pop(0)
        ids = reply if isinstance(reply, list) else self.tokenizer(reply, add_special_tokens=False)["input_ids"]
        finish = "stop" if ids[-1:] == [self.tokenizer.eos_token_id] or str(reply).endswith("</tool_call>") else "length"
        return Completion(tokens=ids, logprobs=[-0.5] * len(ids), finish_reason=finish), 3


@pytest.fixture
def gateway():
    with Gateway("tiny") as gateway:
        yield gateway


def open_session(gateway, tokenizer, script, **params):
    chat = AgentChat(tokenizer, None, FORMATS["hermes"])
    session = gateway.open(script, chat, SamplingParams(**{"max_tokens": 16, **params}), max_context=1024)
    client = httpx.Client(base_url=gateway.base_url(session), headers={"Authorization": f"Bearer {gateway.key}"})
    return session, client


def test_it_listens_on_127_0_0_1_only_and_refuses_requests_without_the_runs_key(gateway, tokenizer):
    session, client = open_session(gateway, tokenizer, Script(tokenizer))
    assert gateway.server.socket.getsockname()[0] == "127.0.0.1" and gateway.url.startswith("http://127.0.0.1:")
    other = socket.gethostbyname(socket.gethostname())
    if not other.startswith("127."):
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://{other}:{gateway.server.server_address[1]}/s/{session.id}/v1/models", timeout=5)
    url = f"{gateway.base_url(session)}/models"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer not-the-key"}).status_code == 401
    refused = httpx.post(f"{gateway.base_url(session)}/chat/completions", json={"messages": []}, headers={"Authorization": "Bearer x"})
    assert refused.status_code == 401 and "OPENAI_API_KEY" in refused.json()["error"]["message"]
    listed = client.get("/models")
    assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == ["tiny"]
    assert client.get("/nothing").status_code == 404
    assert client.post("/models", json={}).status_code == 405
    with Gateway("other") as other_run:
        assert len(gateway.key) >= 40 and other_run.key != gateway.key


def test_a_chat_call_is_rendered_by_the_template_and_the_next_call_keeps_the_sampled_tokens(gateway, tokenizer):
    # "what" sampled as four one-letter tokens: encoding the text again would give one token.
    letters = [tokenizer(c, add_special_tokens=False)["input_ids"][0] for c in "what"] + [tokenizer.eos_token_id]
    script = Script(tokenizer, letters, "The answer is 5.<|im_end|>")
    session, client = open_session(gateway, tokenizer, script)
    messages = [{"role": "user", "content": "what is 2 plus 3?"}]
    first = client.post("/chat/completions", json={"model": "tiny", "messages": messages}).json()
    assert first["choices"][0]["message"] == {"role": "assistant", "content": "what"}
    assert first["choices"][0]["finish_reason"] == "stop" and first["usage"]["completion_tokens"] == 5
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert script.seen[0][0] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    # The content as a list of text parts, as OpenAI clients may send it.
    messages += [{"role": "assistant", "content": "what"}, {"role": "user", "content": [{"type": "text", "text": "again"}]}]
    second = client.post("/chat/completions", json={"messages": messages, "logprobs": True}).json()
    assert second["choices"][0]["message"]["content"] == "The answer is 5."
    assert [t["logprob"] for t in second["choices"][0]["logprobs"]["content"]] == [-0.5] * 6
    calls = gateway.end(session)
    assert [c.version for c in calls] == [3, 3] and calls[1].content == "The answer is 5."
    history = calls[0].prompt_tokens + calls[0].tokens
    assert calls[1].prompt_tokens[: len(history)] == history
    again = tokenizer.apply_chat_template(
        [{"role": "user", "content": "what is 2 plus 3?"}, {"role": "assistant", "content": "what"}, {"role": "user", "content": "again"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    # The template's own text past the reply, the reply's end of turn written once.
    assert tokenizer.decode(calls[1].prompt_tokens) == again
    assert client.get("/models").status_code == 404  # the session has ended


def test_a_completion_prompt_extending_an_earlier_one_keeps_its_tokens_and_token_ids_are_taken_as_they_are(gateway, tokenizer):
    letters = [tokenizer(c, add_special_tokens=False)["input_ids"][0] for c in "what"]
    script = Script(tokenizer, letters, " answer", [5, 6])
    session, client = open_session(gateway, tokenizer, script)
    first = client.post("/completions", json={"prompt": "Q: 1\nA:"}).json()
    assert first["choices"][0]["text"] == "what" and first["choices"][0]["finish_reason"] == "length"
    client.post("/completions", json={"prompt": "Q: 1\nA:what is", "logprobs": 0})
    client.post("/completions", json={"prompt": [[7, 8, 9]]})
    calls = gateway.end(session)
    assert calls[1].prompt_tokens == calls[0].prompt_tokens + letters + tokenizer(" is", add_special_tokens=False)["input_ids"]
    assert calls[2].prompt_tokens == [7, 8, 9]


def test_the_runs_sampling_settings_hold_and_a_request_may_only_narrow_them(gateway, tokenizer):
    script = Script(tokenizer, *["what"] * 4)
    session, client = open_session(gateway, tokenizer, script, temperature=0.7, stop=["\n"])
    neutral = {"n": 1, "logit_bias": {}, "presence_penalty": 0, "echo": False, "seed": 3, "user": "me"}
    ok = client.post("/completions", json={"prompt": "Q", "max_tokens": 4, "stop": "!", "temperature": 0.7, **neutral})
    assert ok.status_code == 200
    params = script.seen[0][1]
    assert params.max_tokens == 4 and params.stop == ["\n", "!"] and params.temperature == 0.7
    client.post("/completions", json={"prompt": "Q", "max_tokens": 1000})
    assert script.seen[1][1].max_tokens == 16  # never past the run's --max-completion-tokens
    for body, status, said in [
        ({"temperature": 1.0}, 400, "differs from the run's temperature 0.7"),
        ({"top_p": 0.5}, 400, "override_sampling=true"),
        ({"n": 2}, 400, "n=2 is not served"),
        ({"model": "gpt-4o"}, 404, "the policy is 'tiny'"),
        ({"max_tokens": 0}, 400, "max_tokens must be a positive integer"),
        ({"logprobs": 5}, 400, "logprobs: only 0"),
        ({"logprobs": True}, 400, "logprobs: only 0"),
        ({"logit_bias": {"5": 100}}, 400, "logit_bias={'5': 100} is not served"),
        ({"echo": True}, 400, "echo=True is not served"),
        ({"prompt": list(range(1024))}, 400, "leaves no room in the model's context of 1024"),
        ({"prompt": {"text": "Q"}}, 400, "prompt must be a string or a list of token ids"),
    ]:
        refused = client.post("/completions", json={"prompt": "Q", **body})
        assert refused.status_code == status and said in refused.json()["error"]["message"], (body, refused.text)
    assert client.post("/completions", content=b"not json", headers={"Content-Type": "application/json"}).status_code == 400
    assert client.post("/chat/completions", json={"messages": "hi"}).status_code == 400
    assert len(gateway.end(session)) == 2
    _, overriding = open_session(gateway, tokenizer, Script(tokenizer, "what"), temperature=0.7)
    overriding_session = gateway.open(script, AgentChat(tokenizer, None, FORMATS["hermes"]), SamplingParams(), None, True)
    assert overriding.post("/completions", json={"prompt": "Q", "temperature": 1.0}).status_code == 400
    script.replies = ["what"]
    taken = httpx.post(
        f"{gateway.base_url(overriding_session)}/completions", json={"prompt": "Q", "temperature": 1.0},
        headers={"Authorization": f"Bearer {gateway.key}"},
    )  # fmt: skip
    assert taken.status_code == 200 and script.seen[-1][1].temperature == 1.0  # the run's (SamplingParams() default)


def test_tool_calls_come_back_as_openai_tool_calls_and_a_malformed_one_as_text(gateway, tokenizer):
    script = Script(tokenizer, "Let me add. " + CALL, "<tool_call>\n{not json}\n</tool_call>")
    session, client = open_session(gateway, tokenizer, script)
    body = {"messages": [{"role": "user", "content": "2 plus 3?"}], "tools": TOOLS}
    choice = client.post("/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me add."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3} and call["id"].startswith("call_")
    assert script.seen[0][1].stop == ["</tool_call>"]  # the format's stop string, with tools only
    rendered = tokenizer.apply_chat_template(
        body["messages"], tools=[t["function"] for t in TOOLS], add_generation_prompt=True, tokenize=False
    )
    assert "add" in tokenizer.decode(script.seen[0][0]) and tokenizer.decode(script.seen[0][0]).startswith(rendered[:30])
    malformed = client.post("/chat/completions", json=body).json()["choices"][0]
    assert "tool_calls" not in malformed["message"] and malformed["message"]["content"].startswith("<tool_call>")
    assert client.post("/chat/completions", json={**body, "tool_choice": "required"}).status_code == 400
    gateway.end(session)


def test_stream_true_is_served_as_server_sent_events(gateway, tokenizer):
    script = Script(tokenizer, "The answer is 5.<|im_end|>")
    session, client = open_session(gateway, tokenizer, script)
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": {"include_usage": True}}
    answer = client.post("/chat/completions", json=body)
    assert answer.headers["content-type"] == "text/event-stream"
    events = [line.removeprefix("data: ") for line in answer.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": "The answer is 5."}, {}]
    assert chunks[1]["choices"][0]["finish_reason"] == "stop" and chunks[2] == {**chunks[2], "choices": [], "usage": chunks[2]["usage"]}
    assert chunks[2]["usage"]["completion_tokens"] == 6 and len(gateway.end(session)) == 1


@pytest.mark.slow  # importing the openai package takes seconds
def test_the_openai_client_reads_replies_streams_and_tool_calls(gateway, tokenizer):
    openai = pytest.importorskip("openai")
    script = Script(tokenizer, "The answer is 5.<|im_end|>", CALL, "what")
    session, _ = open_session(gateway, tokenizer, script)
    client = openai.OpenAI(base_url=gateway.base_url(session), api_key=gateway.key)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "The answer is 5."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop" and chunks[-1].usage.completion_tokens == 6
    streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, stream=True)
    deltas = [c.choices[0].delta for c in streamed]
    (call,) = [t for d in deltas for t in d.tool_calls or []]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    text = "".join(c.choices[0].text for c in client.completions.create(model="tiny", prompt="Q", stream=True))
    assert text == "what" and len(gateway.end(session)) == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.base_url(session), api_key="wrong").models.list()


def test_a_sampler_failure_is_the_runs_error_not_the_programs(gateway, tokenizer):
    def broken(tokens, params):
        raise RuntimeError("the engine died")

    session, client = open_session(gateway, tokenizer, broken)
    answer = client.post("/completions", json={"prompt": "Q"})
    assert answer.status_code == 503 and "the engine died" in answer.json()["error"]["message"]
    assert isinstance(session.error, RuntimeError) and gateway.end(session) == []
