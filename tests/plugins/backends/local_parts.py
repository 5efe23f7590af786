"""The local backend and sampler built on a model folder, and samples from what they sample.

- ``make(tiny_model_dir, fast_forward, padding_free, **config)``: (config, backend, trainer, sampler).
- ``prompts_of(tokenizer)``: two prompts of different lengths (left padding when batched).
- ``to_samples(prompts, groups)``: Samples of the sampler's completions of these prompts, completions trained.
"""

from __future__ import annotations

from grpo_core import Sample
from grpo_core.config import RunConfig
from grpo_core.plugins.backends.local import LocalBackend
from grpo_core.plugins.samplers.local import LocalSamplerPlugin


def make(tiny_model_dir, fast_forward=True, padding_free=True, **config):
    cfg = RunConfig(model=str(tiny_model_dir), **config)
    backend = LocalBackend(fast_forward=fast_forward, padding_free=padding_free)
    trainer = backend.make_trainer(config=cfg)
    sampler = LocalSamplerPlugin().make_sampler(config=cfg, trainer=trainer)
    return cfg, backend, trainer, sampler


def prompts_of(tokenizer):
    return [tokenizer("Question: what is 3 plus 4?\nAnswer:")["input_ids"], tokenizer("what is 1?")["input_ids"]]


def to_samples(prompts, groups):
    return [
        Sample(
            prompt=None,
            tokens=p + c.tokens,
            sampling_logprobs=[0.0] * len(p) + c.logprobs,
            loss_mask=[0.0] * len(p) + [1.0] * len(c.tokens),
            text="",
            finish_reason=c.finish_reason,
            policy_version=0,
            routed_experts=c.routed_experts,
        )
        for p, g in zip(prompts, groups)
        for c in g
    ]
