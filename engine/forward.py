"""The trainer's and the reference's forward: transformers' own model behind one call that gives
hidden states and the output layer apart, with whether packed sequences are isolated (checked on
the model itself), and a float32 forward of a low-precision model without a float32 copy.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from grpo_core.engine.varlen_attention import VARLEN, packed_attention_line, packed_forward
from grpo_core.errors import PluginError


@contextmanager
def computing_in_float32(model: Any) -> Iterator[None]:
    """Run ``model``'s forward in float32 without a float32 copy of it: each module's own
    bfloat16/float16 weights are upcast (exactly) for the length of its call and then put back
    as they were (the same tensors), so at most one module's float32 copy exists at a time."""
    held: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
    upcast_by: dict[int, list[int]] = {}

    def low_precision(p: torch.nn.Parameter | None) -> bool:
        return p is not None and p.dtype in (torch.bfloat16, torch.float16)

    def upcast(module: Any, args: Any) -> tuple:
        mine = upcast_by.setdefault(id(module), [])
        for p in module._parameters.values():
            # A weight two modules share (tied embeddings) is upcast by the first and put back by it.
            if low_precision(p) and id(p) not in held:
                held[id(p)] = (p, p.data)
                p.data = p.data.float()
                mine.append(id(p))
        # Its inputs too: a caller may have cast them to this module's dtype before its call
        # upcast it (peft casts a LoRA layer's input to its adapter's dtype).
        return tuple(a.float() if isinstance(a, torch.Tensor) and low_precision(a) else a for a in args)

    def put_back(module: Any, args: Any, output: Any) -> None:
        for key in upcast_by.pop(id(module), []):
            p, original = held.pop(key)
            p.data = original

    owners = [m for m in model.modules() if any(low_precision(p) for p in m._parameters.values())]
    handles = [h for m in owners for h in (m.register_forward_pre_hook(upcast), m.register_forward_hook(put_back))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for p, original in held.values():  # a forward that raised leaves its modules' weights upcast
            p.data = original
        held.clear()


class TransformersForward:
    """The model's own forward, behind the same call as :class:`FastDecoder`, for the models
    the fast path does not cover.

    Hidden states come from the model's base (``model.base_model``) and logits from its output
    layer, so a caller that wants logprobs never receives logits for every position at once; the
    head's equivalence with the model's own logits is checked once at construction.
    """

    def __init__(self, model: Any, padding_free: bool = False) -> None:
        self.model = model
        # transformers 5.x renames the cache argument (``past_key_values`` is removed in 5.40).
        self.cache_argument = "cache" if "cache" in inspect.signature(model.base_model.forward).parameters else "past_key_values"
        self._check_head()
        self.packing_problem = self._packing_problem() if padding_free else "--backend-opt padding_free=false"
        """Why sequences are not packed (None: they are, :mod:`grpo_core.engine.logprobs`)."""
        text = model.config.get_text_config()
        heads = text.num_attention_heads
        tables = {id(e.weight): e.weight.numel() for e in (model.get_input_embeddings(), model.get_output_embeddings()) if e is not None}
        weights = sum(p.numel() for p in model.parameters()) - sum(tables.values())
        self.layer_costs = (weights / text.num_hidden_layers, 2 * heads * (getattr(text, "head_dim", None) or text.hidden_size // heads))
        """Multiply-adds of one layer per position (its weights) and per attention pair (q·k and the
        weighted v of every head): what :func:`packed_layout` weighs."""

    @property
    def packs(self) -> bool:
        return self.packing_problem is None

    def padding_line(self) -> str:
        """The padding decision and why, in words (for the run's first lines)."""
        if self.packs:
            return f"sequences that run whole are packed, not padded ({packed_attention_line(self.model)})"
        return f"sequences are padded ({self.packing_problem})"

    def new_cache(self, capacity: int | None = None) -> Any:
        from transformers import DynamicCache

        return DynamicCache()

    def layer_weights(self) -> None:
        return None

    def head(self, hidden_N_E: torch.Tensor) -> torch.Tensor:
        logits = self.model.get_output_embeddings()(hidden_N_E)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        keep: int = 0,
        weights: None = None,
    ) -> torch.Tensor:
        with self._sequence_lengths(input_ids, position_ids, attention_mask, past_key_values) as lengths:
            out = self.model.base_model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=past_key_values is not None,
                **{self.cache_argument: past_key_values},
                **lengths,
            )
        hidden_B_S_E = out.last_hidden_state
        return hidden_B_S_E[:, -keep:] if keep else hidden_B_S_E

    def _sequence_lengths(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None, past_key_values: Any
    ) -> AbstractContextManager[dict[str, Any]]:
        """Rows without padding or a cache: varlen attention keeps their sequences apart by the
        lengths their position ids give (no mask built); any other call is sdpa's (no arguments)."""
        if self.model.config._attn_implementation == VARLEN and attention_mask is None and past_key_values is None:
            return packed_forward(position_ids.expand(input_ids.shape))
        return nullcontext({})

    def __call__(self, *args: Any, logits_to_keep: int = 0, **kwargs: Any) -> torch.Tensor:
        return self.head(self.hidden_states(*args, keep=logits_to_keep, **kwargs))

    @torch.no_grad()
    def _packing_problem(self) -> str | None:
        """Why packed sequences would not be scored as they are alone, or None.

        transformers isolates sequences packed in one row by their restarting position ids where
        the model builds its masks with ``create_causal_mask`` and the attention implementation
        follows them; this checks it on the model itself, computing in float32 whatever its dtype
        (:func:`computing_in_float32`): in bfloat16 a whole leak across the row (2 % of the largest
        hidden value on the embedded model) hides under a bound of a few units of rounding. A
        sequence packed after two different ones must come out the same (nothing leaks between
        sequences, to a few float32 units of rounding), and as it does alone (its positions restart).

        Varlen attention has no float32 kernel: it is checked in the model's dtype under the same
        bound, which holds there because it computes each packed sequence from that sequence's
        values alone (the second sequence gets the same bits after either first one); a leak
        changes them.
        """
        device, attention = self.model.device, self.model.config._attn_implementation
        first_a, first_b, second = [3, 1, 4], [2, 7, 1], [5, 9, 2, 6]
        positions_1_7 = torch.tensor([[0, 1, 2, 0, 1, 2, 3]], device=device)
        with nullcontext() if attention == VARLEN else computing_in_float32(self.model):
            after_a, after_b = (
                self.hidden_states(torch.tensor([first + second], device=device), positions_1_7)[0, 3:].float()
                for first in (first_a, first_b)
            )
            alone = self.hidden_states(torch.tensor([second], device=device), positions_1_7[:, 3:])[0].float()
        scale = float(alone.abs().max())
        if not torch.allclose(after_a, after_b, rtol=0, atol=16 * torch.finfo(torch.float32).eps * scale):
            return f"{attention} attention lets sequences packed in one row see each other in this {self.model.config.model_type} model"
        # The model's own dtype here: an attention kernel without float32 (flash attention) runs
        # the packed row and the lone sequence in it, by different kernels.
        if not torch.allclose(after_a, alone, rtol=0, atol=max(1e-4, 64 * torch.finfo(self.model.dtype).eps) * scale):
            return f"this {self.model.config.model_type} model does not restart positions with the position ids of packed sequences"
        return None

    @torch.no_grad()
    def _check_head(self) -> None:
        ids_1_T = torch.tensor([[0, 1, 2]], device=self.model.device)
        positions_1_T = torch.arange(3, device=self.model.device).unsqueeze(0)
        # The model's own call through the same attention kernel as ours.
        with self._sequence_lengths(ids_1_T, positions_1_T, None, None) as lengths:
            own = self.model(input_ids=ids_1_T, position_ids=positions_1_T, **lengths).logits.float()
        ours = self(ids_1_T, positions_1_T).float()
        if not torch.allclose(own, ours, rtol=1e-3, atol=1e-3):
            raise PluginError(
                f"model type '{self.model.config.model_type}' computes its logits in a way grpo-core does not know "
                "(not the output layer over the base model's hidden states, with optional softcapping)"
            )


TRAINER_FORWARD = "transformers (faster than the fused decoder with gradients, docs/performance.md)"
"""The trainer's and the reference's forward, and why (for the run's first lines)."""
