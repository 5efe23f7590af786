"""The fsdp backend in bfloat16 (gloo, 2 ranks, this process as rank 0): a step equals the local
trainer's bfloat16 step within bf16 rounding (plugins/backends/fsdp.py)."""

from __future__ import annotations

import pytest
import torch

from grpo_core import make_plugin
from grpo_core.config import RunConfig
from grpo_core.plugins.backends.fsdp import FSDPBackend
from grpo_core.plugins.backends.local import LocalBackend
from grpo_core.plugins_manager import build_manager
from grpo_core.stages import train_on_groups
from tests.core.off_policy import off_policy_samples

LEARNING_RATE = 1e-3
BF16_UNIT = torch.finfo(torch.bfloat16).eps
"""2**-7: bf16 weights lie this far apart relative to their size (at most; half that above a power of 2)."""


def assert_bf16_weights_close(ours, theirs, initial, learning_rate, steps):
    """fsdp's bf16 weights (float32 ones rounded to nearest) against the local trainer's (bf16 ones
    rounded stochastically) after ``steps`` AdamW steps from ``initial``.

    Each may be one bf16 unit of the weight off the exact value: 2 units apart. Beyond that only
    where the two gradients' signs differed (bf16 compute noise about a gradient near 0; the
    local trainer's gradients are bf16, fsdp's are reduced in float32): AdamW's first steps move a
    weight by about the learning rate whatever its gradient's size, so such a weight may be up to
    2·lr per step apart. Those must be rare: a wrong gradient (say, of another loss or scale)
    flips the signs of many."""
    assert set(ours) == set(theirs)
    total = beyond = moved = 0
    for name, want in theirs.items():
        got, want, start = ours[name].float(), want.float(), initial[name].float()
        rounding = 2 * BF16_UNIT * torch.maximum(start.abs(), want.abs()) + 1e-12
        gap = (got - want).abs()
        assert bool((gap <= rounding + 2 * learning_rate * steps).all()), (name, float(gap.max()))
        total += gap.numel()
        beyond += int((gap > rounding).sum())
        moved += int(((want - start).abs() > rounding).sum())
    assert moved > total / 2, (moved, total)  # the steps moved most weights by more than rounding
    assert beyond <= 0.02 * total, (beyond, total)  # 0.4 % seen for one step of the tiny model


@pytest.fixture(scope="module")
def both(tiny_model_dir):
    config = RunConfig(model=str(tiny_model_dir), max_completion_tokens=8, grad_clip_norm=1.0, dtype="bfloat16")
    backend = FSDPBackend(nproc=2)
    trainer = backend.make_trainer(config=config)
    reference = backend.make_reference(config=config, trainer=trainer)
    # fsdp pads its rows: the local trainer as it runs with padding_free=false.
    local = LocalBackend(padding_free=False)
    local_trainer = local.make_trainer(config=config)
    yield config, (trainer, reference), (local_trainer, local.make_reference(config=config, trainer=local_trainer))
    workers = list(trainer.group.workers)
    trainer.close()
    assert all(w.poll() is not None for w in workers)


@pytest.mark.slow
def test_one_bf16_step_with_the_kl_reference_equals_the_local_bf16_step(both):
    config, (trainer, reference), (local, local_reference) = both
    initial = {k: v.clone() for k, v in local.model.state_dict().items()}

    def step(trainer, reference):
        plugins = build_manager([make_plugin("loss.grpo", kl_beta=0.05)])
        return train_on_groups(plugins, trainer, reference, [off_policy_samples(trainer.tokenizer)], config, LEARNING_RATE)

    ours, theirs = step(trainer, reference), step(local, local_reference)
    assert set(ours) == set(theirs)
    # The same bf16 weights score the same sequences: loss, KL, entropy agree to bf16 rounding of
    # the logprobs (float32 log-softmax of bf16 logits); the gradient norm to bf16 gradient rounding.
    assert ours["optim/grad_norm"] == pytest.approx(theirs["optim/grad_norm"], rel=4 * BF16_UNIT)
    differ = {k: (ours[k], theirs[k]) for k in ours if k != "optim/grad_norm" and ours[k] != pytest.approx(theirs[k], rel=1e-3, abs=1e-4)}
    assert not differ, differ
    assert trainer.version == local.version == 1
    weights = trainer.full_state_dict()
    assert all(w.dtype == torch.bfloat16 for w in weights.values())  # the policy for a sampler: the model's dtype
    assert_bf16_weights_close(weights, local.model.state_dict(), initial, LEARNING_RATE, steps=1)


@pytest.mark.slow
def test_the_policy_written_for_the_sampler_is_bfloat16_and_its_config_says_so(both, tmp_path):
    import json

    from safetensors.torch import load_file

    (trainer, _), _ = both[1], both[2]
    trainer.save_weights_for_sampler(str(tmp_path / "final"))
    assert json.loads((tmp_path / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(tmp_path / "final" / "model.safetensors").values()} == {torch.bfloat16}
