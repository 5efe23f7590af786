"""The local sampler's fast path: a lean, inference-only forward for Llama-family decoders
(Llama, Qwen2, Qwen3).

transformers' eager modules spend most of a small model's decoding step outside the matmuls: a
module call, a mask builder and a cache object per layer, three projections where one would do,
a growing ``torch.cat`` per decoded token. This forward runs the same math over the model's own
parameters with the q/k/v and gate/up projections fused into one matmul each, the q/k norms and
rotary embeddings applied to q and k together, a preallocated KV cache, and masks built only
where padding needs them.

It has no backward: the trainer and the KL reference run transformers' forward, faster with
gradients (docs/performance.md), so a call with grad enabled is refused. The local sampler uses
it where :func:`unsupported_reason` finds nothing in the way (float32 weights, or bfloat16/float16
on CUDA; a supported architecture) and transformers' forward otherwise. Its logits match
transformers' to float32 rounding (tests/engine/test_fast_decoder.py); its norms compute in
float32 and round back before the weight, as transformers' do. A decoded token's attention packs
each kv head's group of query heads into one call (:meth:`FastDecoder._attention`).

LoRA adapters (peft) on the projections are folded into the fused weights (``W + s·B·A``) once
per :meth:`FastDecoder.layer_weights` call. Adapters that are disabled (peft's
``disable_adapter``) or merged are left out, as peft's own forward does.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
CUDA_DTYPES = (torch.bfloat16, torch.float16)
"""The half-precision dtypes the fused decoder runs, on CUDA only."""
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
    # bf16/fp16 run on CUDA, where its fused projections and packed attention launch a third fewer
    # kernels per decode step than transformers' forward (docs/performance.md); on the CPU it is no
    # faster there than transformers' forward over a static cache (benchmarks/decode.py), whose
    # rounding the trainer shares.
    dtypes = {p.dtype for p in model.parameters()}
    on_cuda = all(p.is_cuda for p in model.parameters())
    if dtypes != {torch.float32} and not (on_cuda and len(dtypes) == 1 and dtypes <= set(CUDA_DTYPES)):
        return "weights that are not float32 (bfloat16 and float16 run on CUDA)"
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


def _fused_weight(modules: tuple[Any, ...]) -> torch.Tensor:
    """The projections' weights stacked into one (one module: its own), each with its adapters'
    ``s·B·A`` added: the parts' B's on a block diagonal over their stacked A's; a part without
    an adapter has a B of width 0 and adds zeros."""
    weights = [_weight_and_bias(m)[0] for m in modules]
    weight = weights[0] if len(weights) == 1 else torch.cat(weights)
    parts = [_low_rank_parts(m) for m in modules]
    if all(a is None for a, _ in parts):
        return weight
    a = torch.cat([a for a, _ in parts if a is not None])
    bs = [b if b is not None else a.new_zeros(w.shape[0], 0) for w, (_, b) in zip(weights, parts)]
    return torch.addmm(weight, torch.block_diag(*bs), a)


@attrs.define(eq=False)
class LayerWeights:
    """One decoder layer's parameters, the q/k/v and gate/up projections concatenated."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [heads + kv_heads, head_dim]: q_norm's weight per query head, then k_norm's
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x**2) + eps))`` over the last dim, the normalisation in float32
    and rounded to ``x``'s dtype before the weight (transformers' order of operations)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))).to(x.dtype)


