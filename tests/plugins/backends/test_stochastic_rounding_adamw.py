from __future__ import annotations

import pytest
import torch

from grpo_core.plugins.backends.stochastic_rounding_adamw import StochasticRoundingAdamW, stochastic_round_to_bf16


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    x = torch.tensor([1.0 + 2**-10, -3.0 - 3 * 2**-9, 1e-30, 0.0]).repeat(20000, 1)
    rounded = stochastic_round_to_bf16(x, torch.Generator().manual_seed(0)).float()
    for column in range(x.shape[1]):
        # Only the two bf16 values around x: x truncated to bf16 and the next one away from zero.
        truncated = (x[0, column].view(torch.int32) & -(1 << 16)).view(torch.float32)
        away = (truncated.view(torch.int32) + (1 << 16)).view(torch.float32)
        assert set(rounded[:, column].tolist()) <= {truncated.item(), away.item()}
    # 1 + 2^-10 lies an eighth of the way from 1 to the next bf16 (1 + 2^-7): unbiased on average.
    assert rounded[:, 0].mean().item() == pytest.approx(1.0 + 2**-10, rel=2e-4)
    assert rounded[:, 1].mean().item() == pytest.approx(-3.0 - 3 * 2**-9, rel=2e-4)
    assert torch.equal(rounded[:, 3], torch.zeros(20000))


def test_stochastic_rounding_keeps_inf_and_nan():
    x = torch.tensor([float("inf"), float("-inf"), float("nan")])
    rounded = stochastic_round_to_bf16(x, torch.Generator().manual_seed(0)).float()
    assert rounded[0] == float("inf") and rounded[1] == float("-inf") and rounded[2].isnan()


def test_float32_parameters_get_torchs_adamw_update():
    torch.manual_seed(0)
    ours, theirs = torch.nn.Parameter(torch.randn(5, 7)), torch.nn.Parameter(torch.randn(5, 7))
    theirs.data.copy_(ours.data)
    settings = {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    optimizers = [StochasticRoundingAdamW([ours], **settings), torch.optim.AdamW([theirs], **settings)]
    for _ in range(4):
        grad = torch.randn(5, 7)
        for p, optimizer in zip((ours, theirs), optimizers):
            p.grad = grad.clone()
            optimizer.step()
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_bf16_updates_below_half_an_ulp_still_move_the_weights_on_average():
    # lr 1e-4 on weights of 1.0: each step is 1/40 of a bf16 ulp at 1.0, lost by round-to-nearest.
    p = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    optimizer = StochasticRoundingAdamW([p], lr=1e-4, seed=3)
    for _ in range(50):
        p.grad = torch.ones_like(p)
        optimizer.step()
    assert p.dtype == torch.bfloat16
    assert optimizer.state[p]["exp_avg"].dtype == torch.float32
    assert p.float().mean().item() == pytest.approx(1.0 - 50 * 1e-4, abs=3e-4)
    nearest = torch.ones(4096, dtype=torch.bfloat16)
    nearest -= 1e-4
    assert torch.equal(nearest, torch.ones_like(nearest))  # what plain bf16 arithmetic would keep


def test_rounding_repeats_with_the_seed_and_differs_across_seeds():
    def run(seed):
        p = torch.nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
        optimizer = StochasticRoundingAdamW([p], lr=1e-3, seed=seed)
        for _ in range(3):
            p.grad = torch.linspace(-1, 1, 1000, dtype=torch.bfloat16)
            optimizer.step()
        return p.detach().clone()

    assert torch.equal(run(0), run(0))
    assert not torch.equal(run(0), run(1))


def test_large_tensors_update_in_slices_like_small_ones(monkeypatch):
    from grpo_core.plugins.backends import stochastic_rounding_adamw

    def run():
        p = torch.nn.Parameter(torch.arange(100, dtype=torch.float32) / 7)
        optimizer = StochasticRoundingAdamW([p], lr=0.01)
        p.grad = torch.ones(100)
        optimizer.step()
        return p.detach().clone()

    whole = run()
    monkeypatch.setattr(stochastic_rounding_adamw, "SLICE_ELEMENTS", 7)
    assert torch.equal(run(), whole)
