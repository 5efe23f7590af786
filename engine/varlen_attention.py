"""Packed rows' attention through torch's variable-length flash kernel (``varlen_attn``) instead
of sdpa with a block-diagonal [B, 1, S, S] mask.

``varlen`` is registered with transformers as an attention implementation. A call carrying
``cu_seq_lens_q`` (what :meth:`TransformersForward.hidden_states` derives from a packed row's
restarting position ids, :func:`packed_sequence_lengths`) runs every packed sequence causally on
its own, with no mask built; any other call (padded rows, a KV cache, the sampler's decoding) is
sdpa's, with sdpa's mask. The kernel is flash attention: CUDA only, bfloat16/float16 only, no
attention-score softcapping; sliding-window layers are refused here rather than translated.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from grpo_core.errors import PluginError

VARLEN = "varlen"
SAVED_AS = "sdpa"
"""What a varlen model's saved config.json records: the same attention, loadable without grpo-core."""
MAX_HEAD_DIM = 256
"""The widest head torch's flash kernel takes."""
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_KERNEL_KEYWORDS = ("window_size", "scale")
PROBE_TOLERANCE = 0.02
"""The start-up probe's bound on the largest difference from sdpa, relative to the largest value,
of the output and of the three gradients (bf16's unit is 2^-8 = 0.004: a few roundings apart)."""

_packed_forward: contextvars.ContextVar[bool] = contextvars.ContextVar("grpo_core_packed_forward", default=False)
"""Set while :func:`packed_forward` runs a packed row: its masks are not built."""


def _kernel() -> Callable[..., torch.Tensor]:
    """torch's varlen flash kernel: the one place it is called from (tests put a reference in its place)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def kernel_problem() -> str | None:
    """Why this torch has no usable ``varlen_attn`` (None: it has one with the keywords used here).
    ``enable_gqa`` is not required: torch 2.10/2.11's has none but hands fewer K/V heads than query
    heads to the flash kernel, which takes them natively (the start-up probe checks it)."""
    try:
        kernel = _kernel()
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    missing = [k for k in _KERNEL_KEYWORDS if not _takes(kernel, k)]
    if missing:
        return f"torch {torch.__version__}'s varlen_attn lacks {', '.join(missing)}"
    return None


def _takes(kernel: Callable[..., torch.Tensor], keyword: str) -> bool:
    parameters = inspect.signature(kernel).parameters
    return keyword in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _gqa_keywords(kernel: Callable[..., torch.Tensor], grouped: bool) -> dict[str, bool]:
    """``enable_gqa`` where the kernel has the keyword (torch >= 2.12 refuses grouped heads without it)."""
    return {"enable_gqa": grouped} if _takes(kernel, "enable_gqa") else {}


def gqa_probe(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``varlen_attn`` cannot attend grouped heads on ``device`` (None: it can): two causal
    sequences of 4 query heads over 2 K/V heads, forward and backward, against sdpa's
    ``enable_gqa`` within :data:`PROBE_TOLERANCE`. Run once per process, device and dtype."""
    return _gqa_probe(device, dtype)


@functools.cache
def _gqa_probe(device: torch.device, dtype: torch.dtype) -> str | None:
    kernel = _kernel()
    lengths, heads, kv_heads, width = (5, 11), 4, 2, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), n, width, generator=g).to(device, dtype).requires_grad_() for n in (heads, kv_heads, kv_heads))
    cu_seq = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32, device=device)
    upstream = torch.randn(sum(lengths), heads, width, generator=g).to(device, dtype)
    try:
        out = kernel(q, k, v, cu_seq, cu_seq, max(lengths), max(lengths), scale=None, window_size=(-1, 0), **_gqa_keywords(kernel, True))
        got = [out, *torch.autograd.grad(out, (q, k, v), upstream)]
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
        return f"varlen_attn failed the start-up probe (grouped heads, forward and backward): {str(exc).splitlines()[0]}"
    parts = []
    for start, end in zip(cu_seq[:-1].tolist(), cu_seq[1:].tolist()):
        each = [x[start:end].transpose(0, 1) for x in (q, k, v)]
        parts.append(torch.nn.functional.scaled_dot_product_attention(*each, is_causal=True, enable_gqa=True).transpose(0, 1))
    reference = torch.cat(parts)
    want = [reference, *torch.autograd.grad(reference, (q, k, v), upstream)]
    for name, a, b in zip(("output", "query gradient", "key gradient", "value gradient"), got, want):
        error = float((a.detach().float() - b.detach().float()).abs().max()) / max(float(b.detach().float().abs().max()), 1e-30)
        if not error <= PROBE_TOLERANCE:
            return f"varlen_attn's {name} over grouped heads is {error:.3g} off sdpa's in the start-up probe (at most {PROBE_TOLERANCE})"
    return None


def architecture_problem(config: Any, model_class: Any) -> str | None:
    """Why this architecture's attention is not plain causal attention the kernel computes (None: it is)."""
    text = config.get_text_config()
    name = getattr(model_class, "__name__", text.model_type)
    if model_class is None or not (model_class._supports_sdpa and model_class._supports_flash_attn):
        return f"{name} has no flash and sdpa attention"
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return f"{name} softcaps attention scores, which varlen_attn cannot"
    layer_types = getattr(text, "layer_types", None)
    sliding = (
        any(t != "full_attention" for t in layer_types)
        if layer_types is not None
        else getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True)
    )
    if sliding:
        return f"{name} has sliding-window or other non-causal layers"
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if head_dim > MAX_HEAD_DIM:
        return f"{name}'s heads are {head_dim} wide, flash attention's at most {MAX_HEAD_DIM}"
    return None


