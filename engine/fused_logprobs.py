"""Per-token logprobs (and entropies) of a linear output layer, without [N, V] logits.

``log softmax(hidden @ weight.T [+ bias] [+ LoRA])[target]`` for N positions over a V-token
vocabulary, computed over chunks of positions: only one chunk's logits exist at a time, in forward
and in backward. Forward keeps, besides its inputs, one float32 number per position (the
logsumexp); backward recomputes each chunk's logits from it and the saved hidden states, forms
the logits' gradient ``g·(onehot(target) − softmax)`` and multiplies it out at once into the
hidden states' gradient (that chunk's rows) and the weight's (one float32 buffer for all chunks,
each chunk's product accumulated in float32, not rounded to bf16 first).

Why recompute rather than compute the gradient in forward (Liger's fused cross-entropy): Liger
can because its output is the scalar loss, so the logits' gradient is known in forward; here the
output is one logprob per token whose upstream gradient (a clipped ratio, a KL) is known only in
backward, and the weight's gradient ``Σᵢ gᵢ (onehot − pᵢ) ⊗ hᵢ`` cannot be formed without it. So
backward recomputes the logits once per chunk (what activation checkpointing did too), but with
no checkpoint machinery, no saved log-softmax and no recomputed entropy.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

CPU_CHUNK_BYTES = 1 << 26
"""Float32 logits per chunk on a CPU: 64 MiB (measured there: larger chunks are no faster and
leave caches; 110 positions at a 151,936-token vocabulary)."""

CUDA_CHUNK_BYTES_CAP = 1 << 30
"""At most 1 GiB of float32 logits per chunk on a GPU (1,766 positions at 151,936 tokens): past
that the matmuls are already large enough to run at full rate."""

CUDA_FREE_SHARE = 8
"""A GPU chunk's float32 logits take at most this fraction (1/8) of the device's free memory: a
chunk holds about four tensors of its size at once (the logits in the model's dtype and in
float32, their exponentials, the gradient), so half the free memory at most."""


def chunk_rows(vocab: int, device: torch.device) -> int:
    """Positions per chunk: a byte budget for its float32 logits, from the device's free memory
    on CUDA (capped), a constant elsewhere."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = min(CUDA_CHUNK_BYTES_CAP, free // CUDA_FREE_SHARE)
    else:
        budget = CPU_CHUNK_BYTES
    return max(1, budget // (4 * vocab))


@attrs.frozen
class LowRank:
    """A LoRA adapter's term of the logits, ``(down @ up.T) * scale``: ``down`` [N, R] is the
    adapter's first projection of the hidden states (computed outside, it is small), ``up`` [V, R]
    its second weight (peft's ``lora_B``)."""

    down_N_R: torch.Tensor
    up_V_R: torch.Tensor
    scale: float


@attrs.frozen
class LinearHead:
    """An output layer that is a linear map of the hidden states: ``hidden @ weight.T + bias``,
    plus a LoRA adapter's term, then ``tanh(logits / softcap) · softcap`` where a softcap is set
    (the order and dtypes of transformers' and peft's forward)."""

    weight_V_H: torch.Tensor
    bias_V: torch.Tensor | None = None
    low_rank: LowRank | None = None
    softcap: float | None = None


def linear_logprobs(
    head: LinearHead, hidden_N_H: torch.Tensor, targets_N: torch.Tensor, entropy: bool = False, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 ``log softmax(logits)[target]`` per position, differentiable with respect to the
    hidden states and the head's tensors, and with ``entropy`` the entropy −Σ p log p of each
    position's distribution (no gradient; None without). ``rows`` positions per chunk (default:
    :func:`chunk_rows`)."""
    if hidden_N_H.dim() != 2 or targets_N.shape != hidden_N_H.shape[:1]:
        raise ValueError(f"hidden states must be [N, H] and targets [N]; got {tuple(hidden_N_H.shape)} and {tuple(targets_N.shape)}")
    low = head.low_rank
    rows = rows or chunk_rows(head.weight_V_H.shape[0], hidden_N_H.device)
    logprobs_N, entropy_N = _FusedLinearLogprobs.apply(
        hidden_N_H,
        head.weight_V_H,
        head.bias_V,
        None if low is None else low.down_N_R,
        None if low is None else low.up_V_R,
        targets_N,
        _Constants(None if low is None else low.scale, head.softcap, entropy, rows),
    )
    return logprobs_N, entropy_N if entropy else None


@attrs.frozen
class _Constants:
    scale: float | None
    softcap: float | None
    entropy: bool
    rows: int


def _capped(logits: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The softcapped logits and the tanh they came from (None without a softcap)."""
    if softcap is None:
        return logits, None
    tanh = torch.tanh(logits / softcap)
    return tanh * softcap, tanh


class _FusedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden_N_H: torch.Tensor,
        weight_V_H: torch.Tensor,
        bias_V: torch.Tensor | None,
        down_N_R: torch.Tensor | None,
        up_V_R: torch.Tensor | None,
        targets_N: torch.Tensor,
        const: _Constants,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        N = hidden_N_H.shape[0]
        logprobs_N = torch.empty(N, dtype=torch.float32, device=hidden_N_H.device)
        lse_N = torch.empty_like(logprobs_N)
        entropy_N = torch.empty(N if const.entropy else 0, dtype=torch.float32, device=hidden_N_H.device)
        for start in range(0, N, const.rows):
            at = slice(start, start + const.rows)
            capped_C_V, _ = _capped(_logits(hidden_N_H, weight_V_H, bias_V, down_N_R, up_V_R, const, at), const.softcap)
            logits_C_V = capped_C_V.float()
            lse_C = torch.logsumexp(logits_C_V, -1)
            lse_N[at] = lse_C
            logprobs_N[at] = logits_C_V.gather(-1, targets_N[at, None])[:, 0] - lse_C
            if const.entropy:
                logprobs_C_V = logits_C_V.sub_(lse_C[:, None])
                entropy_N[at] = -(logprobs_C_V.exp() * logprobs_C_V).sum(-1)
        ctx.save_for_backward(hidden_N_H, weight_V_H, bias_V, down_N_R, up_V_R, targets_N, lse_N)
        ctx.const = const
        ctx.mark_non_differentiable(entropy_N)
        return logprobs_N, entropy_N

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_N: torch.Tensor, _entropy_grad: Any) -> tuple[torch.Tensor | None, ...]:
        hidden_N_H, weight_V_H, bias_V, down_N_R, up_V_R, targets_N, lse_N = ctx.saved_tensors
        const: _Constants = ctx.const
        need_hidden, need_weight, need_bias, need_down, need_up = ctx.needs_input_grad[:5]
        grad_hidden = torch.empty_like(hidden_N_H) if need_hidden else None
        grad_down = torch.empty_like(down_N_R) if need_down else None
        # Summed over chunks in float32 whatever the weights' dtype, cast once at the end.
        grad_weight = torch.zeros_like(weight_V_H, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias_V, dtype=torch.float32) if need_bias else None
        grad_up = torch.zeros_like(up_V_R, dtype=torch.float32) if need_up else None
        for start in range(0, hidden_N_H.shape[0], const.rows):
            at = slice(start, start + const.rows)
            raw_C_V = _logits(hidden_N_H, weight_V_H, bias_V, down_N_R, up_V_R, const, at)
            capped_C_V, tanh_C_V = _capped(raw_C_V, const.softcap)
            # d logprob / d logits = onehot(target) − softmax, times each position's upstream gradient.
            grad_C_V = capped_C_V.float().sub_(lse_N[at, None]).exp_().mul_(-grad_N[at, None])
            grad_C_V.scatter_add_(-1, targets_N[at, None], grad_N[at, None])
            grad_C_V = grad_C_V.to(raw_C_V.dtype)
            if tanh_C_V is not None:
                # As autograd takes it back through ``tanh(logits / cap) * cap``, step by step.
                grad_C_V = grad_C_V * const.softcap * (1 - tanh_C_V * tanh_C_V) / const.softcap
            hidden_C_H = hidden_N_H[at]
            if grad_hidden is not None:
                torch.mm(grad_C_V, weight_V_H, out=grad_hidden[at])
            if grad_weight is not None:
                _accumulate(grad_weight, grad_C_V.T, hidden_C_H)
            if grad_bias is not None:
                grad_bias += grad_C_V.sum(0)
            if down_N_R is not None:
                scaled_C_V = grad_C_V.to(up_V_R.dtype) * const.scale
                if grad_down is not None:
                    torch.mm(scaled_C_V, up_V_R, out=grad_down[at])
                if grad_up is not None:
                    _accumulate(grad_up, scaled_C_V.T, down_N_R[at])
        return (
            grad_hidden,
            _cast(grad_weight, weight_V_H),
            _cast(grad_bias, bias_V),
            grad_down,
            _cast(grad_up, up_V_R),
            None,
            None,
        )


