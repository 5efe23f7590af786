from __future__ import annotations

import asyncio
import math
import threading
import time

import httpx
import pytest

from grpo_core import PluginError, SamplingParams
from grpo_core.config import RunConfig
from grpo_core.metrics import scope
from grpo_core.plugins.samplers.openai import AUTO_INITIAL_WINDOW, AUTO_MAX_WINDOW, OpenAISampler, ServerSampler
from grpo_core.plugins_manager import make_plugin
from grpo_core.remote import server_client
from grpo_core.remote.server_client import ConcurrencyWindow, ServerClient
from tests.plugins.samplers.fake_server import FakeTrainer, FakeVLLM, LocalHTTPServer, run_through_fake_server

FAST_BACKOFF = (0.01, 0.02)


def delayed(fake, seconds):
    """An async transport handler that answers as ``fake`` after ``seconds(i)`` (i: the request's number)."""
    count = [0]

    async def handler(request):
        i = count[0]
        count[0] += 1
        await asyncio.sleep(seconds(i))
        return fake(request)

    return handler


def adaptive_sampler(fake, tokenizer, handler, window):
    client = ServerClient("http://fake", concurrency=window, transport=httpx.MockTransport(handler), backoff=FAST_BACKOFF)
    return ServerSampler(client=client, tokenizer=tokenizer, model="tiny", prompts_per_request=1)


def sample_window(sampler, prompts):
    with scope() as metrics:
        sampler.sample([[i + 1] for i in range(prompts)], 1, SamplingParams(max_tokens=1))
    return metrics["sampler/concurrency_window"]


def test_the_window_grows_by_one_per_round_under_a_fast_server_and_is_recorded(tokenizer, monkeypatch):
    # Every answer counts as fast: on a loaded CI machine the client's own event loop delays some
    # answers past the tolerance, and how much the window grows must not depend on that (the
    # shrinking is test_a_latency_blow_up_shrinks_the_window's).
    monkeypatch.setattr(server_client, "LATENCY_TOLERANCE", math.inf)
    fake = FakeVLLM(tokenizer)
    window = ConcurrencyWindow(AUTO_INITIAL_WINDOW, low=1, high=256)
    sampler = adaptive_sampler(fake, tokenizer, delayed(fake, lambda i: 0.02), window)
    recorded = sample_window(sampler, 200)
    # +1/size per request that ends while the window is full, from 16: size**2 grows by about 2
    # per request, for all 200 but the last window's worth (they end with none waiting).
    assert 24.0 < window.size < 25.5
    assert recorded == window.limit
    sampler.close()


def test_a_window_that_is_not_full_does_not_grow(tokenizer):
    fake = FakeVLLM(tokenizer)
    window = ConcurrencyWindow(16, low=1, high=256)
    sampler = adaptive_sampler(fake, tokenizer, delayed(fake, lambda i: 0.02), window)
    for _ in range(5):
        sample_window(sampler, 4)  # 4 requests never fill 16 slots
    assert window.size == 16.0
    sampler.close()


@pytest.mark.parametrize("failure", [503, 429, httpx.ReadTimeout("timed out")])
def test_failures_halve_the_window_once_per_round(tokenizer, failure):
    fake = FakeVLLM(tokenizer)
    fake.failures = [failure] * 4
    window = ConcurrencyWindow(16, low=1, high=256)
    sampler = adaptive_sampler(fake, tokenizer, delayed(fake, lambda i: 0.02), window)
    sample_window(sampler, 4)
    # Four requests in flight together failed: one congestion signal, one halving (not 16 / 2**4).
    assert window.size == 8.0
    fake.failures = [failure]
    sample_window(sampler, 1)  # a request started after the last shrink shrinks it again
    assert window.size == 4.0
    sampler.close()


