"""Recording and forcing the experts of transformers MoE models (engine/moe_routing.py)."""

from __future__ import annotations

import pytest
import torch

from grpo_core.engine import moe_routing
from tests.conftest import build_tiny_model
from tests.plugins.backends.moe_models import MOE_FAMILIES, build_tiny_moe

FAMILIES = sorted(MOE_FAMILIES)


@pytest.fixture(scope="module", params=FAMILIES)
def moe(request):
    return build_tiny_moe(request.param)


def ids_B_T(seed=0, B=3, T=7):
    return torch.randint(0, 300, (B, T), generator=torch.Generator().manual_seed(seed))


def logprobs(model, ids):
    logits = model(input_ids=ids).logits.float()
    return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_records_each_positions_experts_per_layer_compactly(moe):
    ids = ids_B_T()
    with torch.no_grad(), moe_routing.tapped(moe) as tap:
        moe(input_ids=ids)
        routes = tap.take()
    assert routes.shape == (3 * 7, 2, 2) and routes.dtype == torch.uint8
    # Each position's two experts are distinct and among the 8.
    assert (routes[..., 0] != routes[..., 1]).all() and int(routes.max()) < 8
    # Positions do not all go to the same experts (the routers are not degenerate).
    assert len({tuple(r) for r in routes[:, 0].tolist()}) > 3
    assert torch.equal(tap.take_live(), routes)


def test_replaying_its_own_routing_is_the_plain_forward_exactly(moe):
    ids = ids_B_T()
    with torch.no_grad():
        plain = logprobs(moe, ids)
        with moe_routing.tapped(moe) as tap:
            moe(input_ids=ids)
            tap.forced = tap.take()
            replayed = logprobs(moe, ids)
    assert torch.equal(plain, replayed)


def forced_by_hand(model, experts_N_L_K):
    """The model with every router's selection replaced by ``experts_N_L_K`` in a patched forward:
    the live logits' softmax at the forced experts, renormalized the router's own way."""
    originals = []
    for layer, router in enumerate(moe_routing.routers(model)):
        original = router.forward

        def forward(hidden, router=router, original=original, layer=layer):
            logits, _, _ = original(hidden)
            forced = experts_N_L_K[:, layer].long()
            top = torch.softmax(logits.float(), -1).gather(-1, forced)
            if getattr(router, "norm_topk_prob", True):
                top = top / top.sum(-1, keepdim=True)
            return logits, top, forced

        router.forward = forward
        originals.append((router, original))
    return originals


def test_a_replayed_forward_is_the_forward_with_those_experts_forced_by_hand(moe):
    ids = ids_B_T(seed=1)
    N, L = ids.numel(), 2
    # Other experts than the routers choose: the reverse of their choice.
    with torch.no_grad(), moe_routing.tapped(moe) as tap:
        moe(input_ids=ids)
        chosen = tap.take()
    forced = (7 - chosen.long()).to(torch.uint8)
    with torch.no_grad(), moe_routing.tapped(moe) as tap:
        tap.forced = forced
        replayed = logprobs(moe, ids)
        assert torch.equal(tap.take(), forced)
        # The first layer's router sees the same hidden states and still chooses as before (later
        # layers see the forced experts' outputs).
        assert torch.equal(tap.take_live()[:, 0], chosen[:, 0])
    patched = forced_by_hand(moe, forced)
    try:
        with torch.no_grad():
            by_hand = logprobs(moe, ids)
    finally:
        for router, original in patched:
            router.forward = original
    assert torch.allclose(replayed, by_hand, rtol=0, atol=1e-6)
    assert not torch.allclose(replayed, logprobs(moe, ids).detach(), atol=1e-3), "forcing other experts must change the logprobs"
    assert forced.shape == (N, L, 2)


def test_replay_leaves_the_router_a_gradient(moe):
    ids = ids_B_T(seed=2)
    with torch.no_grad(), moe_routing.tapped(moe) as tap:
        moe(input_ids=ids)
        forced = (7 - tap.take().long()).to(torch.uint8)
    moe.zero_grad(set_to_none=True)
    with moe_routing.tapped(moe) as tap:
        tap.forced = forced
        logprobs(moe, ids).sum().backward()
    grads = [r.weight.grad for r in moe_routing.routers(moe)]
    assert all(g is not None and float(g.abs().sum()) > 0 for g in grads)
    moe.zero_grad(set_to_none=True)


def test_a_forced_routing_of_the_wrong_shape_is_refused(moe):
    with moe_routing.tapped(moe) as tap, torch.no_grad():
        tap.forced = torch.zeros(5, 2, 2, dtype=torch.uint8)
        with pytest.raises(ValueError, match=r"forced routing of MoE layer 0 is \(5, 2\), the forward routes \(21, 2\)"):
            moe(input_ids=ids_B_T())


def test_the_tap_leaves_with_its_block(moe):
    ids = ids_B_T()
    with torch.no_grad():
        plain = logprobs(moe, ids)
        with moe_routing.tapped(moe) as tap:
            tap.forced = torch.zeros(21, 2, 2, dtype=torch.uint8)
        assert torch.equal(logprobs(moe, ids), plain)


def test_take_before_any_forward_is_an_error(moe):
    with moe_routing.tapped(moe) as tap, pytest.raises(RuntimeError, match=r"no forward routed through MoE layers \[0, 1\]"):
        tap.take()


def test_a_dense_model_is_refused_with_its_type(tmp_path):
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path))
    assert moe_routing.routing_problem(dense) == "model type 'qwen3' has no mixture-of-experts layers"
    with pytest.raises(ValueError, match="no mixture-of-experts layers"), moe_routing.tapped(dense):
        pass


def test_an_unknown_router_is_refused_by_name(moe, monkeypatch):
    monkeypatch.setattr(moe_routing, "ROUTER_RULES", {})
    problem = moe_routing.routing_problem(moe)
    assert problem is not None and "routes with a router grpo-core does not know" in problem


def test_routes_are_uint8_up_to_256_experts_then_int16():
    assert moe_routing.route_dtype(256) == torch.uint8
    assert moe_routing.route_dtype(257) == torch.int16


def test_load_max_over_mean():
    # Layer 0: all 4 selections on experts 0 and 1 of 4 (max share 2 of 4, mean 1): 2. Layer 1: even: 1.
    routes = torch.tensor([[[0, 1], [0, 1]], [[0, 1], [2, 3]]])
    assert moe_routing.load_max_over_mean(routes, 4).tolist() == [2.0, 1.0]