def _logits(
    hidden_N_H: torch.Tensor,
    weight_V_H: torch.Tensor,
    bias_V: torch.Tensor | None,
    down_N_R: torch.Tensor | None,
    up_V_R: torch.Tensor | None,
    const: _Constants,
    at: slice,
) -> torch.Tensor:
    """One chunk's logits before the softcap, in the model's dtype, as the layers compute them."""
    logits_C_V = F.linear(hidden_N_H[at], weight_V_H, bias_V)
    if down_N_R is None:
        return logits_C_V
    # peft adds the adapter's term in the adapter's dtype and casts the sum back to the layer's.
    return (logits_C_V + F.linear(down_N_R[at], up_V_R) * const.scale).to(logits_C_V.dtype)


_MATMUL_OUT_DTYPE = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 8)
"""torch >= 2.8 multiplies bf16 into a float32 result on CUDA (``addmm(..., out_dtype=float32)``)."""


def _accumulate(total_V_K: torch.Tensor, grad_V_C: torch.Tensor, inputs_C_K: torch.Tensor) -> None:
    """``total += grad @ inputs`` in float32, each chunk's product never rounded to the inputs' dtype:
    summing bf16-rounded chunk products biases the gradient (TRL measured entropy drifting lower)."""
    if inputs_C_K.dtype == torch.float32:
        total_V_K.addmm_(grad_V_C, inputs_C_K)
    elif total_V_K.device.type == "cuda" and _MATMUL_OUT_DTYPE:
        torch.addmm(total_V_K, grad_V_C, inputs_C_K, out_dtype=torch.float32, out=total_V_K)
    else:
        # No bf16 x bf16 -> float32 kernel here: the inputs in float32 (exact), one chunk's worth at a time.
        total_V_K.addmm_(grad_V_C.float(), inputs_C_K.float())


def _cast(grad: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None or like is None else grad.to(like.dtype)