def test_a_latency_blow_up_shrinks_the_window(tokenizer):
    fake = FakeVLLM(tokenizer)
    window = ConcurrencyWindow(4, low=1, high=256)
    # The first round is fast; from then on every request takes 10x longer.
    sampler = adaptive_sampler(fake, tokenizer, delayed(fake, lambda i: 0.005 if i < 4 else 0.05), window)
    sample_window(sampler, 4)
    assert window.size > 4.0
    grown = window.size
    sample_window(sampler, 8)
    # 8 slow requests through a window of 3 or 4 are 3 rounds at most: one shrink each, not one per request.
    assert grown * 0.8**3 - 1e-9 <= window.size <= grown * 0.8
    sampler.close()


def test_a_server_slower_for_good_is_the_new_best_once_the_window_is_at_its_low_bound(tokenizer):
    fake = FakeVLLM(tokenizer)
    window = ConcurrencyWindow(4, low=2, high=256)
    sampler = adaptive_sampler(fake, tokenizer, delayed(fake, lambda i: 0.01 if i < 8 else 0.05), window)
    sample_window(sampler, 8)
    fast_best = window.best_seconds_per_token
    sample_window(sampler, 40)
    # It went down to 2, took the slower time as the best, and grew again from there.
    assert window.best_seconds_per_token > 2 * fast_best
    assert window.size > 2.0
    sampler.close()


def test_the_window_stays_within_its_bounds(tokenizer):
    fake = FakeVLLM(tokenizer)
    window = ConcurrencyWindow(4, low=2, high=6)
    sampler = adaptive_sampler(fake, tokenizer, delayed(fake, lambda i: 0.02), window)
    sample_window(sampler, 200)
    assert window.size == 6.0
    for _ in range(4):
        fake.failures = [503]
        sample_window(sampler, 1)
    assert window.size == 2.0  # 6, 3, then the bound
    sampler.close()


def test_a_fixed_window_never_moves(tokenizer):
    fake = FakeVLLM(tokenizer)
    window = ConcurrencyWindow(16)
    sampler = adaptive_sampler(fake, tokenizer, delayed(fake, lambda i: 0.02), window)
    fake.failures = [503] * 3
    assert sample_window(sampler, 100) == 16
    assert window.size == 16.0 and not window.adaptive
    sampler.close()


def test_concurrency_auto_reaches_the_client_and_adapts(tokenizer):
    fake = FakeVLLM(tokenizer)
    server = LocalHTTPServer(fake)
    try:
        auto = make_plugin("sampler.openai", base_url=server.url, concurrency="auto").make_sampler(
            config=RunConfig(), trainer=FakeTrainer(tokenizer)
        )
        window = auto.client.window
        assert (window.size, window.low, window.high) == (AUTO_INITIAL_WINDOW, 1, AUTO_MAX_WINDOW)
        assert auto.concurrent_samples == AUTO_MAX_WINDOW
        auto.prompts_per_request = 1
        assert sample_window(auto, 120) == window.limit and window.best_seconds_per_token > 0
        auto.close()

        bounded = make_plugin("sampler.openai", base_url=server.url, concurrency="auto", concurrency_max="10").make_sampler(
            config=RunConfig(), trainer=FakeTrainer(tokenizer)
        )
        assert (bounded.client.window.size, bounded.client.window.high, bounded.concurrent_samples) == (10, 10, 10)
        bounded.close()

        fixed = make_plugin("sampler.openai", base_url=server.url, concurrency="16").make_sampler(
            config=RunConfig(), trainer=FakeTrainer(tokenizer)
        )
        fixed.prompts_per_request = 1
        assert sample_window(fixed, 120) == 16 and not fixed.client.window.adaptive
        fixed.close()
    finally:
        server.close()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"concurrency": "0"}, "concurrency must be an integer >= 1 or auto, got 0"),
        ({"concurrency": "-3"}, "concurrency must be an integer >= 1 or auto, got -3"),
        ({"concurrency": "2.5"}, "concurrency must be an integer >= 1 or auto, got '2.5'"),
        ({"concurrency": "fast"}, "concurrency must be an integer >= 1 or auto, got 'fast'"),
        ({"concurrency": True}, "option 'concurrency' of sampler.openai: expected an integer, got True"),
        ({"concurrency": "auto", "concurrency_max": "0"}, "concurrency_max must be >= 1, got 0"),
        ({"concurrency": "8", "concurrency_max": "64"}, "concurrency_max bounds the adapted window only: it needs concurrency=auto"),
        ({"concurrency_max": "64"}, "concurrency_max bounds the adapted window only"),
    ],
)
def test_bad_concurrency_values_are_refused(options, message):
    with pytest.raises(PluginError, match=message.replace("(", r"\(")):
        make_plugin("sampler.openai", **options)


