"""policy/entropy: the local trainer's training forward also gives the policy's token entropy."""

from __future__ import annotations

import pytest
import torch

from grpo_core import SamplingParams
from grpo_core.backend import sample_to_datum
from tests.plugins.backends.local_parts import make, prompts_of, to_samples


def exact_entropy(trainer, samples) -> float:
    """−Σ p log p of full logits, each sequence alone, averaged over its trained targets."""
    total = weight = 0.0
    with torch.no_grad():
        for s in samples:
            logp = trainer.model(input_ids=torch.tensor([s.tokens])).logits[0, :-1].float().log_softmax(-1)
            entropy_T = -(logp.exp() * logp).sum(-1)
            mask_T = torch.tensor(s.loss_mask[1:])
            total += float((entropy_T * mask_T).sum())
            weight += float(mask_T.sum())
    return total / weight


@pytest.mark.parametrize("path", ["shared_prefix", "one_pass", "packed", "checkpointed", "small_chunks"])
def test_the_training_forward_reports_the_exact_entropy_of_trained_tokens(tiny_model_dir, path, monkeypatch):
    import inspect

    from grpo_core.engine import fused_logprobs
    from grpo_core.engine import logprobs as engine_logprobs

    _, _, trainer, sampler = make(tiny_model_dir, gradient_checkpointing=path == "checkpointed", padding_free=path == "packed")
    if path == "small_chunks":
        monkeypatch.setattr(fused_logprobs, "CPU_CHUNK_BYTES", 4 * trainer.model.config.vocab_size * 3)
    prompts = prompts_of(trainer.tokenizer)
    # Two samples per prompt share their prefix; one sample per prompt does not.
    samples = to_samples(prompts, sampler.sample(prompts, 1 if path in ("one_pass", "packed") else 2, SamplingParams(max_tokens=6)))
    samples[0].loss_mask[-2] = 0.0  # an untrained token inside a completion (a tool's output, say)
    calls = []

    def counted(name, original):
        return lambda *a: calls.append(name) or original(*a)

    for name in ("_logprobs_shared_prefix", "_logprobs_packed"):
        monkeypatch.setattr(engine_logprobs, name, counted(name, getattr(engine_logprobs, name)))
    chunks = []
    original_logits = fused_logprobs._logits

    def logits(*args):
        chunks.append(inspect.stack()[1].function)  # the fused head's forward or backward
        return original_logits(*args)

    monkeypatch.setattr(fused_logprobs, "_logits", logits)

    out = trainer.forward_backward_custom([sample_to_datum(s) for s in samples], lambda d, lps: (sum(lp.sum() for lp in lps), {}))
    expected = {"shared_prefix": "_logprobs_shared_prefix", "small_chunks": "_logprobs_shared_prefix", "packed": "_logprobs_packed"}
    assert calls == ([expected[path]] if path in expected else [])
    assert out.metrics["policy/entropy"] == pytest.approx(exact_entropy(trainer, samples), rel=1e-5)
    # Each chunk's logits are computed once in forward (logprob and entropy together) and once
    # more in backward, for the gradient only.
    forward = chunks.count("forward")
    assert forward >= (3 if path == "small_chunks" else 1) and chunks == ["forward"] * forward + ["backward"] * forward


def test_no_trained_token_has_no_entropy(tiny_model_dir):
    _, _, trainer, sampler = make(tiny_model_dir)
    prompts = prompts_of(trainer.tokenizer)
    samples = to_samples(prompts, sampler.sample(prompts, 1, SamplingParams(max_tokens=4)))
    for s in samples:
        s.loss_mask = [0.0] * len(s.loss_mask)
    out = trainer.forward_backward_custom([sample_to_datum(s) for s in samples], lambda d, lps: (sum(lp.sum() for lp in lps) * 0, {}))
    assert out.metrics["policy/entropy"] != out.metrics["policy/entropy"]  # NaN: a mean of nothing


def test_a_run_logs_the_entropy_every_step(tiny_model_dir, tiny_dataset, tmp_path):
    import json
    import math

    from grpo_core.config import RunConfig
    from grpo_core.train import run

    r = tmp_path / "r"
    run(RunConfig(model=str(tiny_model_dir), dataset=str(tiny_dataset), prompt_template="Q: {prompt}\nA:", max_steps=2,
                  prompt_groups_per_step=2, completions_per_prompt=2, max_completion_tokens=4, reward={"format": 1.0},
                  logger=["jsonl"], run_dir=str(r), drop_zero_variance_groups=False))  # fmt: skip
    metrics = [json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()]
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    assert all(0 < m["policy/entropy"] < math.log(vocab) for m in metrics)
