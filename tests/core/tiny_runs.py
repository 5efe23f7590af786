"""Short runs of the tiny model through ``grpo_core.train.run`` for the tests of the loop and of what it drives.

- ``length_reward``: an autouse fixture that makes reward 'length' (``LengthReward``: longer completions score
  higher, a learning signal for the random model) selectable; import it into a test module to use it there.
- ``config(tiny_model_dir, tiny_dataset, run_dir, **kw)``: the RunConfig of a three-step run scored by 'length'.
- ``metrics_of(run_dir)``, ``weights_of(run_dir)``: what such a run wrote: its metrics lines, its final weights.
"""

from __future__ import annotations

import json

import attrs
import pytest

from grpo_core import hookimpl, selection
from grpo_core.config import RunConfig
from grpo_core.plugins_manager import PluginEntry


@attrs.define
class LengthReward:
    """Longer completions score higher: gives the random test model a learning signal."""

    @hookimpl
    def reward(self, prompt, samples):
        return [len(s.text) / 10 for s in samples]


@pytest.fixture(autouse=True)
def length_reward(monkeypatch):
    original = selection.find
    entry = PluginEntry(kind="reward", name="length", target=f"{__name__}:LengthReward", distribution="tests", version="0")
    monkeypatch.setattr(selection, "find", lambda name, kind=None: entry if (kind, name) == ("reward", "length") else original(name, kind))


def config(tiny_model_dir, tiny_dataset, run_dir, **kw):
    base = dict(
        model=str(tiny_model_dir),
        dataset=str(tiny_dataset),
        prompt_template="Question: {prompt}\nAnswer:",
        max_steps=3,
        prompt_groups_per_step=2,
        completions_per_prompt=4,
        max_completion_tokens=6,
        learning_rate=1e-2,
        reward=["length"],
        logger=["jsonl"],
        run_dir=str(run_dir),
        drop_zero_variance_groups=False,
    )
    base.update(kw)
    return RunConfig(**base)


def metrics_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights_of(run_dir):
    from safetensors.torch import load_file

    return load_file(run_dir / "final" / "model.safetensors")
