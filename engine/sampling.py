"""The compiled decode step's sampler: one token per row and its logprob without sorting the
vocabulary, in fixed-shape work a CUDA graph can hold (no host read, no data-dependent shape).

It draws from the same distribution as :func:`grpo_core.engine.decoding.draw` (temperature, then
top-k, then top-p over what top-k kept, then the inverse CDF at the row's pre-drawn uniform) and
reports the same logprob, ``z_token - logsumexp(z_kept)``:

- top-k and top-p are thresholds found by bisection over the logits' float order (an int32 key
  per float, 32 halvings reach the exact value): top-k keeps ``z >= the k-th largest`` (ties at
  the k-th stay, as ``draw``'s ``topk`` threshold keeps them); top-p keeps a token while the
  mass of the tokens strictly above it is under ``top_p`` (``draw``'s sorted cumsum, except
  that tokens tied with the last one kept all stay, where the sort keeps some of them);
- the inverse CDF is two-level: the probabilities' sums over chunks of :data:`CHUNK` tokens, a
  scan of those few sums, then a scan of the one chunk the uniform falls in. ``draw`` scans the
  whole row; the running sums are the same up to float rounding, so the tokens are the same but
  where a uniform falls within rounding of a boundary between two tokens.

tests/engine/test_sampling.py checks both against ``draw`` and against the exact distribution.
"""

from __future__ import annotations

import torch

CHUNK = 1024
"""Tokens per chunk of the two-level inverse CDF (151,936 tokens: 149 chunk sums, then one chunk)."""
BISECTION_STEPS = 32
"""Halvings of an int32 key range: from the whole range to two adjacent floats."""


def _keys(x_fp32: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as the floats are (IEEE bits, the negatives' magnitude bits flipped)."""
    bits = x_fp32.view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()


def _floats(keys: torch.Tensor) -> torch.Tensor:
    """The floats of :func:`_keys` (the flip is its own inverse)."""
    bits = keys.int()
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).view(torch.float32)


def _bisect(z_B_V: torch.Tensor, low_B_1: torch.Tensor, high_B_1: torch.Tensor, holds) -> torch.Tensor:
    """The smallest float (as a key) at which ``holds(z_B_V, t_B_1)`` turns false, given it holds
    at ``low`` and not at ``high`` and turns false once (fixed steps: no host read)."""
    for _ in range(BISECTION_STEPS):
        mid_B_1 = (low_B_1 + high_B_1) // 2
        yes_B_1 = holds(z_B_V, _floats(mid_B_1))
        low_B_1 = torch.where(yes_B_1, mid_B_1, low_B_1)
        high_B_1 = torch.where(yes_B_1, high_B_1, mid_B_1)
    return high_B_1


def top_k_threshold(z_B_V: torch.Tensor, k: int) -> torch.Tensor:
    """[B, 1] the k-th largest value of each row (by bisection: at least k values are >= it)."""

    def at_least_k_above(z: torch.Tensor, t_B_1: torch.Tensor) -> torch.Tensor:
        return (z >= t_B_1).sum(-1, keepdim=True) >= k

    low = _keys(z_B_V.amin(-1, keepdim=True))
    high = _keys(z_B_V.amax(-1, keepdim=True)) + 1
    # The last key that still has k values above is the k-th value itself.
    return _floats(_bisect(z_B_V, low, high, at_least_k_above) - 1)


def top_p_threshold(z_B_V: torch.Tensor, top_p: float) -> torch.Tensor:
    """[B, 1] the smallest kept value: a token stays while the probability of the tokens strictly
    above it is under ``top_p`` (the largest always stays)."""
    max_B_1 = z_B_V.amax(-1, keepdim=True)
    e_B_V = (z_B_V - max_B_1).exp()
    total_B_1 = e_B_V.sum(-1, keepdim=True)

    def mass_above_reaches_p(z: torch.Tensor, t_B_1: torch.Tensor) -> torch.Tensor:
        return torch.where(z > t_B_1, e_B_V, 0.0).sum(-1, keepdim=True) >= top_p * total_B_1

    # Below every value the mass above is all of it (>= top_p); at the largest it is none.
    low = _keys(z_B_V.amin(-1, keepdim=True)) - 1
    return _floats(_bisect(z_B_V, low, _keys(max_B_1), mass_above_reaches_p))


def _inverse_cdf(p_B_V: torch.Tensor, u_B_1: torch.Tensor) -> torch.Tensor:
    """The first token whose running probability reaches ``u`` × the row's total, two-level."""
    B, V = p_B_V.shape
    chunks = -(-V // CHUNK)
    p_B_N_W = torch.nn.functional.pad(p_B_V, (0, chunks * CHUNK - V)).view(B, chunks, CHUNK)
    sums_B_N = p_B_N_W.sum(-1)
    cdf_B_N = sums_B_N.cumsum(-1)
    target_B_1 = u_B_1.clamp(min=1e-12) * cdf_B_N[:, -1:]
    chunk_B_1 = torch.searchsorted(cdf_B_N, target_B_1).clamp_(max=chunks - 1)
    before_B_1 = cdf_B_N.gather(-1, chunk_B_1) - sums_B_N.gather(-1, chunk_B_1)
    local_B_W = p_B_N_W.gather(1, chunk_B_1.unsqueeze(-1).expand(B, 1, CHUNK)).squeeze(1)
    local_cdf_B_W = local_B_W.cumsum(-1)
    # Rounding may put the target a hair outside its chunk's sums: it is held to a token of the
    # chunk that has probability (the first where the sum is positive, the last where it is full).
    local_target_B_1 = torch.minimum((target_B_1 - before_B_1).clamp(min=torch.finfo(torch.float32).tiny), local_cdf_B_W[:, -1:])
    offset_B_1 = torch.searchsorted(local_cdf_B_W, local_target_B_1).clamp_(max=CHUNK - 1)
    return (chunk_B_1 * CHUNK + offset_B_1).squeeze(-1)


def sample(
    logits_B_V: torch.Tensor, temperature: float, top_k: int, top_p: float, u_B_1: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row (long) and its fp32 logprob under the distribution sampled from, as
    :func:`grpo_core.engine.decoding.draw` gives them; ``logits_B_V`` in any float dtype (read as
    fp32)."""
    if temperature == 0:
        token_B = logits_B_V.argmax(-1)
        return token_B, torch.zeros(token_B.shape, dtype=torch.float32, device=token_B.device)
    z_B_V = logits_B_V.float() / temperature
    if 0 < top_k < z_B_V.shape[-1]:
        z_B_V = z_B_V.masked_fill(z_B_V < top_k_threshold(z_B_V, top_k), -torch.inf)
    if top_p < 1.0:
        z_B_V = z_B_V.masked_fill(z_B_V < top_p_threshold(z_B_V, top_p), -torch.inf)
    max_B_1 = z_B_V.amax(-1, keepdim=True)
    e_B_V = (z_B_V - max_B_1).exp()
    lse_B_1 = max_B_1 + e_B_V.sum(-1, keepdim=True).log()
    token_B = _inverse_cdf(e_B_V, u_B_1)
    return token_B, (z_B_V.gather(-1, token_B.unsqueeze(-1)) - lse_B_1).squeeze(-1)
