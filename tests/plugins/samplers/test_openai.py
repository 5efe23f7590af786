from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from grpo_core import PluginError, SamplingParams
from grpo_core.config import RunConfig
from grpo_core.metrics import scope
from grpo_core.plugins.samplers.openai import OpenAISampler, ServerSampler
from grpo_core.remote.server_client import TOKENIZER_PROBE, ServerClient, ServerResponseError, ServerUnavailable
from tests.plugins.samplers.fake_server import FakeTrainer, FakeVLLM, LocalHTTPServer, run_through_fake_server

FAST_BACKOFF = (0.01, 0.05)


def make_sampler(fake, tokenizer, retry_deadline=5.0, concurrency=8, prompts_per_request=1, api_key=""):
    client = ServerClient(
        "http://fake/v1",
        api_key=api_key,
        concurrency=concurrency,
        retry_deadline=retry_deadline,
        transport=httpx.MockTransport(fake),
        backoff=FAST_BACKOFF,
    )
    return ServerSampler(client=client, tokenizer=tokenizer, model="tiny", prompts_per_request=prompts_per_request)


def expected_tokens(fake, prompt, j, max_tokens):
    return [(sum(prompt) + j + k) % len(fake.tokenizer) for k in range(max_tokens)]


def test_sample_sends_token_ids_and_sampling_settings_and_groups_completions_by_prompt(tokenizer):
    fake = FakeVLLM(tokenizer)
    sampler = make_sampler(fake, tokenizer)
    prompts = [[5, 6, 7], [9, 10]]
    params = SamplingParams(max_tokens=3, temperature=1.0, top_p=1.0, top_k=0, stop=["####"], stop_token_ids=[4])
    groups, recorded = sample_recorded(sampler, prompts, 2, params)

    bodies = sorted((b for p, b in fake.requests if p == "/v1/completions"), key=lambda b: b["prompt"])
    assert [b["prompt"] for b in bodies] == [[[5, 6, 7]], [[9, 10]]]
    for b in bodies:
        assert b["n"] == 2 and b["max_tokens"] == 3 and b["temperature"] == 1.0 and b["top_p"] == 1.0
        assert b["logprobs"] == 0 and b["return_token_ids"] is True and b["model"] == "tiny"
        assert b["stop"] == ["####"] and b["stop_token_ids"] == [4] and "top_k" not in b
    assert len(groups) == 2 and all(len(g) == 2 for g in groups)
    for prompt, group in zip(prompts, groups):
        for j, completion in enumerate(group):
            assert completion.tokens == expected_tokens(fake, prompt, j, 3)
            assert completion.logprobs == pytest.approx([-0.1 - j / 100, -0.2 - j / 100, -0.3 - j / 100])
            assert completion.finish_reason == "length"
    assert recorded == {
        "sampler/requests": 2.0, "sampler/retries": 0.0, "sampler/reconnects": 0.0, "sampler/prompts": 2.0, "sampler/completions": 4.0,
        "sampler/concurrency_window": 8.0,
    }  # fmt: skip
    sampler.close()


def test_prompts_per_request_splits_the_step_and_keeps_prompt_order(tokenizer):
    fake = FakeVLLM(tokenizer)
    sampler = make_sampler(fake, tokenizer, prompts_per_request=2)
    prompts = [[1, 2], [3], [4, 5, 6]]
    groups = sampler.sample(prompts, 3, SamplingParams(max_tokens=2))
    sent = sorted(b["prompt"] for p, b in fake.requests if p == "/v1/completions")
    assert sent == [[[1, 2], [3]], [[4, 5, 6]]]
    assert [[c.tokens for c in g] for g in groups] == [[expected_tokens(fake, p, j, 2) for j in range(3)] for p in prompts]
    sampler.close()


def counting_in_flight(fake):
    """A transport handler that answers as ``fake`` after 50 ms, and the most requests it had in flight."""
    in_flight, peak, lock = [0], [0], threading.Lock()

    async def slow(request):
        import asyncio

        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        await asyncio.sleep(0.05)
        with lock:
            in_flight[0] -= 1
        return fake(request)

    return slow, peak