def _cat_or_none(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if tensors[0] is None else torch.cat(tensors)


class KVCache:
    """Keys and values per layer in preallocated buffers of ``capacity`` positions (or the first
    block's length, if longer), written in place.

    With ``slot_1`` set (a one-element tensor on the device) a block of one position is written
    at that slot and the buffers' first ``width`` slots are returned (all of them when None):
    shapes and addresses stay fixed and no length is read on the host, what a captured decode
    step needs (:mod:`grpo_core.engine.decoding`); the caller's mask, ``width`` slots wide, says
    which of them hold keys."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []
        self.slot_1: torch.Tensor | None = None

    def past_length(self, layer: int = 0) -> int:
        return self.lengths[layer] if layer < len(self.lengths) else 0

    def update(
        self, layer: int, k_B_H_S_D: torch.Tensor, v_B_H_S_D: torch.Tensor, width: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        S = k_B_H_S_D.shape[2]
        if self.slot_1 is not None:
            # A decode step of fewer rows than the buffers hold (live rows compacted to the front)
            # works on the first rows, and attention reads the first ``width`` slots (the caller's
            # bound past the slot, so the early steps of a long generation read about their own
            # length, not the capacity): views at the buffers' own addresses.
            rows = k_B_H_S_D.shape[0]
            keys, values = self.keys[layer][:rows], self.values[layer][:rows]
            keys.index_copy_(2, self.slot_1, k_B_H_S_D)
            values.index_copy_(2, self.slot_1, v_B_H_S_D)
            return keys[:, :, :width], values[:, :, :width]
        if layer == len(self.keys):
            B, H, _, D = k_B_H_S_D.shape
            # Zeros, not garbage: a masked slot still meets its weight of 0 in attention, and 0 × NaN is NaN.
            self.keys.append(k_B_H_S_D.new_zeros(B, H, max(self.capacity, S), D))
            self.values.append(v_B_H_S_D.new_zeros(B, H, max(self.capacity, S), D))
            self.keys[layer][:, :, :S] = k_B_H_S_D
            self.values[layer][:, :, :S] = v_B_H_S_D
            self.lengths.append(S)
        else:
            start = self.lengths[layer]
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

    def fill_from(self, prompts: KVCache, repeats: int) -> None:
        """Write a prefilled cache of U rows into this one's first slots, each row ``repeats``
        times (U × repeats rows, the buffers allocated on the first call and kept after)."""
        width = prompts.lengths[0]
        for layer, (k_U_H_P_D, v_U_H_P_D) in enumerate(zip(prompts.keys, prompts.values)):
            U, H, _, D = k_U_H_P_D.shape
            if layer == len(self.keys):
                self.keys.append(k_U_H_P_D.new_zeros(U * repeats, H, self.capacity, D))
                self.values.append(v_U_H_P_D.new_zeros(U * repeats, H, self.capacity, D))
                self.lengths.append(self.capacity)
            self.keys[layer].view(U, repeats, H, self.capacity, D)[:, :, :, :width].copy_(k_U_H_P_D[:, None, :, :width])
            self.values[layer].view(U, repeats, H, self.capacity, D)[:, :, :, :width].copy_(v_U_H_P_D[:, None, :, :width])

    def take_rows(self, order: torch.Tensor) -> None:
        """Rows ``order`` (device indices) moved to the front, in place (the live rows of a batch
        compacted into a smaller one)."""
        n = order.shape[0]
        for buffers in (self.keys, self.values):
            for tensor in buffers:
                tensor[:n] = tensor[order]

    def batch_select_indices(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]


def _refuse_grad() -> None:
    if torch.is_grad_enabled():
        raise RuntimeError(
            "the fused decoder is inference-only (it has no backward): call it under torch.no_grad() or torch.inference_mode()"
        )


class FastDecoder:
    """Callable like the model (``input_ids``, ``attention_mask``, ``position_ids``,
    ``past_key_values``, ``logits_to_keep``) with grad disabled; returns the logits tensor."""

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

    @property
    def rope_tables(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The rotary cos and sin tables [positions, head_dim] built so far (None before the first call)."""
        return self._rope_cos_T_D, self._rope_sin_T_D

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(capacity)

    def layer_weights(self) -> list[LayerWeights]:
        """The layers' weights, the q/k/v and gate/up projections fused: concatenated copies with
        any LoRA terms folded in, built once per call of this method (the sampler: once per
        generation, as weight sync may have changed the weights since), so each decoded token
        costs one matmul per fused projection."""
        _refuse_grad()
        H, Hkv = self.num_heads, self.num_kv_heads
        fused = []
        for layer in self.model.model.layers:
            attn = layer.self_attn
            q, k, v, o, gate, up, down = _projections(layer)
            q_b, k_b, v_b, o_b, g_b, u_b, d_b = (_weight_and_bias(m)[1] for m in (q, k, v, o, gate, up, down))
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            fused.append(
                LayerWeights(
                    qkv=_fused_weight((q, k, v)),
                    qkv_bias=_cat_or_none([q_b, k_b, v_b]),
                    qk_norm=None if q_norm is None else torch.cat([q_norm.weight.expand(H, -1), k_norm.weight.expand(Hkv, -1)]),
                    o=_fused_weight((o,)),
                    o_bias=o_b,
                    gate_up=_fused_weight((gate, up)),
                    gate_up_bias=_cat_or_none([g_b, u_b]),
                    down=_fused_weight((down,)),
                    down_bias=d_b,
                    input_norm=layer.input_layernorm.weight,
                    post_attention_norm=layer.post_attention_layernorm.weight,
                )
            )
        return fused

    def _rope(self, position_ids_B_S: torch.Tensor, like: torch.Tensor, max_position: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        # A known bound spares reading the largest position off the device.
        needed = (int(position_ids_B_S.max()) if max_position is None else max_position) + 1
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
        max_position: int | None = None,
    ) -> torch.Tensor:
        """The final hidden states (after the last norm) of the last ``keep`` positions (0 = all).

        ``attention_mask`` [B, past + S] marks the valid keys, past and new (None = all valid);
        new tokens also see themselves, so a padded position never attends to nothing. A 4-D
        boolean mask [B, 1, S, keys] is used as it is; over a cache written at a slot, attention
        reads its first ``keys`` slots. ``max_position``: a bound on
        ``position_ids`` known to the caller (None: read off the device).
        """
        _refuse_grad()
        weights = self.layer_weights() if weights is None else weights
        B, S = input_ids.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        past = past_key_values.past_length() if past_key_values is not None else 0
        hidden_B_S_E = self.model.model.embed_tokens(input_ids)
        cos_B_S_D, sin_B_S_D = self._rope(position_ids, hidden_B_S_E, max_position)
        cos_B_S_1_D, sin_B_S_1_D = cos_B_S_D.unsqueeze(2), sin_B_S_D.unsqueeze(2)
        mask, is_causal = self._attention_mask(attention_mask, B, S, past, input_ids.device)
        for i, w in enumerate(weights):
            x = _rms_norm(hidden_B_S_E, w.input_norm, self.eps)
            qkv = F.linear(x, w.qkv, w.qkv_bias).view(B, S, H + 2 * Hkv, D)
            qk_B_S_N_D, v_B_S_K_D = qkv[:, :, : H + Hkv], qkv[:, :, H + Hkv :]
            if w.qk_norm is not None:
                qk_B_S_N_D = _rms_norm(qk_B_S_N_D, w.qk_norm, self.eps)
            half = D // 2
            rotated = torch.cat([-qk_B_S_N_D[..., half:], qk_B_S_N_D[..., :half]], dim=-1)
            qk_B_S_N_D = qk_B_S_N_D * cos_B_S_1_D + rotated * sin_B_S_1_D
            q = qk_B_S_N_D[:, :, :H].transpose(1, 2)
            k = qk_B_S_N_D[:, :, H:].transpose(1, 2)
            v = v_B_S_K_D.transpose(1, 2)
            if past_key_values is not None:
                k, v = past_key_values.update(i, k, v, width=None if mask is None else mask.shape[-1])
            attn_B_H_S_D = self._attention(q, k, v, mask, is_causal)
            attn_B_S_HD = attn_B_H_S_D.transpose(1, 2).reshape(B, S, H * D)
            hidden_B_S_E = hidden_B_S_E + F.linear(attn_B_S_HD, w.o, w.o_bias)
            x = _rms_norm(hidden_B_S_E, w.post_attention_norm, self.eps)
            gate, up = F.linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
            hidden_B_S_E = hidden_B_S_E + F.linear(F.silu(gate) * up, w.down, w.down_bias)
        kept = hidden_B_S_E[:, -keep:] if keep else hidden_B_S_E
        return _rms_norm(kept, self.model.model.norm.weight, self.eps)

    def _attention(
        self, q_B_H_S_D: torch.Tensor, k_B_K_T_D: torch.Tensor, v_B_K_T_D: torch.Tensor, mask: torch.Tensor | None, is_causal: bool
    ) -> torch.Tensor:
        B, H, S, D = q_B_H_S_D.shape
        Hkv, T = k_B_K_T_D.shape[1], k_B_K_T_D.shape[2]
        if S == 1 and Hkv != H:
            # One new token: a kv head's group of query heads are that head's queries (pack-GQA), so
            # sdpa reads each key once with no enable_gqa, which would send a masked call to the
            # math kernel on CUDA; the [B, 1, 1, T] mask broadcasts over the group.
            out = F.scaled_dot_product_attention(
                q_B_H_S_D.view(B, Hkv, H // Hkv, D), k_B_K_T_D, v_B_K_T_D, attn_mask=mask, scale=self.scaling
            )
            return out.view(B, H, 1, D)
        if S == 1 or B * H * S * T > SMALL_ATTENTION_SCORES:
            return F.scaled_dot_product_attention(
                q_B_H_S_D, k_B_K_T_D, v_B_K_T_D, attn_mask=mask, is_causal=is_causal, scale=self.scaling, enable_gqa=Hkv != H
            )
        # Short blocks: two batched matmuls instead of the CPU flash kernel (forward alone 0.8x
        # the time on 8 queries over 24 keys, 1.2x on 32 over 48, docs/performance.md); each kv
        # head serves its group of query heads.
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
        if attention_mask_B_K is not None and attention_mask_B_K.dim() == 4:
            return attention_mask_B_K, False
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