def varlen_problem(device: torch.device, dtype: torch.dtype, config: Any, model_class: Any) -> str | None:
    """Why packed rows cannot attend through ``varlen_attn`` on this device, dtype, torch and architecture."""
    if device.type != "cuda":
        return f"varlen_attn is a CUDA kernel and this run is on {device.type}"
    if dtype not in KERNEL_DTYPES:
        return f"flash attention has no {str(dtype).removeprefix('torch.')} kernel (bfloat16/float16 only)"
    return kernel_problem() or architecture_problem(config, model_class) or gqa_probe(device, dtype)


def choose_attention(requested: str, path: str, device: torch.device, dtype: torch.dtype, padding_free: bool) -> str:
    """The attention implementation to load the trainer's model with: ``varlen`` where asked for
    (refused where it cannot run) or, for ``auto``, where packed rows would use it and it can run;
    else ``requested`` as it is. Decided from the config alone, before any model loads."""
    if requested not in ("auto", VARLEN):
        return requested
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    problem = "sequences are never packed (--backend-opt padding_free=false)" if not padding_free else None
    problem = problem or varlen_problem(device, dtype, config, model_class)
    if requested == VARLEN and problem:
        raise PluginError(f"--backend-opt attn_implementation=varlen: {problem}; use auto (sdpa with a block mask here)")
    recorded = config._attn_implementation
    if problem or (recorded is not None and recorded != SAVED_AS):
        return requested
    return VARLEN


def packed_attention_line(model: Any, padding_free: bool = True) -> str:
    """How packed sequences are kept apart in ``model`` and, where not by varlen_attn, why not."""
    attention = model.config._attn_implementation
    if attention == VARLEN:
        how = "enable_gqa" if _gqa_keywords(_kernel(), True) else "the flash kernel's native grouped heads"
        return (
            "varlen attention isolates them: flash attention over each row's sequence lengths, no [S, S] mask "
            f"(torch {torch.__version__}'s varlen_attn, grouped K/V heads through {how}; forward and backward matched sdpa "
            "in the start-up probe)"
        )
    model_class = type(model.get_base_model() if hasattr(model, "get_base_model") else model)
    problem = varlen_problem(model.device, model.dtype, model.config, model_class)
    why = problem or f"--backend-opt attn_implementation={attention} was asked for"
    return f"{attention} attention isolates them with a block-diagonal mask; not varlen: {why}"


def packed_sequence_lengths(position_ids_R_W: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The cumulative sequence lengths [N + 1] (int32) of the rows flattened end to end, a
    sequence starting at each row's start and wherever a position does not follow the one
    before (restarting position ids), and the longest sequence's length."""
    R, W = position_ids_R_W.shape
    starts_R_W = torch.ones_like(position_ids_R_W, dtype=torch.bool)
    starts_R_W[:, 1:] = position_ids_R_W[:, 1:] != position_ids_R_W[:, :-1] + 1
    starts_N = starts_R_W.reshape(-1).nonzero().squeeze(-1)
    cu_seq_lens = torch.cat([starts_N, starts_N.new_tensor([R * W])]).to(torch.int32)
    return cu_seq_lens, int(cu_seq_lens.diff().max())


@contextmanager
def packed_forward(position_ids_R_W: torch.Tensor) -> Iterator[dict[str, Any]]:
    """The keyword arguments that carry a packed row's sequence lengths to every attention layer,
    and no mask built while the forward runs (recomputed layers get the same arguments again)."""
    cu_seq_lens, longest = packed_sequence_lengths(position_ids_R_W)
    token = _packed_forward.set(True)
    try:
        yield {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": longest, "max_length_k": longest}
    finally:
        _packed_forward.reset(token)


def varlen_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """No mask for a packed row (its sequences are kept apart by their lengths), sdpa's otherwise."""
    from transformers.masking_utils import sdpa_mask

    return None if _packed_forward.get() else sdpa_mask(*args, **kwargs)


def varlen_attention_forward(
    module: torch.nn.Module,
    query_B_H_S_D: torch.Tensor,
    key_B_K_S_D: torch.Tensor,
    value_B_K_S_D: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: [B, S, H, D] out. With ``cu_seq_lens_q`` (a
    packed row) through ``varlen_attn``, each sequence causal on its own; otherwise sdpa's."""
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if cu_seq_lens is None:
        if _packed_forward.get():
            raise PluginError(
                f"{type(module).__name__} did not receive the packed row's sequence lengths: this model does not pass "
                "attention arguments through its layers; use --backend-opt attn_implementation=sdpa"
            )
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query_B_H_S_D, key_B_K_S_D, value_B_K_S_D, attention_mask, dropout=dropout, scaling=scaling, softcap=softcap, **kwargs
        )
    if sliding_window is not None or softcap is not None or dropout or not getattr(module, "is_causal", True):
        raise PluginError(
            f"{type(module).__name__} asks varlen attention for a sliding window, softcapping, dropout or non-causal "
            "attention, which grpo-core's varlen path does not compute; use --backend-opt attn_implementation=sdpa"
        )
    B, H, S, D = query_B_H_S_D.shape
    heads_kv = key_B_K_S_D.shape[1]

    def tokens(x_B_H_S_D: torch.Tensor) -> torch.Tensor:
        return x_B_H_S_D.transpose(1, 2).reshape(B * S, x_B_H_S_D.shape[1], D)

    out_T_H_D = _kernel()(
        tokens(query_B_H_S_D),
        tokens(key_B_K_S_D),
        tokens(value_B_K_S_D),
        cu_seq_lens,
        kwargs["cu_seq_lens_k"],
        kwargs["max_length_q"],
        kwargs["max_length_k"],
        scale=scaling,
        window_size=(-1, 0),
        **_gqa_keywords(_kernel(), heads_kv != H),
    )
    return out_T_H_D.view(B, S, H, D), None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, varlen_mask)


register()