def test_requests_are_pipelined_up_to_the_concurrency_window(tokenizer):
    fake = FakeVLLM(tokenizer)
    slow, peak = counting_in_flight(fake)

    for concurrency, want in ((3, 3), (1, 1)):
        peak[0] = 0
        client = ServerClient("http://fake", concurrency=concurrency, transport=httpx.MockTransport(slow), backoff=FAST_BACKOFF)
        sampler = ServerSampler(client=client, tokenizer=tokenizer, model="tiny", prompts_per_request=1)
        groups = sampler.sample([[i + 1] for i in range(8)], 2, SamplingParams(max_tokens=1))
        assert len(groups) == 8 and peak[0] == want
        sampler.close()


def test_sample_calls_from_several_threads_share_the_window_and_get_their_own_groups(tokenizer):
    fake = FakeVLLM(tokenizer)
    slow, peak = counting_in_flight(fake)

    client = ServerClient("http://fake", concurrency=3, transport=httpx.MockTransport(slow), backoff=FAST_BACKOFF)
    sampler = ServerSampler(client=client, tokenizer=tokenizer, model="tiny")
    prompts = {t: [[10 * t + 1], [10 * t + 2]] for t in range(4)}
    results = {}

    def call(t):
        results[t] = sampler.sample(prompts[t], 2, SamplingParams(max_tokens=2))

    threads = [threading.Thread(target=call, args=(t,)) for t in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert peak[0] == 3
    for t, groups in results.items():
        assert [[c.tokens for c in g] for g in groups] == [[expected_tokens(fake, p, j, 2) for j in range(2)] for p in prompts[t]]
    sampler.close()


def test_top_k_and_greedy(tokenizer):
    fake = FakeVLLM(tokenizer)
    sampler = make_sampler(fake, tokenizer)
    sampler.logprobs_mode = "processed"
    sampler.sample([[1, 2]], 2, SamplingParams(max_tokens=2, top_k=5))
    assert fake.requests[-1][1]["top_k"] == 5
    # Greedy samples from a point mass: logprob 0 for every token, as the in-process sampler reports.
    greedy = sampler.sample([[1, 2]], 2, SamplingParams(max_tokens=2, temperature=0.0))
    assert fake.requests[-1][1]["temperature"] == 0.0
    assert [c.logprobs for c in greedy[0]] == [[0.0, 0.0], [0.0, 0.0]]
    sampler.close()


@pytest.mark.parametrize(
    "failure",
    [429, 500, 502, 503, 504, httpx.ConnectError("refused"), httpx.ReadTimeout("slow"), httpx.RemoteProtocolError("disconnected")],
    ids=str,
)
def test_retryable_failures_are_retried_and_counted(tokenizer, failure):
    fake = FakeVLLM(tokenizer)
    fake.failures = [failure, failure]
    sampler = make_sampler(fake, tokenizer)
    groups, recorded = sample_recorded(sampler, [[3, 4]], 2, SamplingParams(max_tokens=2))
    assert [c.tokens for c in groups[0]] == [expected_tokens(fake, [3, 4], j, 2) for j in range(2)]
    assert recorded["sampler/retries"] == 2.0 and recorded["sampler/requests"] == 3.0
    assert recorded["sampler/prompts"] == 1.0 and recorded["sampler/completions"] == 2.0
    sampler.close()


def test_retry_deadline_ends_with_a_clear_error(tokenizer):
    fake = FakeVLLM(tokenizer)
    fake.failures = [503] * 1000
    sampler = make_sampler(fake, tokenizer, retry_deadline=0.3)
    started = time.monotonic()
    with pytest.raises(
        ServerUnavailable, match=r"POST http://fake/v1/completions kept failing .*retry deadline 0.3s.*HTTP 503: fake failure 503"
    ):
        sampler.sample([[1]], 2, SamplingParams(max_tokens=1))
    assert time.monotonic() - started < 2.0
    assert sum(1 for p, _ in fake.requests if p == "/v1/completions") >= 3
    sampler.close()


def test_retry_after_header_is_honoured(tokenizer):
    fake = FakeVLLM(tokenizer)
    calls = []

    def handler(request):
        calls.append(time.monotonic())
        if len(calls) == 1:
            return httpx.Response(429, headers={"retry-after": "0.04"}, json={"error": {"message": "busy"}})
        return fake(request)

    client = ServerClient("http://fake", transport=httpx.MockTransport(handler), backoff=(0.001, 1.0))
    sampler = ServerSampler(client=client, tokenizer=tokenizer, model="tiny")
    sampler.sample([[1]], 2, SamplingParams(max_tokens=1))
    assert calls[1] - calls[0] >= 0.04
    sampler.close()


def test_a_client_error_is_not_retried(tokenizer):
    fake = FakeVLLM(tokenizer)
    fake.failures = [400]
    sampler = make_sampler(fake, tokenizer)
    with pytest.raises(ServerResponseError, match="failed with HTTP 400: fake failure 400"):
        sampler.sample([[1]], 2, SamplingParams(max_tokens=1))
    assert len(fake.requests) == 1
    sampler.close()


def _drop(key):
    def edit(choice):
        del choice[key]

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_drop("token_ids"), "completion text without its token ids; grpo-core trains on the sampled ids and never re-tokenizes"),
        (_drop("logprobs"), "no usable logprob for every sampled token"),
        (lambda c: c["logprobs"].update(token_logprobs=c["logprobs"]["token_logprobs"][:-1]), "no usable logprob for every sampled token"),
        (lambda c: c["logprobs"].update(token_logprobs=[None] * len(c["token_ids"])), "no usable logprob"),
        (lambda c: c["logprobs"].update(token_logprobs=[float("nan")] * len(c["token_ids"])), "no usable logprob"),
        (lambda c: c.update(token_ids=[10**6] + c["token_ids"][1:]), r"token ids outside the tokenizer's vocabulary of \d+: \[1000000\]"),
        (lambda c: c.update(token_ids=[-1] + c["token_ids"][1:]), r"outside the tokenizer's vocabulary"),
        (lambda c: c.update(finish_reason="abort"), "finish_reason 'abort'"),
    ],
)
def test_unusable_responses_are_clear_errors(tokenizer, edit, message):
    fake = FakeVLLM(tokenizer)
    fake.choice_edit = edit
    sampler = make_sampler(fake, tokenizer)
    with pytest.raises(ServerResponseError, match=message):
        sampler.sample([[1, 2]], 2, SamplingParams(max_tokens=3))
    sampler.close()


