"""The ``tinker`` sampler: sample from a Tinker service's sampling client of the trained weights."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs

from grpo_core import Completion, SamplingParams, hookimpl
from grpo_core.config import RunConfig
from grpo_core.errors import PluginError
from grpo_core.hookspecs import declared
from grpo_core.remote import tinker_sdk as sdk

FINISH_REASONS = {"stop": "stop", "length": "length"}


@attrs.define
class TinkerSamplerPlugin:
    """Sample on the Tinker service that trains the policy (use with --backend tinker).

    Each weight sync saves the trainer's weights for sampling on the service and opens a
    sampling client of them; every prompt's completions are requested at once (one request per
    prompt, n samples each), with the logprob of every sampled token. Each request carries a
    seed drawn from the run's seeded (and checkpointed) Python generator, so a run's samples,
    also after --resume, repeat where the service honours seeds.
    """

    @hookimpl
    def make_sampler(self, config: RunConfig, trainer: Any) -> TinkerSampler:
        if declared(trainer, "trainer object", "sampling_client") is None:
            raise PluginError(
                f"the tinker sampler samples the tinker trainer's weights, not a {type(trainer).__name__}'s; choose another --sampler"
            )
        return TinkerSampler(tokenizer=trainer.tokenizer, max_context=_max_context(trainer.tokenizer))


def _max_context(tokenizer: Any) -> int | None:
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and limit < 10**9 else None


@attrs.define(eq=False)
class TinkerSampler:
    """The :class:`grpo_core.backend.Sampler` of a Tinker sampling client."""

    tokenizer: Any
    max_context: int | None = None
    version: int = -1
    """-1 until the first weight sync opens a sampling client."""
    sampling_client: Any = None
    """The service's sampling client of the weights it samples (not a ServerClient, so named apart
    from the declared ``client`` of a server sampler)."""
    vocab_size: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.vocab_size = len(self.tokenizer)

    stateless: ClassVar[bool] = True
    """No state_dict: the weights live on the service, so the run syncs them at start and on resume."""

    def load_weights_from(self, trainer: Any) -> None:
        self.sampling_client = declared(trainer, "trainer object", "sampling_client")()
        self.version = trainer.version

    def sample(self, prompts: Sequence[list[int]], num_samples: int, params: SamplingParams) -> list[list[Completion]]:
        if self.sampling_client is None:
            raise PluginError("the tinker sampler has no weights yet: a weight sync opens its sampling client")
        futures = []
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            request = sdk.sampling_params(
                params.max_tokens,
                params.temperature,
                params.top_p,
                params.top_k,
                params.stop,
                params.stop_token_ids,
                random.randrange(2**31),
            )
            futures.append(
                self.sampling_client.sample(
                    prompt=sdk.tinker.ModelInput.from_ints(list(prompt)), num_samples=num_samples, sampling_params=request
                )
            )
        return [self._completions(sdk.resolved(f), num_samples, params.temperature == 0) for f in futures]

    def _completions(self, response: Any, n: int, greedy: bool) -> list[Completion]:
        sequences = list(response.sequences)
        if len(sequences) != n:
            raise PluginError(f"the Tinker service returned {len(sequences)} samples where {n} were asked for")
        completions = []
        for seq in sequences:
            tokens = list(seq.tokens)
            logprobs = seq.logprobs
            if logprobs is None or len(logprobs) != len(tokens) or any(lp is None or not math.isfinite(lp) for lp in logprobs):
                raise PluginError(f"the Tinker service returned no usable logprob for every sampled token ({len(tokens)} tokens)")
            outside = [t for t in tokens if not 0 <= t < self.vocab_size]
            if outside:
                raise PluginError(
                    f"the Tinker service sampled token ids outside the tokenizer's vocabulary of {self.vocab_size}: {outside[:5]}"
                )
            finish = FINISH_REASONS.get(str(seq.stop_reason))
            if finish is None:
                raise PluginError(f"the Tinker service ended a sample with stop reason {seq.stop_reason!r}")
            completions.append(
                Completion(tokens=tokens, logprobs=[0.0] * len(tokens) if greedy else [float(x) for x in logprobs], finish_reason=finish)
            )
        return completions
