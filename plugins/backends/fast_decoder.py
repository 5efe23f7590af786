"""The local backend's fast path: a lean forward for Llama-family decoders (Llama, Qwen2, Qwen3).

transformers' eager modules spend most of a small model's step outside the matmuls: a module
call, a mask builder and a cache object per layer, three projections where one would do, a
growing ``torch.cat`` per decoded token. This forward runs the same math over the model's own
parameters with the q/k/v and gate/up projections fused into one matmul each, the q/k norms and
rotary embeddings applied to q and k together, a preallocated KV cache for sampling, and masks
built only where padding needs them. Gradients reach the model's parameters as usual.

It is used where :func:`unsupported_reason` finds nothing in the way (fp32, a supported
architecture: in bf16 transformers' norms upcast to fp32 where this forward would not); the
local backend falls back to the transformers forward otherwise. Its logits
match transformers' to float32 rounding (tests/plugins/backends/test_fast_decoder.py).

LoRA adapters (peft) on the projections take part as low-rank terms next to each fused
projection: ``x·Wᵀ + (x·Aᵀ)·(s·B)ᵀ``, one matmul for the stacked A's of a fused projection's
parts and one per part's B. The frozen base weight then gets no gradient, so training costs the
LoRA's matmuls instead of a full weight gradient; without grad (sampling, scoring) the terms are
folded into the fused weights once per call. Adapters that are disabled (peft's
``disable_adapter``, the KL reference) or merged are left out, as peft's own forward does.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SMALL_ATTENTION_SCORES = 1 << 20
"""Multi-token attention with at most this many scores (4 MB in fp32) is two plain matmuls;
larger blocks use scaled_dot_product_attention, which never holds all the scores at once."""


def unsupported_reason(model: Any) -> str | None:
    """Why the fast forward cannot stand in for ``model``'s own, or None when it can."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type '{config.model_type}' (the fast path knows {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation '{config.hidden_act}'"
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "sliding-window attention"
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type '{rope_type}'"
    if any(p.dtype != torch.float32 for p in model.parameters()):
        return "weights that are not float32"
    projections = {id(m) for layer in model.model.layers for m in _projections(layer)}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and id(module) not in projections:
            return f"an adapter on '{name}' (the fast path runs adapters on the attention and MLP projections only)"
        if hasattr(module, "lora_A") and (getattr(module, "lora_variant", None) or getattr(module, "lora_embedding_A", None)):
            return f"a LoRA variant on '{name}' (the fast path runs plain LoRA)"
    return None