def test_wrong_number_of_choices_is_an_error(tokenizer):
    fake = FakeVLLM(tokenizer)
    sampler = make_sampler(fake, tokenizer)
    original = fake.complete
    fake.complete = lambda body: original(body)[:-1]
    with pytest.raises(ServerResponseError, match=r"returned 1 completions for 1 prompt\(s\) x n=2"):
        sampler.sample([[1, 2]], 2, SamplingParams(max_tokens=3))
    sampler.close()


def test_empty_prompt_is_refused_before_any_request(tokenizer):
    fake = FakeVLLM(tokenizer)
    sampler = make_sampler(fake, tokenizer)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        sampler.sample([[1], []], 2, SamplingParams())
    assert fake.requests == []
    sampler.close()


def test_a_dropped_connection_runs_the_reconnect_hook_once_before_requests_go_on(tokenizer):
    fake = FakeVLLM(tokenizer)
    sampler = make_sampler(fake, tokenizer, concurrency=4)
    log = []

    def resync():
        # The hook itself talks to the server through the same client, as the weight sync does.
        log.append(("resync", sampler.client.post("/reset_prefix_cache", {}, resync=False)))

    sampler.client.on_reconnect = resync
    fake.failures = [httpx.ConnectError("refused")] * 4 + [503]
    groups, recorded = sample_recorded(sampler, [[i + 1] for i in range(6)], 2, SamplingParams(max_tokens=1))
    assert [g[0].tokens for g in groups] == [expected_tokens(fake, [i + 1], 0, 1) for i in range(6)]
    assert len(log) == 1
    assert recorded["sampler/reconnects"] == 1.0 and recorded["sampler/retries"] == 5.0
    # Every prompt was answered exactly once.
    answered = [b["prompt"][0] for p, b in fake.requests[5:] if p == "/v1/completions"]
    assert sorted(answered) == [[i + 1] for i in range(6)]

    # Busy (503) and slow (timeout) servers kept their weights: no resync.
    fake.failures = [503, httpx.ReadTimeout("slow")]
    _, recorded = sample_recorded(sampler, [[1]], 2, SamplingParams(max_tokens=1))
    assert len(log) == 1 and recorded["sampler/reconnects"] == 0.0
    sampler.close()


