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


def test_a_saved_state_of_another_dtype_than_the_models_parameters_is_named_in_config_json(tiny_model_dir, tmp_path):
    import json

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from grpo_core.engine.models import save_state_as_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)  # float32 master weights
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: stored once
    save_state_as_model(model, state, str(tmp_path / "final"))
    assert json.loads((tmp_path / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(tmp_path / "final" / "model.safetensors").values()} == {torch.bfloat16}
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype="auto").dtype == torch.bfloat16
    # In the parameters' own dtype, config.json says so as before.
    save_state_as_model(model, {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, str(tmp_path / "fp32"))
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"
