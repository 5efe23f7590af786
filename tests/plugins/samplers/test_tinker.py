"""The tinker sampler against a fake sampling client (the real one: tests/integration/test_tinker.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from grpo_core import SamplingParams, make_plugin
from grpo_core.config import RunConfig
from grpo_core.errors import PluginError
from grpo_core.plugins.samplers.tinker import TinkerSampler


class FakeSamplingClient:
    def __init__(self, sequences):
        self.sequences = sequences
        self.requests = []

    def sample(self, prompt, num_samples, sampling_params):
        self.requests.append((prompt.to_ints(), num_samples, sampling_params))
        return SimpleNamespace(result=lambda: SimpleNamespace(sequences=self.sequences[:num_samples]))


class FakeTrainer:
    def __init__(self, client, tokenizer):
        self.client, self.tokenizer, self.version, self.opened = client, tokenizer, 0, 0

    def sampling_client(self):
        self.opened += 1
        return self.client


class Tokenizer:
    model_max_length = 256

    def __len__(self):
        return 100


def seq(tokens, logprobs, stop="stop"):
    return SimpleNamespace(tokens=tokens, logprobs=logprobs, stop_reason=stop)


def synced(sequences):
    client = FakeSamplingClient(sequences)
    trainer = FakeTrainer(client, Tokenizer())
    sampler = make_plugin("tinker", kind="sampler").make_sampler(config=RunConfig(), trainer=trainer)
    sampler.load_weights_from(trainer)
    return sampler, client, trainer


def test_samples_every_prompt_with_logprobs_and_a_seed_from_the_run_generator():
    sampler, client, trainer = synced([seq([5, 6], [-0.5, -1.0]), seq([7], [-0.25], "length")])
    assert isinstance(sampler, TinkerSampler) and sampler.max_context == 256 and trainer.opened == 1
    random.seed(4)
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=5, stop=["\n"])
    groups = sampler.sample([[1, 2], [3]], 2, params)
    assert [[(c.tokens, c.logprobs, c.finish_reason) for c in g] for g in groups] == [
        [([5, 6], [-0.5, -1.0], "stop"), ([7], [-0.25], "length")]
    ] * 2
    (p1, n1, s1), (p2, _, s2) = client.requests
    assert (p1, p2, n1) == ([1, 2], [3], 2)
    assert (s1.max_tokens, s1.temperature, s1.top_p, s1.top_k, list(s1.stop)) == (8, 0.8, 0.9, 5, ["\n"])
    random.seed(4)
    assert (s1.seed, s2.seed) == (random.randrange(2**31), random.randrange(2**31))
    assert s1.seed != s2.seed


def test_greedy_sampling_reports_zero_logprobs():
    sampler, _, _ = synced([seq([5], [-0.7])])
    assert sampler.sample([[1]], 1, SamplingParams(temperature=0.0))[0][0].logprobs == [0.0]


@pytest.mark.parametrize(
    "sequences, n, message",
    [
        ([seq([5], None)], 1, "no usable logprob"),
        ([seq([5, 6], [-0.1])], 1, "no usable logprob"),
        ([seq([5], [float("nan")])], 1, "no usable logprob"),
        ([seq([500], [-0.1])], 1, "outside the tokenizer's vocabulary of 100"),
        ([seq([5], [-0.1], "abort")], 1, "stop reason 'abort'"),
        ([seq([5], [-0.1])], 2, "returned 1 samples where 2 were asked for"),
    ],
)
def test_what_training_cannot_use_stops_with_what_was_wrong(sequences, n, message):
    sampler, _, _ = synced(sequences)
    with pytest.raises(PluginError, match=message):
        sampler.sample([[1]], n, SamplingParams())


def test_needs_a_sync_and_the_tinker_trainer():
    sampler = TinkerSampler(tokenizer=Tokenizer())
    with pytest.raises(PluginError, match="no weights yet"):
        sampler.sample([[1]], 1, SamplingParams())
    with pytest.raises(PluginError, match="samples the tinker trainer's weights"):
        make_plugin("tinker", kind="sampler").make_sampler(config=RunConfig(), trainer=SimpleNamespace(tokenizer=Tokenizer()))
    synced_sampler, _, _ = synced([seq([5], [-0.1])])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        synced_sampler.sample([[]], 1, SamplingParams())
