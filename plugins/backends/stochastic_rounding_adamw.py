"""AdamW for bfloat16 parameters: float32 moments, float32 update math, stochastic rounding.

A bfloat16 weight keeps 8 significant bits: an update smaller than half a unit in the last place
(a relative 2^-9, while a typical step at lr 1e-5 is ~1e-5 of the weight) rounds back to the
weight it started from, so plain bf16 AdamW stops learning. The usual cure keeps a float32
master copy (4 more bytes per parameter: 16 B/param with the moments and a bf16 gradient);
stochastic rounding instead rounds up with probability equal to the remainder, so every update
survives in expectation, at 12 B/param (bf16 weight and gradient, float32 moments). The random
bits come from a generator seeded by (seed, step, parameter), so a run repeats exactly and a
resumed run continues as an uninterrupted one would, with nothing extra in the checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

SLICE_ELEMENTS = 1 << 22
"""Elements updated at once: the float32 temporaries of a large tensor (an embedding) stay small."""


def stochastic_round_to_bf16(x_fp32: torch.Tensor, generator: torch.Generator, noise: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` in bfloat16, rounded up or down at random with the probabilities that make the
    result unbiased: a float32's top 16 bits are its bfloat16, so adding uniform noise below
    them and truncating rounds up with probability = the dropped fraction. ``noise``: an int32
    buffer of ``x``'s shape to work in (else one is made); the result is a view of it, in float32
    with its low 16 bits zero, which converts to bfloat16 exactly."""
    if noise is None:
        noise = torch.empty(x_fp32.shape, dtype=torch.int32, device=x_fp32.device)
    torch.randint(0, 1 << 16, x_fp32.shape, generator=generator, out=noise)
    return noise.add_(x_fp32.view(torch.int32)).bitwise_and_(-(1 << 16)).view(torch.float32)


class StochasticRoundingAdamW(torch.optim.Optimizer):
    """torch's AdamW update (decoupled weight decay, bias-corrected moments) with float32
    moments for parameters of any dtype; bfloat16 parameters are written back by
    :func:`stochastic_round_to_bf16`, float32 ones exactly."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.seed = seed

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # torch casts loaded moments to their parameter's dtype; these stay float32, as saved.
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, p in zip(saved_ids, params):
            for key in ("exp_avg", "exp_avg_sq"):
                if saved_id in state_dict["state"]:
                    self.state[p][key] = state_dict["state"][saved_id][key].to(device=p.device, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        # Every moment made before any update: the updates' scratch then never sits between them.
        for p in params:
            if p.grad is not None and not self.state[p]:
                self.state[p]["step"] = 0
                self.state[p]["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
                self.state[p]["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        largest = max((min(p.numel(), SLICE_ELEMENTS) for p in params if p.grad is not None), default=0)
        # The update's float32 temporaries, made once per step and reused by every slice.
        gradient, updated, denominator = (torch.empty(largest, dtype=torch.float32, device=params[0].device) for _ in range(3))
        noise = torch.empty(largest, dtype=torch.int32, device=params[0].device)
        index = 0
        for group in self.param_groups:
            lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                step = state["step"]
                step_size = lr / (1 - beta1**step)
                bias_correction2_sqrt = math.sqrt(1 - beta2**step)
                generator = torch.Generator(p.device).manual_seed(hash((self.seed, step, index)) & ((1 << 63) - 1))
                flat_p, flat_g = p.view(-1), p.grad.view(-1)
                flat_m, flat_v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
                for s in range(0, flat_p.numel(), SLICE_ELEMENTS):
                    part = slice(s, s + SLICE_ELEMENTS)
                    n = flat_p[part].numel()
                    g = gradient[:n].copy_(flat_g[part])
                    m, v = flat_m[part], flat_v[part]
                    m.lerp_(g, 1 - beta1)
                    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    new = updated[:n].copy_(flat_p[part]).mul_(1 - lr * weight_decay)
                    new.addcdiv_(m, torch.sqrt(v, out=denominator[:n]).div_(bias_correction2_sqrt).add_(eps), value=-step_size)
                    if p.dtype == torch.bfloat16:
                        flat_p[part].copy_(stochastic_round_to_bf16(new, generator, noise[:n]))
                    else:
                        flat_p[part].copy_(new)
