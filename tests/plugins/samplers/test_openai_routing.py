"""The openai sampler's mixture-of-experts routing: vLLM's routed_experts, taken with --sampler-opt routed_experts=true."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch

from grpo_core import SamplingParams
from grpo_core.plugins.samplers.openai import ServerSampler
from grpo_core.remote.server_client import ServerClient, ServerResponseError
from tests.plugins.samplers.fake_server import FakeVLLM


def npy_base64(array):
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def routes_for(prompt_length, choice):
    """What vLLM returns for a choice: a row per forwarded token, 3 layers, top-2, uint8 as vLLM sends up to 256 experts."""
    rows = prompt_length + len(choice["token_ids"]) - 1
    return (np.arange(rows * 3 * 2).reshape(rows, 3, 2) + choice["index"]) % 60


def make_sampler(fake, tokenizer, returns_routing):
    client = ServerClient("http://fake/v1", transport=httpx.MockTransport(fake), backoff=(0.01, 0.05), retry_deadline=1.0)
    return ServerSampler(client=client, tokenizer=tokenizer, model="tiny", returns_routing=returns_routing)


PROMPTS = [[5, 6, 7], [9, 10]]


def serving(fake, edit):
    prompt_lengths = {}

    def choice_edit(choice):
        edit(choice, prompt_lengths)

    fake.choice_edit = choice_edit
    original = fake.complete

    def complete(body):
        for i, prompt in enumerate(body["prompt"]):
            for j in range(body.get("n", 1)):
                prompt_lengths[i * body.get("n", 1) + j] = len(prompt)
        return original(body)

    fake.complete = complete


def test_each_completion_carries_the_servers_routes_compactly(tokenizer):
    fake = FakeVLLM(tokenizer)
    serving(fake, lambda c, lengths: c.update(routed_experts=npy_base64(routes_for(lengths[c["index"]], c).astype(np.uint8))))
    sampler = make_sampler(fake, tokenizer, returns_routing=True)
    assert sampler.routing_problem is None
    groups = sampler.sample(PROMPTS, 2, SamplingParams(max_tokens=4))
    for prompt, group in zip(PROMPTS, groups):
        for j, c in enumerate(group):
            assert c.routed_experts.dtype == torch.uint8 and c.routed_experts.shape == (len(prompt) + 3, 3, 2)
            index = j if prompt is PROMPTS[0] else 2 + j
            expected = routes_for(len(prompt), {"token_ids": c.tokens, "index": index})
            assert torch.equal(c.routed_experts.long(), torch.from_numpy(expected).long())


def test_without_the_option_no_routes_are_taken_and_r3_is_refused_naming_the_option(tokenizer):
    fake = FakeVLLM(tokenizer)
    serving(fake, lambda c, lengths: c.update(routed_experts=npy_base64(routes_for(lengths[c["index"]], c))))
    sampler = make_sampler(fake, tokenizer, returns_routing=False)
    assert "--sampler-opt routed_experts=true" in sampler.routing_problem
    assert "--enable-return-routed-experts" in sampler.routing_problem
    groups = sampler.sample(PROMPTS, 1, SamplingParams(max_tokens=2))
    assert all(c.routed_experts is None for g in groups for c in g)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c, lengths: None, "without routed_experts: start vLLM with --enable-return-routed-experts"),
        (lambda c, lengths: c.update(routed_experts="not npy"), "is not a base64 .npy array"),
        (
            lambda c, lengths: c.update(routed_experts=npy_base64(routes_for(lengths[c["index"]] + 1, c))),
            r"routed_experts is int64\[\d+, 3, 2\]; expected expert indices for the \d+ forwarded tokens",
        ),
        (
            lambda c, lengths: c.update(routed_experts=npy_base64(-routes_for(lengths[c["index"]], c) - 1)),
            "expected expert indices",
        ),
    ],
    ids=["missing", "not_npy", "wrong_rows", "negative"],
)
def test_routes_the_run_cannot_use_are_an_error(tokenizer, edit, message):
    fake = FakeVLLM(tokenizer)
    serving(fake, edit)
    sampler = make_sampler(fake, tokenizer, returns_routing=True)
    with pytest.raises(ServerResponseError, match=message):
        sampler.sample(PROMPTS, 1, SamplingParams(max_tokens=2))


@pytest.mark.parametrize("option", [True, False])
def test_the_plugin_option_reaches_the_sampler(tokenizer, option):
    from grpo_core.config import RunConfig
    from grpo_core.plugins.samplers.openai import OpenAISampler
    from tests.plugins.samplers.fake_server import FakeTrainer, LocalHTTPServer

    fake = FakeVLLM(tokenizer)
    serving(fake, lambda c, lengths: c.update(routed_experts=npy_base64(routes_for(lengths[c["index"]], c))))
    server = LocalHTTPServer(fake)
    try:
        sampler = OpenAISampler(base_url=server.url, routed_experts=option).make_sampler(config=RunConfig(), trainer=FakeTrainer(tokenizer))
        try:
            (group,) = sampler.sample([[7, 8]], 1, SamplingParams(max_tokens=2))
            assert (sampler.routing_problem is None) is option
            assert (group[0].routed_experts is not None) is option
        finally:
            sampler.close()
    finally:
        server.close()
