"""Samples for the train-step tests whose losses have something to act on.

- ``samples_for(tokenizer)``: sequences of the tiny model of different lengths, one of them all masked.
- ``off_policy_samples(tokenizer, seed)``: the same with sampler logprobs around the model's (ratios on both
  sides of 1) and advantages of both signs.
- ``LOSS_CONFIGS``: every built-in loss with options that make its clipping or penalty act.
"""

from __future__ import annotations

import torch

from grpo_core import Prompt, Sample


def samples_for(tokenizer):
    gen = torch.Generator().manual_seed(0)
    prompt = Prompt(id="p", text="x")
    samples = []
    for i in range(7):
        n_prompt, n_completion = 2 + i % 3, 1 + (5 * i) % 7
        tokens = torch.randint(3, len(tokenizer), (n_prompt + n_completion,), generator=gen).tolist()
        mask = [0.0] * n_prompt + [1.0] * n_completion
        if i == 3:
            mask = [0.0] * len(tokens)  # an all-masked sequence counts in no normalizer
        adv = float(torch.randn(1, generator=gen))
        samples.append(
            Sample(
                prompt=prompt, tokens=tokens, sampling_logprobs=[-1.0] * len(tokens), loss_mask=mask,
                text="", finish_reason="stop", policy_version=0, advantages=[adv] * len(tokens),
            )
        )  # fmt: skip
    return samples


def off_policy_samples(tokenizer, seed=0):
    """samples_for's sequences with sampler logprobs spread around the model's (ratios and TIS
    weights on both sides of 1) and advantages of both signs."""
    gen = torch.Generator().manual_seed(seed)
    samples = samples_for(tokenizer)
    for i, s in enumerate(samples):
        s.sampling_logprobs = (-5.7 + 0.6 * torch.randn(len(s.tokens), generator=gen)).tolist()
        s.advantages = [(-1.0) ** i * (0.5 + 0.1 * i)] * len(s.tokens)
    return samples


LOSS_CONFIGS = {
    "grpo": {"kl_beta": 0.05},
    "dapo": {"dual_clip": 2.0},
    "gspo": {"eps_low": 0.2, "eps_high": 0.2},
    "cispo": {},
    "importance_sampling": {"clip_rho": 2.0},
    "dro": {},
    "reinforce": {"kl_beta": 0.05},
}
