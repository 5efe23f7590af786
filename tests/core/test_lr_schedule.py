"""The LR schedule at its boundaries: the end of warmup, the end of decay, runs shorter than warmup."""

import math

import pytest

from grpo_core.config import RunConfig
from grpo_core.stages import learning_rate


def schedule(total_steps, steps=None, **options):
    config = RunConfig(learning_rate=1.0, **options)
    return [learning_rate(config, i, total_steps) for i in range(total_steps if steps is None else steps)]


def test_warmup_ramps_linearly_then_holds_the_peak_under_the_constant_schedule():
    assert schedule(6, warmup_steps=4, lr_schedule="constant") == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_decay_starts_at_the_peak_on_the_first_step_after_warmup():
    assert schedule(4, warmup_steps=1, lr_schedule="linear") == pytest.approx([1.0, 1.0, 2 / 3, 1 / 3])


def test_cosine_follows_half_a_cosine_from_the_peak_to_zero():
    values = schedule(4, lr_schedule="cosine")
    expected = [0.5 * (1 + math.cos(math.pi * i / 4)) for i in range(4)]
    assert values == pytest.approx(expected)
    assert values[1] == pytest.approx(0.8535533905932737)


@pytest.mark.parametrize("lr_schedule", ["linear", "cosine"])
def test_decay_stays_at_zero_past_the_last_step(lr_schedule):
    # A step past total_steps (a resumed run given fewer steps) must not climb back or go negative.
    assert schedule(4, steps=8, lr_schedule=lr_schedule)[4:] == [0.0, 0.0, 0.0, 0.0]


def test_a_run_no_longer_than_its_warmup_decays_over_one_step():
    # total_steps <= warmup_steps: the decay length is clamped to 1 step, not 0 (no division by zero).
    assert schedule(3, steps=5, warmup_steps=3, lr_schedule="linear") == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 0.0])