def test_a_window_outside_its_bounds_is_refused():
    with pytest.raises(ValueError, match=r"window 8 must lie in \[1, 4\]"):
        ConcurrencyWindow(8, low=1, high=4)
    with pytest.raises(ValueError, match=r"window 0 must lie"):
        ConcurrencyWindow(0)


class SaturatingServer:
    """A server that batches up to ``capacity`` requests at no cost, then thrashes: a request that
    arrives with k in flight takes ``seconds_per_token * max_tokens * max(1, (k / capacity)**exponent)``.
    With exponent 2 (an engine that preempts and recomputes when its KV cache is over-full) the
    best throughput is at ``capacity`` requests in flight, and less on either side; with 1 it only
    queues, and any window from ``capacity`` up is as good."""

    def __init__(self, fake, capacity, seconds_per_token, exponent=2):
        self.fake, self.capacity, self.seconds_per_token, self.exponent = fake, capacity, seconds_per_token, exponent
        self.in_flight = 0
        self.lock = threading.Lock()

    def __call__(self, request):
        if request.url.path != "/v1/completions":
            return self.fake(request)
        with self.lock:
            self.in_flight += 1
            load = max(1.0, (self.in_flight / self.capacity) ** self.exponent)
        try:
            time.sleep(self.seconds_per_token * 2 * load)
            return self.fake(request)
        finally:
            with self.lock:
                self.in_flight -= 1


def requests_per_second(tokenizer, url, concurrency, steps, requests_per_step):
    sampler = OpenAISampler(base_url=url, concurrency=concurrency, prompts_per_request=1).make_sampler(
        config=RunConfig(), trainer=FakeTrainer(tokenizer)
    )
    started = time.monotonic()
    for _ in range(steps):
        sampler.sample([[i + 1] for i in range(requests_per_step)], 1, SamplingParams(max_tokens=2))
    elapsed = time.monotonic() - started
    window = sampler.client.window.size
    sampler.close()
    return steps * requests_per_step / elapsed, window


def test_auto_settles_near_the_capacity_of_a_saturating_server(tokenizer):
    # Throughput against fixed windows is measured in benchmarks/openai_concurrency.py, not here.
    fake = FakeVLLM(tokenizer)
    # The server's time is long against a loaded machine's scheduling noise (two test workers on
    # two cores): at 0.025 s per token the window stayed at 14.0-14.5 there.
    server = LocalHTTPServer(SaturatingServer(fake, capacity=8, seconds_per_token=0.05))
    try:
        _, window = requests_per_second(tokenizer, server.url, "auto", steps=2, requests_per_step=80)
    finally:
        server.close()
    # Started at 16, twice the server's best number in flight: shrunk to around 8.
    assert 4 <= window <= 14


@pytest.mark.parametrize("loop, concurrency, window", [("sync", "auto", AUTO_INITIAL_WINDOW), ("async", "5", 5)])
def test_a_run_records_the_window_in_every_step(tiny_model_dir, tiny_dataset, tokenizer, tmp_path, loop, concurrency, window):
    _, metrics = run_through_fake_server(tiny_model_dir, tiny_dataset, tokenizer, tmp_path, loop, concurrency=concurrency)
    # Two requests a step never fill the window: auto's stays where it started.
    assert [m["sampler/concurrency_window"] for m in metrics] == [window, window]
