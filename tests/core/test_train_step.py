"""A step split into several forward/backward calls trains exactly like one call."""

from __future__ import annotations

import pytest
import torch

from grpo_core import Prompt, Sample, make_plugin
from grpo_core.config import RunConfig
from grpo_core.loss import AGGREGATIONS
from grpo_core.plugins.backends.local import LocalBackend
from grpo_core.plugins_manager import build_manager
from grpo_core.stages import fwd_bwd_chunks, train_on_groups


def test_greedy_chunks():
    assert fwd_bwd_chunks(10, 1, None) == [range(0, 10)]
    assert fwd_bwd_chunks(10, 1, 4) == [range(0, 4), range(4, 8), range(8, 10)]
    assert fwd_bwd_chunks(10, 3, 4) == [range(0, 4), range(4, 10)]
    assert fwd_bwd_chunks(8, 3, 4) == [range(0, 4), range(4, 8)]
    assert fwd_bwd_chunks(1, 3, 4) == [range(0, 1)]


def samples_for(tokenizer):
    gen = torch.Generator().manual_seed(0)
    prompt = Prompt(id="p", text="x")
    samples = []
    for i in range(7):
        n_prompt, n_completion = 2 + i % 3, 1 + (5 * i) % 7
        tokens = torch.randint(3, len(tokenizer), (n_prompt + n_completion,), generator=gen).tolist()
        mask = [0.0] * n_prompt + [1.0] * n_completion
        if i == 3:
            mask = [0.0] * len(tokens)  # an all-masked sequence counts in no normalizer
        adv = float(torch.randn(1, generator=gen))
        samples.append(
            Sample(
                prompt=prompt, tokens=tokens, sampling_logprobs=[-1.0] * len(tokens), loss_mask=mask,
                text="", finish_reason="stop", policy_version=0, advantages=[adv] * len(tokens),
            )
        )  # fmt: skip
    return samples


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("loss_name", ["grpo", "gspo", "cispo"])
def test_split_step_gradient_equals_one_call(tiny_model_dir, agg, loss_name, monkeypatch):
    from grpo_core.plugins.backends.local import LocalTrainer

    captured: dict = {}
    monkeypatch.setattr(LocalTrainer, "optim_step", lambda self, params: captured.update({n: p.grad.clone() for n, p in self.model.named_parameters()}) or {})
    grads = []
    for max_per_call in (None, 3):
        config = RunConfig(model=str(tiny_model_dir), max_samples_per_fwd_bwd=max_per_call, max_completion_tokens=8, grad_clip_norm=0.0)
        trainer = LocalBackend().make_trainer(config=config)
        loss = make_plugin(f"loss.{loss_name}", agg=agg, **({"kl_beta": 0.0} if loss_name == "grpo" else {}))
        metrics = train_on_groups(build_manager([loss]), trainer, None, [samples_for(trainer.tokenizer)], config, 1e-3)
        grads.append((dict(captured), metrics))
    (one, metrics_one), (split, metrics_split) = grads
    for key in ("loss/total", "loss/policy", "loss/active_tokens"):
        assert metrics_split[key] == pytest.approx(metrics_one[key], rel=1e-5, abs=1e-6), key
    for name in one:
        assert torch.allclose(one[name], split[name], atol=1e-5, rtol=1e-4), name