def test_api_key_is_sent_as_bearer_and_never_shown(tokenizer):
    seen = []
    fake = FakeVLLM(tokenizer)

    def handler(request):
        seen.append(request.headers.get("authorization"))
        return fake(request)

    client = ServerClient("http://fake", api_key="sk-very-secret", transport=httpx.MockTransport(handler), backoff=FAST_BACKOFF)
    ServerSampler(client=client, tokenizer=tokenizer, model="tiny").sample([[1]], 2, SamplingParams(max_tokens=1))
    assert seen == ["Bearer sk-very-secret"]
    assert "sk-very-secret" not in repr(OpenAISampler(api_key="sk-very-secret"))
    client.close()


def test_option_fields_are_checked():
    for bad in ({"concurrency": 0}, {"prompts_per_request": 0}, {"timeout": 0.0}, {"retry_deadline": -1.0}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be"):
            OpenAISampler(**bad)


def test_tokenizer_check(tokenizer):
    fake = FakeVLLM(tokenizer)
    sampler = make_sampler(fake, tokenizer)
    sampler.check_tokenizer()
    assert fake.requests[-1] == ("/tokenize", {"model": "tiny", "prompt": TOKENIZER_PROBE, "add_special_tokens": False})
    fake.tokenize_shift = 1
    with pytest.raises(
        PluginError, match=r"the server's tokenizer differs from the trainer's: a probe text tokenizes differently from token 0 on"
    ):
        sampler.check_tokenizer()
    fake.answer = lambda method, path, body: httpx.Response(404, json={"detail": "Not Found"})
    with pytest.raises(PluginError, match="needs --sampler-opt check_tokenizer=false"):
        sampler.check_tokenizer()
    sampler.close()


def test_raw_logprobs_are_refused_when_sampling_changes_the_distribution(tokenizer):
    fake = FakeVLLM(tokenizer)
    sampler = make_sampler(fake, tokenizer)
    params = SamplingParams(max_tokens=2, temperature=0.7)
    # The fake scores every prompt token at -1.0: a sampled logprob of -1.0 is the raw one.
    fake.choice_edit = lambda c: c["logprobs"].update(token_logprobs=[-1.0] * len(c["token_ids"]))
    with pytest.raises(PluginError, match="start vLLM with --logprobs-mode processed_logprobs"):
        sampler.sample([[1, 2]], 2, params)
    fake.choice_edit = lambda c: c["logprobs"].update(token_logprobs=[-0.4] * len(c["token_ids"]))
    sampler.sample([[1, 2]], 2, params)
    assert sampler.logprobs_mode == "processed"
    asked = len(fake.requests)
    sampler.sample([[1, 2]], 2, params)
    assert len(fake.requests) == asked + 1  # measured once
    sampler.close()


def test_default_sampling_settings_need_no_logprobs_probe(tokenizer):
    fake = FakeVLLM(tokenizer)
    sampler = make_sampler(fake, tokenizer)
    sampler.sample([[1, 2]], 2, SamplingParams(max_tokens=2))
    assert [p for p, _ in fake.requests] == ["/v1/completions"] and sampler.logprobs_mode is None
    sampler.close()


def test_make_sampler_over_http_finds_the_model_checks_the_tokenizer_and_samples(tokenizer, monkeypatch):
    fake = FakeVLLM(tokenizer, max_model_len=200)
    server = LocalHTTPServer(fake)
    try:
        plugin = OpenAISampler(base_url=server.url + "/v1/", retry_deadline=5.0)
        sampler = plugin.make_sampler(config=RunConfig(), trainer=FakeTrainer(tokenizer, version=3))
        assert sampler.model == "tiny" and sampler.max_context == 200 and sampler.version == 3
        assert [p for p, _ in fake.requests] == ["/v1/models", "/tokenize"]  # the models are read once
        groups = sampler.sample([[7, 8]], 3, SamplingParams(max_tokens=4))
        assert [c.tokens for c in groups[0]] == [expected_tokens(fake, [7, 8], j, 4) for j in range(3)]
        sampler.close()

        with pytest.raises(PluginError, match="does not serve model 'other'"):
            OpenAISampler(base_url=server.url, model="other").make_sampler(config=RunConfig(), trainer=FakeTrainer(tokenizer))
        fake.tokenize_shift = 2
        with pytest.raises(PluginError, match="tokenizer differs"):
            OpenAISampler(base_url=server.url).make_sampler(config=RunConfig(), trainer=FakeTrainer(tokenizer))
        skipped = OpenAISampler(base_url=server.url, check_tokenizer=False).make_sampler(config=RunConfig(), trainer=FakeTrainer(tokenizer))
        skipped.close()
    finally:
        server.close()


def test_by_default_eight_prompts_go_in_one_request(tokenizer):
    fake = FakeVLLM(tokenizer)
    server = LocalHTTPServer(fake)
    try:
        sampler = OpenAISampler(base_url=server.url).make_sampler(config=RunConfig(), trainer=FakeTrainer(tokenizer))
        prompts = [[i + 1, 2] for i in range(20)]
        groups, recorded = sample_recorded(sampler, prompts, 2, SamplingParams(max_tokens=2))
        sent = sorted(b["prompt"] for p, b in fake.requests if p == "/v1/completions")
        assert sent == [prompts[0:8], prompts[8:16], prompts[16:20]]
        assert [[c.tokens for c in g] for g in groups] == [[expected_tokens(fake, p, j, 2) for j in range(2)] for p in prompts]
        assert recorded["sampler/requests"] == 3.0 and recorded["sampler/prompts"] == 20.0
        sampler.close()
    finally:
        server.close()


def test_make_sampler_names_the_models_when_several_are_served(tokenizer):
    fake = FakeVLLM(tokenizer)
    original = fake.answer

    def two_models(method, path, body):
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "a"}, {"id": "b"}]})
        return original(method, path, body)

    fake.answer = two_models
    server = LocalHTTPServer(fake)
    try:
        with pytest.raises(PluginError, match=r"serves \['a', 'b'\]; choose one with --sampler-opt model=NAME"):
            OpenAISampler(base_url=server.url).make_sampler(config=RunConfig(), trainer=FakeTrainer(tokenizer))
    finally:
        server.close()


