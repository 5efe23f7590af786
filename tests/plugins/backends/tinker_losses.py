"""The loss of one forward/backward call as the core's train step makes it, for the Tinker backend's tests.

- ``step_loss(names, plugin_options, pairs, advantages, old)``: the StepLoss of these loss plugins over
  (sample, datum) pairs.
"""

from __future__ import annotations

import torch

from grpo_core import make_plugin
from grpo_core.plugins_manager import build_manager
from grpo_core.stages import StepLoss


def step_loss(names, plugin_options, pairs, advantages, old) -> StepLoss:
    """The loss_fn of one forward/backward call, as the core's train step makes it."""
    plugins = [make_plugin(n, kind="loss", **plugin_options.get("loss", {}).get(n, {})) for n in names]
    mask = [torch.tensor(s.loss_mask[1:]) for s, _ in pairs]
    return StepLoss(
        pm=build_manager(plugins),
        old=old,
        sampling=[torch.tensor(s.sampling_logprobs[1:]) for s, _ in pairs],
        mask=mask,
        advantages=advantages,
        ref=None,
        num_sequences=sum(int(m.sum() > 0) for m in mask),
        num_tokens=float(sum(m.sum() for m in mask)),
        max_tokens=32,
    )
