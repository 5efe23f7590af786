"""--router-replay on the fsdp backend (2 ranks, gloo): each rank forces the routes its datums
carry and returns its routing, as the one-process local trainer does."""

from __future__ import annotations

import pytest
import torch

from grpo_core.backend import sample_to_datum
from grpo_core.config import RunConfig
from grpo_core.plugins.backends.fsdp import FSDPBackend
from grpo_core.plugins.backends.local import LocalBackend
from grpo_core.plugins.samplers.local import LocalSamplerPlugin
from tests.plugins.backends.moe_models import build_tiny_moe
from tests.plugins.backends.routed_samples import loss_fn, sampled, with_routes


@pytest.fixture(scope="module")
def trainers(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    build_tiny_moe("qwen3_moe", path)
    config = RunConfig(model=str(path), dtype="float32")
    fsdp = FSDPBackend(nproc=2).make_trainer(config=config)
    local = LocalBackend().make_trainer(config=config)
    yield fsdp, local
    fsdp.close()


@pytest.mark.slow  # 2 ranks started and an MoE model built: 10-20 s
def test_fsdp_forces_and_returns_routes_as_the_local_trainer(trainers):
    fsdp, local = trainers
    assert fsdp.routing_problem is None
    samples = sampled(local, LocalSamplerPlugin().make_sampler(config=RunConfig(model="unused"), trainer=local))
    other = [((s.routed_experts.long() + 1) % 8).to(torch.uint8) for s in samples]
    ours, theirs = (t.forward_backward_custom(with_routes(samples, other), loss_fn) for t in (fsdp, local))
    for i, o in enumerate(other):
        for key in ("routed_experts", "routed_experts_chosen"):
            assert torch.equal(ours.loss_fn_outputs[i][key].to_torch(), theirs.loss_fn_outputs[i][key].to_torch()), key
        assert torch.equal(ours.loss_fn_outputs[i]["routed_experts"].to_torch(), o.long())
        assert torch.allclose(ours.loss_fn_outputs[i]["logprobs"].to_torch(), theirs.loss_fn_outputs[i]["logprobs"].to_torch(), atol=1e-5)
    assert ours.metrics["moe/load_max_over_mean"] == theirs.metrics["moe/load_max_over_mean"]
    # R2's record: pi_old's own routing, which is what the sampler recorded (float32).
    _, recorded = fsdp.forward_routed([sample_to_datum(s) for s in samples])
    assert all(torch.equal(r.long(), s.routed_experts.long()) for r, s in zip(recorded, samples))
    assert len(fsdp.forward([sample_to_datum(s) for s in samples])) == len(samples)