def test_a_server_that_never_answers_stops_make_sampler_within_the_deadline(tokenizer):
    server = LocalHTTPServer(FakeVLLM(tokenizer))
    url = server.url
    server.close()  # nothing listens there any more: every connection is refused
    started = time.monotonic()
    with pytest.raises(ServerUnavailable, match=r"server at http://127.0.0.1:\d+ did not answer GET /v1/models within 0.5s .*ConnectError"):
        OpenAISampler(base_url=url, retry_deadline=0.5).make_sampler(config=RunConfig(), trainer=FakeTrainer(tokenizer))
    assert time.monotonic() - started < 5.0


def test_plugin_options_reach_the_client(tokenizer, monkeypatch):
    fake = FakeVLLM(tokenizer)
    server = LocalHTTPServer(fake)
    try:
        monkeypatch.setenv("GRPO_TEST_KEY", "sk-from-env")
        from grpo_core.plugins_manager import make_plugin

        plugin = make_plugin(
            "sampler.openai",
            base_url=server.url,
            api_key="env:GRPO_TEST_KEY",
            timeout="0.5",
            retry_deadline="1.0",
            concurrency="5",
            prompts_per_request="3",
        )
        sampler = plugin.make_sampler(config=RunConfig(), trainer=FakeTrainer(tokenizer))
        assert set(fake.authorizations) == {"Bearer sk-from-env"}
        assert sampler.concurrent_samples == 5  # the async loop's workers may call it this many at once
        sampler.sample([[i + 1] for i in range(7)], 1, SamplingParams(max_tokens=1))
        assert sorted(len(b["prompt"]) for p, b in fake.requests if p == "/v1/completions") == [1, 3, 3]
        # A completion slower than the timeout is cut off and retried until the deadline.
        fake.delay = 0.8
        with pytest.raises(ServerUnavailable, match="ReadTimeout"):
            sampler.sample([[1]], 2, SamplingParams(max_tokens=1))
        sampler.close()
    finally:
        fake.delay = 0.0
        server.close()


