"""The one-pass sampler against draw() (the same tokens and logprobs where the math is the same)
and against the exact distribution of the sampling rules, its thresholds against sorting, and
its refusal to land on a token the rules removed."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_core.engine import sampling
from grpo_core.engine.decoding import draw
from grpo_core.engine.sampling import sample, top_k_threshold, top_p_threshold

SETTINGS = [(1.0, 0, 1.0), (0.7, 20, 1.0), (1.0, 0, 0.9), (0.8, 50, 0.8), (1.3, 3, 0.5), (0.0, 0, 1.0)]
IDS = ["plain", "top-k", "top-p", "top-k-top-p", "narrow", "greedy"]


def exact_probabilities(logits_V: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The rules' distribution in float64 by sorting: what both samplers draw from."""
    z = logits_V.double() / temperature
    order = torch.argsort(z, descending=True)
    z_sorted = z[order]
    if 0 < top_k < z.shape[0]:
        z_sorted[top_k:] = -math.inf
    if top_p < 1.0:
        p = z_sorted.softmax(-1)
        z_sorted[(p.cumsum(-1) - p) >= top_p] = -math.inf
    probabilities = torch.zeros_like(z)
    probabilities[order] = z_sorted.softmax(-1)
    return probabilities


@pytest.mark.parametrize("vocab", [97, 2100], ids=["one-chunk", "three-chunks"])
@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS, ids=IDS)
def test_tokens_and_logprobs_equal_draw(vocab, temperature, top_k, top_p):
    g = torch.Generator().manual_seed(vocab)
    logits_B_V = torch.randn(64, vocab, generator=g) * 3
    u_B_1 = torch.rand(64, 1, generator=g)
    want_tokens, want_logprobs = draw(logits_B_V, temperature, top_k, top_p, u_B_1)
    tokens, logprobs = sample(logits_B_V, temperature, top_k, top_p, u_B_1)
    assert torch.equal(tokens, want_tokens)
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, want_logprobs, atol=2e-6, rtol=0)
    if temperature == 0:
        assert not logprobs.any()


# The bisections pass over [1000, 1100] 64 times: a few seconds each on a loaded CPU.
SLOW_SETTINGS = [pytest.param(*setting, marks=pytest.mark.slow) if setting[1] or setting[2] < 1 else setting for setting in SETTINGS[:5]]


@pytest.mark.parametrize("temperature, top_k, top_p", SLOW_SETTINGS, ids=IDS[:5])
def test_stratified_uniforms_land_on_each_token_as_often_as_its_exact_probability(temperature, top_k, top_p):
    # Uniforms at the midpoints of N equal strata: an inverse CDF maps N·p ± 1 of them to a token of
    # probability p, whatever the randomness, so the distribution is checked exactly.
    N, V = 1000, 1100  # two chunks, the last one short
    g = torch.Generator().manual_seed(3)
    logits_V = torch.randn(V, generator=g) * 2
    logits_V[:40] += 6  # most of the mass in a few tokens of the first chunk
    logits_V[1030:1060] += 5.5  # and some in the second
    want_V = exact_probabilities(logits_V, temperature, top_k, top_p)
    u_N_1 = ((torch.arange(N) + 0.5) / N).unsqueeze(-1)
    tokens, logprobs = sample(logits_V.expand(N, V), temperature, top_k, top_p, u_N_1)
    counts_V = torch.bincount(tokens, minlength=V).double()
    assert (counts_V[want_V == 0] == 0).all()  # never a token the rules removed
    assert ((counts_V - N * want_V).abs() <= 1 + 1e-6).all()
    torch.testing.assert_close(logprobs.double(), want_V[tokens].log(), atol=2e-5, rtol=0)


def test_the_top_k_threshold_is_the_k_th_value_with_ties_and_removed_tokens():
    g = torch.Generator().manual_seed(4)
    z = torch.randn(16, 300, generator=g)
    z[:, ::7] = -math.inf
    z[3, :10] = 5.0  # ten tied at the top
    for k in (1, 5, 10, 11, 42):
        assert torch.equal(top_k_threshold(z, k), torch.topk(z, k).values[:, -1:])
    negative = -torch.rand(4, 50, generator=g) - 1  # all below zero: the float order's flipped half
    assert torch.equal(top_k_threshold(negative, 7), torch.topk(negative, 7).values[:, -1:])


def test_the_top_p_threshold_keeps_the_sorted_nucleus_and_all_ties_of_its_last_token():
    g = torch.Generator().manual_seed(5)
    z = torch.randn(32, 500, generator=g) * 2
    for p in (0.05, 0.5, 0.9, 0.999):
        kept = z >= top_p_threshold(z, p)
        want = torch.stack([exact_probabilities(row, 1.0, 0, p) > 0 for row in z])
        assert torch.equal(kept, want)
    tied = torch.tensor([[3.0, 1.0, 1.0, 1.0, -2.0]])
    # The first tie completes the nucleus: a sort keeps one of them, the threshold all three.
    assert top_p_threshold(tied, 0.75).item() == 1.0
    assert top_p_threshold(tied, 0.5).item() == 3.0


@pytest.mark.parametrize("u", [1e-12, 0.5, 1 - 2**-24])
def test_a_uniform_at_either_end_lands_on_a_token_that_can_be_drawn(u):
    V = 3 * sampling.CHUNK
    z = torch.full((3, V), -math.inf)
    z[0, 1500:1503] = torch.tensor([0.0, 1.0, 2.0])  # only the middle chunk holds any mass
    z[1, -1] = 0.0  # the very last token only
    z[2, 0] = 0.0  # the very first token only
    tokens, logprobs = sample(z, 1.0, 0, 1.0, torch.full((3, 1), u))
    assert torch.isfinite(z[torch.arange(3), tokens]).all()
    assert tokens[1] == V - 1 and tokens[2] == 0
    assert logprobs[1] == 0 and logprobs[2] == 0


def test_half_precision_logits_are_read_as_fp32():
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(16, 1500, generator=g) * 3).bfloat16()
    u = torch.rand(16, 1, generator=g)
    tokens, logprobs = sample(logits, 0.9, 30, 0.95, u)
    want_tokens, want_logprobs = sample(logits.float(), 0.9, 30, 0.95, u)
    assert torch.equal(tokens, want_tokens) and torch.equal(logprobs, want_logprobs)
    assert logprobs.dtype == torch.float32
