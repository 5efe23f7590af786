"""engine/models.py: the gradient checkpointing a run gets when it does not say."""

from __future__ import annotations

import pytest

from grpo_core.engine.models import resolve_checkpointing


def test_auto_checkpointing_is_on_with_cuda_and_off_on_a_cpu_and_says_why():
    on, why = resolve_checkpointing(None, "cuda")
    assert on is True
    assert why.startswith("on (default on cuda: activations are most of a step's GPU memory")
    assert why.endswith("--no-gradient-checkpointing turns it off)")
    off, why = resolve_checkpointing(None, "cpu")
    assert off is False
    assert why.startswith("off (default on cpu: a CPU run is small") and why.endswith("--gradient-checkpointing turns it on)")


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_given_setting_wins_on_every_device(device):
    assert resolve_checkpointing(True, device) == (True, "on (--gradient-checkpointing)")
    assert resolve_checkpointing(False, device) == (False, "off (--no-gradient-checkpointing)")


def test_auto_is_off_for_a_model_transformers_does_not_checkpoint_and_a_given_on_is_left_to_refuse():
    assert resolve_checkpointing(None, "cuda", supported=False) == (
        False,
        "off (default on cuda, but transformers does not checkpoint this model type)",
    )
    # Asked for, it stays on: enable_activation_checkpointing refuses it with the model type.
    assert resolve_checkpointing(True, "cuda", supported=False)[0] is True
