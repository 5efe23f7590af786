"""The local sampler's rules against a reference: temperature, top-k, top-p (nucleus) and greedy.

Every sampled token must lie in the set the rules allow, and its reported logprob must be its
log-probability under the distribution actually sampled from (the allowed tokens, renormalized).
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_core import SamplingParams
from grpo_core.config import RunConfig
from grpo_core.plugins.backends.local import LocalBackend
from grpo_core.plugins.samplers.local import LocalSamplerPlugin

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    config = RunConfig(model=str(tiny_model_dir), seed=11)
    trainer = LocalBackend().make_trainer(config=config)
    return config, trainer


def sample(model, num_samples, **params):
    config, trainer = model
    sampler = LocalSamplerPlugin().make_sampler(config=config, trainer=trainer)
    return sampler.sample([PROMPT], num_samples, SamplingParams(max_tokens=4, **params))[0]


def next_token_logits(model, completion_tokens):
    _, trainer = model
    tokens = PROMPT + completion_tokens
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor([tokens])).logits[0].double()
    return logits[len(PROMPT) - 1 : len(tokens) - 1]


def allowed_logprobs(logits_V, temperature, top_k, top_p):
    """log p over the tokens the rules keep (-inf elsewhere), written from the rules' definitions."""
    z_V = logits_V / temperature
    if 0 < top_k < z_V.numel():
        z_V = torch.where(z_V >= torch.topk(z_V, top_k).values[-1], z_V, -math.inf)
    if top_p < 1.0:
        probs_V = torch.softmax(z_V, -1)
        order = torch.argsort(probs_V, descending=True)
        mass_before = torch.cumsum(probs_V[order], 0) - probs_V[order]
        dropped = order[mass_before >= top_p]
        z_V = z_V.clone()
        z_V[dropped] = -math.inf
    return torch.log_softmax(z_V, -1)


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.7, 0, 0.5), (1.3, 2, 0.9), (0.5, 3, 1.0), (1.0, 4, 0.3)],
)
def test_sampled_tokens_and_logprobs_follow_the_rules(model, temperature, top_k, top_p):
    completions = sample(model, 6, temperature=temperature, top_k=top_k, top_p=top_p)
    checked = 0
    for c in completions:
        logits_T_V = next_token_logits(model, c.tokens)
        for t, (token, logprob) in enumerate(zip(c.tokens, c.logprobs)):
            want_V = allowed_logprobs(logits_T_V[t], temperature, top_k, top_p)
            assert want_V[token] > -math.inf, f"token {token} at {t} is outside the allowed set"
            assert logprob == pytest.approx(float(want_V[token]), abs=2e-4)
            checked += 1
    assert checked >= 6


def test_top_p_keeps_fewer_tokens_than_the_full_distribution(model):
    # The nucleus is a real restriction here: some allowed set is smaller than the vocabulary,
    # and a token's logprob under it is higher than under the full softmax.
    completions = sample(model, 6, top_p=0.3)
    logits_T_V = next_token_logits(model, completions[0].tokens)
    kept = (allowed_logprobs(logits_T_V[0], 1.0, 0, 0.3) > -math.inf).sum().item()
    assert 1 <= kept < logits_T_V.shape[-1]
    full = torch.log_softmax(logits_T_V[0], -1)[completions[0].tokens[0]].item()
    assert completions[0].logprobs[0] > full


def test_top_k_of_one_is_greedy_with_logprob_zero(model):
    completions = sample(model, 3, top_k=1)
    for c in completions:
        logits_T_V = next_token_logits(model, c.tokens)
        assert c.tokens == logits_T_V.argmax(-1).tolist()
        assert c.logprobs == pytest.approx([0.0] * len(c.tokens), abs=1e-6)


def test_temperature_zero_is_greedy_with_logprob_zero(model):
    completions = sample(model, 3, temperature=0.0)
    assert len({tuple(c.tokens) for c in completions}) == 1
    for c in completions:
        logits_T_V = next_token_logits(model, c.tokens)
        assert c.tokens == logits_T_V.argmax(-1).tolist()
        assert c.logprobs == [0.0] * len(c.tokens)
