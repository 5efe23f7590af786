"""Samples of a mixture-of-experts model with the expert routes its sampler recorded.

- ``sampled(trainer, sampler, G)``: samples of two prompts of different lengths with ragged completions.
- ``with_routes(samples, routes)``: their datums carrying ``routes`` as ``routed_experts`` to replay.
- ``loss_fn(datums, logprobs)``: a custom loss (the sum of the logprobs) for forward_backward_custom.
"""

from __future__ import annotations

import tinker

from grpo_core import SamplingParams
from grpo_core.backend import routes_data, sample_to_datum
from tests.plugins.backends.local_parts import prompts_of, to_samples


def sampled(trainer, sampler, G=3):
    """Samples of two prompts of different lengths (left padding) whose completions end at different lengths."""
    prompts = prompts_of(trainer.tokenizer)
    params = SamplingParams(max_tokens=10, stop_token_ids=list(range(0, len(trainer.tokenizer), 7)))
    samples = to_samples(prompts, sampler.sample(prompts, G, params))
    assert len({len(s.tokens) for s in samples}) > 2, "the test needs ragged lengths"
    return samples


def with_routes(samples, routes):
    return [
        tinker.Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, "routed_experts": routes_data(r)})
        for d, r in zip((sample_to_datum(s) for s in samples), routes)
    ]


def loss_fn(datums, logprobs):
    return sum(lp.sum() for lp in logprobs), {}