def test_idle_connections_are_dropped_before_the_servers_keep_alive_timeout(monkeypatch):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from grpo_core.remote import server_client

    # vLLM closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (default 5) seconds; a request
    # sent on it as it closes fails like a server that went away.
    assert server_client.KEEPALIVE_EXPIRY < 5
    ports = []

    class KeepAlive(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            ports.append(self.client_address[1])
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    server = ThreadingHTTPServer(("127.0.0.1", 0), KeepAlive)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(server_client, "KEEPALIVE_EXPIRY", 0.3)
    client = ServerClient(f"http://127.0.0.1:{server.server_address[1]}")
    try:
        client.get("/a")
        client.get("/b")  # at once: the same connection
        time.sleep(0.6)
        client.get("/c")  # idle past the expiry: a new one
        assert ports[0] == ports[1] != ports[2]
        assert client.counts == {"requests": 3, "retries": 0, "reconnects": 0}
    finally:
        client.close()
        server.shutdown()
        server.server_close()


def sample_recorded(sampler, prompts, num_samples, params):
    """What ``sample`` returns, and what it recorded for the step's metrics."""
    with scope() as recorded:
        groups = sampler.sample(prompts, num_samples, params)
    return groups, recorded


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_a_run_through_the_server_records_its_requests_in_every_step(tiny_model_dir, tiny_dataset, tokenizer, tmp_path, loop):
    """The sampler's counts reach the step's metrics in both loops (the async loop's rollout
    workers record them in their own scopes, merged into the step's)."""
    fake, metrics = run_through_fake_server(tiny_model_dir, tiny_dataset, tokenizer, tmp_path, loop)
    sent = [b for p, b in fake.requests if p == "/v1/completions" and "prompt_logprobs" not in b]
    assert [m["sampler/prompts"] for m in metrics] == [2.0, 2.0]
    assert [m["sampler/completions"] for m in metrics] == [4.0, 4.0]
    assert [m["sampler/requests"] for m in metrics] == [2.0, 2.0] and len(sent) >= 4
    assert all(m["sampler/retries"] == 0.0 and "sync/logprob_max_abs_diff" in m for m in metrics)
    # The fake server's logprobs are not the model's: the mismatch shows, every step, in both loops.
    assert all(m["mismatch/logprob_abs_max"] >= m["mismatch/logprob_abs_mean"] > 0.01 and m["mismatch/kl_k3"] > 0 for m in metrics)


def test_a_long_wait_prints_which_server_how_long_and_the_retries_so_far(capsys):
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # accepts (the kernel does), never answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    client = ServerClient(url, timeout=0.4, retry_deadline=3, progress_every=0.3, backoff=(0.05, 0.1))
    try:
        with pytest.raises(ServerUnavailable, match=r"kept failing .*retry deadline 3s.*ReadTimeout"):
            client.get("/v1/models")
    finally:
        client.close()
        listener.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith(f"sampler server {url}: ") for line in lines)
    assert re.fullmatch(r"sampler server \S+: waiting for an answer for 0s \(1 requests, 0 retries so far\)", lines[0])
    assert re.fullmatch(
        r"sampler server \S+: waiting for an answer for [1-9]s \(\d+ requests, [1-9]\d* retries so far; last error: ReadTimeout\)",
        lines[-1],
    )