def _projections(layer: Any) -> tuple[Any, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj


@attrs.define(eq=False)
class LowRank:
    """The LoRA term of a projection, fused or not: ``h = x·aᵀ`` with the parts' A's stacked,
    then each part's slice of ``h`` times its own B (the scaling folded in), the parts' outputs
    side by side; a part without an adapter has a B of width 0 and adds zeros."""

    a: torch.Tensor  # [sum of the parts' ranks, in]
    bs: list[torch.Tensor]  # per part: [out_i, rank_i]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.a)
        if len(self.bs) == 1:
            return F.linear(h, self.bs[0])
        return torch.cat([F.linear(h_i, b) for h_i, b in zip(h.split([b.shape[1] for b in self.bs], -1), self.bs)], -1)

    def fold_into(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` + the term as a matrix (the parts' B's on a block diagonal)."""
        return torch.addmm(weight, torch.block_diag(*self.bs), self.a)


def _weight_and_bias(module: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    base = module.get_base_layer() if hasattr(module, "lora_A") else module
    return base.weight, base.bias


def _low_rank_parts(module: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A projection's active adapters as one (A [r, in], s·B [out, r]) pair, or (None, None).

    Several active adapters add up, so their A's stack and their scaled B's concatenate."""
    if not hasattr(module, "lora_A") or module.disable_adapters or module.merged:
        return None, None
    active = [n for n in module.active_adapters if n in module.lora_A]
    if not active:
        return None, None
    a = torch.cat([module.lora_A[n].weight for n in active])
    b = torch.cat([module.lora_B[n].weight * module.scaling[n] for n in active], dim=1)
    return a, b


def _fused_low_rank(modules: tuple[Any, ...]) -> LowRank | None:
    """The adapters of the projections fused into one matmul (one module: its own)."""
    parts = [_low_rank_parts(m) for m in modules]
    if all(a is None for a, _ in parts):
        return None
    like = next(a for a, _ in parts if a is not None)
    a_parts = [a for a, _ in parts if a is not None]
    b_parts = [b if b is not None else like.new_zeros(_weight_and_bias(m)[0].shape[0], 0) for m, (_, b) in zip(modules, parts)]
    return LowRank(a=torch.cat(a_parts), bs=b_parts)


def _folded(
    weight: torch.Tensor | list[torch.Tensor], low_rank: LowRank | None, fold: bool
) -> tuple[torch.Tensor | list[torch.Tensor], LowRank | None]:
    """(W with the low-rank term added in, None) when folding, else (W, the term to run beside W)."""
    if low_rank is None or not fold:
        return weight, low_rank
    return low_rank.fold_into(weight), None


def _linear(
    x: torch.Tensor, weight: torch.Tensor | list[torch.Tensor], bias: torch.Tensor | None, low_rank: LowRank | None
) -> torch.Tensor:
    """``x·Wᵀ + b`` (+ the LoRA term); ``weight`` as a list: a fused projection's parts, run one
    by one and their outputs concatenated."""
    if isinstance(weight, list):
        out = torch.cat([F.linear(x, part) for part in weight], -1)
        out = out if bias is None else out + bias
    else:
        out = F.linear(x, weight, bias)
    return out if low_rank is None else out + low_rank(x)


@attrs.define(eq=False)
class LayerWeights:
    """One decoder layer's parameters, the q/k/v and gate/up projections concatenated."""

    qkv: torch.Tensor | list[torch.Tensor]
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [heads + kv_heads, head_dim]: q_norm's weight per query head, then k_norm's
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor | list[torch.Tensor]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv_lora: LowRank | None = None
    o_lora: LowRank | None = None
    gate_up_lora: LowRank | None = None
    down_lora: LowRank | None = None


class RMSNorm(torch.autograd.Function):
    """``x * rsqrt(mean(x**2) + eps) * weight`` over the last dim, with a hand-written backward
    that saves only ``x`` and the inverse norm: on CPU it takes half the time of autograd's
    trace through the composite, and less memory."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        inv_norm = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, weight, inv_norm)
        return x * inv_norm * weight

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        x, weight, inv_norm = ctx.saved_tensors
        x_hat = x * inv_norm
        grad_x_hat = grad_out * weight
        grad_weight = (grad_out * x_hat).sum_to_size(weight.shape) if ctx.needs_input_grad[1] else None
        # d/dx of x * inv_norm: the norm's own dependence on x removes the component along x_hat.
        grad_x = (grad_x_hat - x_hat * (grad_x_hat * x_hat).mean(-1, keepdim=True)).mul_(inv_norm)
        return grad_x, grad_weight, None


def _cat_or_none(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if tensors[0] is None else torch.cat(tensors)


class KVCache:
    """Keys and values per layer. With a ``capacity`` they live in preallocated buffers (for
    sampling, no autograd); without, they are concatenated (differentiable, for training)."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []

    def past_length(self, layer: int = 0) -> int:
        return self.lengths[layer] if layer < len(self.lengths) else 0

    def update(self, layer: int, k_B_H_S_D: torch.Tensor, v_B_H_S_D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        S = k_B_H_S_D.shape[2]
        if layer == len(self.keys):
            if self.capacity is None:
                self.keys.append(k_B_H_S_D)
                self.values.append(v_B_H_S_D)
            else:
                B, H, _, D = k_B_H_S_D.shape
                self.keys.append(k_B_H_S_D.new_empty(B, H, max(self.capacity, S), D))
                self.values.append(v_B_H_S_D.new_empty(B, H, max(self.capacity, S), D))
                self.keys[layer][:, :, :S] = k_B_H_S_D
                self.values[layer][:, :, :S] = v_B_H_S_D
            self.lengths.append(S)
        else:
            start = self.lengths[layer]
            if self.capacity is None:
                self.keys[layer] = torch.cat([self.keys[layer], k_B_H_S_D], dim=2)
                self.values[layer] = torch.cat([self.values[layer], v_B_H_S_D], dim=2)
            else:
                if start + S > self.keys[layer].shape[2]:
                    raise ValueError(f"the KV cache holds {self.keys[layer].shape[2]} positions; {start + S} asked for")
                self.keys[layer][:, :, start : start + S] = k_B_H_S_D
                self.values[layer][:, :, start : start + S] = v_B_H_S_D
            self.lengths[layer] = start + S
        end = self.lengths[layer]
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.keys = [k.repeat_interleave(repeats, dim=0) for k in self.keys]
        self.values = [v.repeat_interleave(repeats, dim=0) for v in self.values]

    def batch_select_indices(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]


class FastDecoder:
    """Callable like the model (``input_ids``, ``attention_mask``, ``position_ids``,
    ``past_key_values``, ``logits_to_keep``); returns the logits tensor."""

    def __init__(self, model: Any) -> None:
        config = model.config
        self.model = model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.scaling = model.model.layers[0].self_attn.scaling
        self._rope_cos_T_D: torch.Tensor | None = None
        self._rope_sin_T_D: torch.Tensor | None = None

    def new_cache(self, capacity: int | None = None) -> KVCache:
        return KVCache(capacity)

    def layer_weights(self) -> list[LayerWeights]:
        """The layers' weights, the q/k/v and gate/up projections fused.

        Without grad (sampling, scoring) the fused weights are concatenated copies with any LoRA
        terms folded in, built once per call of this method (the sampler: once per generation),
        so each decoded token costs one matmul per fused projection. With grad the parts stay
        the parameters themselves, run one by one: concatenating them would copy every weight,
        and its gradient, on each training forward (at the Qwen3-0.6B shape, 6.4 more bytes per
        parameter at the step's peak and no faster, docs/performance.md)."""
        H, Hkv = self.num_heads, self.num_kv_heads
        fold = not torch.is_grad_enabled()

        def joined(parts: list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
            return torch.cat(parts) if fold else parts

        fused = []
        for layer in self.model.model.layers:
            attn = layer.self_attn
            q, k, v, o, gate, up, down = _projections(layer)
            (q_w, q_b), (k_w, k_b), (v_w, v_b), (o_w, o_b), (g_w, g_b), (u_w, u_b), (d_w, d_b) = map(
                _weight_and_bias, (q, k, v, o, gate, up, down)
            )
            qkv, qkv_lora = _folded(joined([q_w, k_w, v_w]), _fused_low_rank((q, k, v)), fold)
            o_w, o_lora = _folded(o_w, _fused_low_rank((o,)), fold)
            gate_up, gate_up_lora = _folded(joined([g_w, u_w]), _fused_low_rank((gate, up)), fold)
            d_w, down_lora = _folded(d_w, _fused_low_rank((down,)), fold)
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            fused.append(
                LayerWeights(
                    qkv=qkv,
                    qkv_bias=_cat_or_none([q_b, k_b, v_b]),
                    qk_norm=None if q_norm is None else torch.cat([q_norm.weight.expand(H, -1), k_norm.weight.expand(Hkv, -1)]),
                    o=o_w,
                    o_bias=o_b,
                    gate_up=gate_up,
                    gate_up_bias=_cat_or_none([g_b, u_b]),
                    down=d_w,
                    down_bias=d_b,
                    input_norm=layer.input_layernorm.weight,
                    post_attention_norm=layer.post_attention_layernorm.weight,
                    qkv_lora=qkv_lora,
                    o_lora=o_lora,
                    gate_up_lora=gate_up_lora,
                    down_lora=down_lora,
                )
            )
        return fused

    def _rope(self, position_ids_B_S: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        needed = int(position_ids_B_S.max()) + 1
        if self._rope_cos_T_D is None or self._rope_cos_T_D.shape[0] < needed or self._rope_cos_T_D.device != like.device:
            size = max(
                needed,
                2 * (0 if self._rope_cos_T_D is None else self._rope_cos_T_D.shape[0]),
                256,
            )
            positions = torch.arange(size, device=like.device).unsqueeze(0)
            with torch.inference_mode(False), torch.no_grad():
                cos, sin = self.model.model.rotary_emb(like.detach(), positions)
            self._rope_cos_T_D, self._rope_sin_T_D = cos[0].clone(), sin[0].clone()
        return self._rope_cos_T_D[position_ids_B_S], self._rope_sin_T_D[position_ids_B_S]

    def __call__(self, *args: Any, logits_to_keep: int = 0, **kwargs: Any) -> torch.Tensor:
        """Logits of the last ``logits_to_keep`` positions (0 = all)."""
        return self.head(self.hidden_states(*args, keep=logits_to_keep, **kwargs))

    def head(self, hidden_N_E: torch.Tensor) -> torch.Tensor:
        """Logits from final hidden states (the model's lm_head)."""
        return self.model.lm_head(hidden_N_E)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        keep: int = 0,
        weights: list[LayerWeights] | None = None,
    ) -> torch.Tensor:
        """The final hidden states (after the last norm) of the last ``keep`` positions (0 = all).

        ``attention_mask`` [B, past + S] marks the valid keys, past and new (None = all valid);
        new tokens also see themselves, so a padded position never attends to nothing.
        """
        weights = self.layer_weights() if weights is None else weights
        B, S = input_ids.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        past = past_key_values.past_length() if past_key_values is not None else 0
        hidden_B_S_E = self.model.model.embed_tokens(input_ids)
        cos_B_S_D, sin_B_S_D = self._rope(position_ids, hidden_B_S_E)
        cos_B_S_1_D, sin_B_S_1_D = cos_B_S_D.unsqueeze(2), sin_B_S_D.unsqueeze(2)
        mask, is_causal = self._attention_mask(attention_mask, B, S, past, input_ids.device)
        for i, w in enumerate(weights):
            x = RMSNorm.apply(hidden_B_S_E, w.input_norm, self.eps)
            qkv = _linear(x, w.qkv, w.qkv_bias, w.qkv_lora).view(B, S, H + 2 * Hkv, D)
            qk_B_S_N_D, v_B_S_K_D = qkv[:, :, : H + Hkv], qkv[:, :, H + Hkv :]
            if w.qk_norm is not None:
                qk_B_S_N_D = RMSNorm.apply(qk_B_S_N_D, w.qk_norm, self.eps)
            half = D // 2
            rotated = torch.cat([-qk_B_S_N_D[..., half:], qk_B_S_N_D[..., :half]], dim=-1)
            qk_B_S_N_D = qk_B_S_N_D * cos_B_S_1_D + rotated * sin_B_S_1_D
            q = qk_B_S_N_D[:, :, :H].transpose(1, 2)
            k = qk_B_S_N_D[:, :, H:].transpose(1, 2)
            v = v_B_S_K_D.transpose(1, 2)
            if past_key_values is not None:
                k, v = past_key_values.update(i, k, v)
            attn_B_H_S_D = self._attention(q, k, v, mask, is_causal)
            attn_B_S_HD = attn_B_H_S_D.transpose(1, 2).reshape(B, S, H * D)
            hidden_B_S_E = hidden_B_S_E + _linear(attn_B_S_HD, w.o, w.o_bias, w.o_lora)
            x = RMSNorm.apply(hidden_B_S_E, w.post_attention_norm, self.eps)
            gate, up = _linear(x, w.gate_up, w.gate_up_bias, w.gate_up_lora).chunk(2, dim=-1)
            hidden_B_S_E = hidden_B_S_E + _linear(F.silu(gate) * up, w.down, w.down_bias, w.down_lora)
        kept = hidden_B_S_E[:, -keep:] if keep else hidden_B_S_E
        return RMSNorm.apply(kept, self.model.model.norm.weight, self.eps)

    def _attention(
        self, q_B_H_S_D: torch.Tensor, k_B_K_T_D: torch.Tensor, v_B_K_T_D: torch.Tensor, mask: torch.Tensor | None, is_causal: bool
    ) -> torch.Tensor:
        B, H, S, D = q_B_H_S_D.shape
        Hkv, T = k_B_K_T_D.shape[1], k_B_K_T_D.shape[2]
        if S == 1 or B * H * S * T > SMALL_ATTENTION_SCORES:
            return F.scaled_dot_product_attention(
                q_B_H_S_D, k_B_K_T_D, v_B_K_T_D, attn_mask=mask, is_causal=is_causal, scale=self.scaling, enable_gqa=Hkv != H
            )
        # Short blocks: two batched matmuls beat the CPU flash kernel (forward and backward
        # together ~1.8x on 8 queries over 24 keys); each kv head serves its group of query heads.
        g = H // Hkv
        if mask is None:
            mask = torch.ones(S, T, dtype=torch.bool, device=q_B_H_S_D.device).tril(T - S)
        scores = torch.matmul(q_B_H_S_D.reshape(B, Hkv, g * S, D), k_B_K_T_D.transpose(-1, -2)).view(B, Hkv, g, S, T)
        scores = scores.mul(self.scaling).masked_fill(~mask.view(-1, 1, 1, S, T), -math.inf)
        attn = torch.matmul(scores.softmax(-1).view(B, Hkv, g * S, T), v_B_K_T_D)
        return attn.view(B, H, S, D)

    @staticmethod
    def _attention_mask(
        attention_mask_B_K: torch.Tensor | None,
        B: int,
        S: int,
        past: int,
        device: torch.device,
    ) -> tuple[torch.Tensor | None, bool]:
        """(boolean mask [B, 1, S, past + S] or None, is_causal) for scaled_dot_product_attention."""
        if attention_mask_B_K is None:
            if S == 1:
                return None, False
            if past == 0:
                return None, True
        K = past + S
        query_at_S_1 = torch.arange(past, K, device=device).unsqueeze(-1)
        causal_S_K = torch.arange(K, device=device) <= query_at_S_1
        if attention_mask_B_K is None:
            return causal_S_K.expand(B, 1, S, K), False
        itself_S_K = torch.arange(K, device=device) == query_at_S_1
        return (causal_S_K & attention_mask_B_K.bool()[:, None, None, :]) | itself_S_K, False
