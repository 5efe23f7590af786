"""Scoring inputs for the tests of the stages (scoring, advantages) without a model.

- ``group(texts, prompt_id)``: one group of three-token samples with these completion texts.
- ``TableReward(table)``: a reward plugin that looks the score up by text (None where absent) and raises on "boom".
- ``selection_of(*rewards)``: a Selection of these weighted rewards and no loss.
"""

from __future__ import annotations

import attrs

from grpo_core import Prompt, Sample, hookimpl
from grpo_core.plugins_manager import build_manager
from grpo_core.selection import Selection


def group(texts, prompt_id="p"):
    prompt = Prompt(id=prompt_id, text="q", answer="1")
    return [
        Sample(
            prompt=prompt,
            tokens=[1, 2, 3],
            sampling_logprobs=[0.0, -1.0, -1.0],
            loss_mask=[0.0, 1.0, 1.0],
            text=t,
            finish_reason="stop",
            policy_version=0,
        )
        for t in texts
    ]


@attrs.define
class TableReward:
    """Looks the score up by text; raises on 'boom'."""

    table: dict

    @hookimpl
    def reward(self, prompt, samples):
        if any(s.text == "boom" for s in samples):
            raise RuntimeError("scorer crashed")
        return [self.table.get(s.text) for s in samples]


def selection_of(*rewards):
    plugins = [r.plugin for r in rewards]
    return Selection(manager=build_manager(plugins), plugins={"reward": plugins}, rewards=list(rewards), loss=None)
