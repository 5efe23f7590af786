"""Target-token logprobs (and entropies) of datums through a forward: padded in one pass, packed
end to end, or with a shared prompt prefix run once; a mixture-of-experts model's routing
recorded and forced in that forward; the fused head over the model's output layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import attrs
import tinker
import torch

from grpo_core.backend import IMAGE_INPUT
from grpo_core.engine.forward import TransformersForward
from grpo_core.engine.fused_logprobs import LinearHead, LowRank, linear_logprobs
from grpo_core.engine.moe_routing import RoutingTap
from grpo_core.engine.vision import PlacedImages
from grpo_core.errors import PluginError


def target_logprobs(
    forward: TransformersForward,
    datums: Sequence[tinker.Datum],
    device: torch.device,
    one_pass: bool = False,
    packed: bool = False,
    routing: DatumRouting | None = None,
    entropy: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Logprobs of each datum's target tokens, differentiable when grad is enabled, and with
    ``entropy`` the policy's entropy at each of those positions (:func:`token_logprobs`; else None).

    Targets before a datum's first trained position get 0.0: logits are computed only from
    there on. The untrained prefix (the prompt) is usually shared by a group's G samples: it
    is run once per distinct prefix and its KV cache repeated for the group, gradients flowing
    back through it (unless ``one_pass``, ``routing`` or image prompts: every row whole, in one forward). Rows run
    whole are ``packed`` end to end where that leaves fewer rows than sequences
    (:func:`packed_layout`; only for a forward whose :meth:`TransformersForward._packing_problem`
    found none), else right-padded. With ``routing`` (a mixture-of-experts model) that one forward
    is where its routes are forced and recorded.

    A datum's entropy is 0.0 where its logprobs are: before its first trained position.
    """
    inputs = [d.model_input.to_ints() for d in datums]
    targets = [d.loss_fn_inputs["target_tokens"].data for d in datums]
    starts = [first_trained(d.loss_fn_inputs["weights"].data) for d in datums]
    prefixes = [tuple(x[:s]) for x, s in zip(inputs, starts)]
    images = datum_images(forward.model, datums, inputs, starts)
    distinct = shared_prefixes(prefixes, one_pass or routing is not None or images is not None)
    if distinct is not None:
        return _logprobs_shared_prefix(forward, inputs, targets, starts, prefixes, distinct, device, entropy)
    if packed:
        rows = packed_layout([len(x) for x in inputs], *forward.layer_costs)
        if len(rows) < len(inputs):
            return _logprobs_packed(forward, inputs, targets, starts, rows, device, routing, entropy, images)
    return _logprobs_one_pass(forward, inputs, targets, starts, device, routing, entropy, images)


def datum_images(model: Any, datums: Sequence[tinker.Datum], inputs: list, starts: list[int]) -> PlacedImages | None:
    """The image tensors the datums carry (``loss_fn_inputs["image.*"]``), to place over their
    prompts' image tokens; None where no datum carries any."""
    images = [
        {k.removeprefix(IMAGE_INPUT): v.to_torch() for k, v in d.loss_fn_inputs.items() if k.startswith(IMAGE_INPUT)} or None
        for d in datums
    ]
    if not any(images):
        return None
    return PlacedImages(model, inputs, images, starts)


def carries_images(datums: Sequence[tinker.Datum]) -> bool:
    return any(name.startswith(IMAGE_INPUT) for d in datums for name in d.loss_fn_inputs)


def shared_prefixes(prefixes: Sequence[tuple[int, ...]], whole_rows: bool) -> list[tuple[int, ...]] | None:
    """The distinct untrained prefixes :func:`target_logprobs` runs once each, or None where every
    row runs whole (``whole_rows``: one pass, routing or image prompts, whose prompts of one text and
    different images have the same tokens; or no prefix is shared, or one is empty)."""
    distinct = list(dict.fromkeys(prefixes))
    return distinct if not whole_rows and len(distinct) < len(prefixes) and all(distinct) else None


def tokens_run(datums: Sequence[tinker.Datum], whole_rows: bool) -> int:
    """The tokens :func:`target_logprobs` puts through the model for ``datums`` (padding aside): a
    shared prefix counts once, as it runs once (what perf/mfu and perf/train_tokens_per_s count)."""
    lengths = [d.model_input.length for d in datums]
    starts = [first_trained(d.loss_fn_inputs["weights"].data) for d in datums]
    prefixes = [tuple(d.model_input.to_ints()[:s]) for d, s in zip(datums, starts)]
    distinct = shared_prefixes(prefixes, whole_rows or carries_images(datums))
    if distinct is None:
        return sum(lengths)
    return sum(len(p) for p in distinct) + sum(n - s for n, s in zip(lengths, starts))


@attrs.define(eq=False)
class DatumRouting:
    """The expert routing of the datums of one forward (a mixture-of-experts model): the routes to
    force, per datum, where they carry some (``loss_fn_inputs["routed_experts"]``), and, after the
    forward, those each datum used and those its routers chose themselves.

    A layout that runs the datums in one forward calls :meth:`place` with where each one starts
    among the forward's flattened positions, before the forward."""

    tap: RoutingTap
    forced: list[torch.Tensor] | None
    offsets: list[int] = attrs.field(factory=list)

    @classmethod
    def of(cls, tap: RoutingTap, datums: Sequence[tinker.Datum]) -> DatumRouting:
        carried = ["routed_experts" in d.loss_fn_inputs for d in datums]
        if any(carried) and not all(carried):
            raise ValueError("some datums of one forward carry routed_experts and some do not: all or none are replayed")
        if not any(carried):
            return cls(tap, None)
        forced = [d.loss_fn_inputs["routed_experts"].to_torch() for d in datums]
        for i, (routes, datum) in enumerate(zip(forced, datums)):
            if tuple(routes.shape) != (datum.model_input.length, *tap.used_shape):
                raise ValueError(
                    f"datum {i}: routed_experts is {tuple(routes.shape)}, its input is "
                    f"{datum.model_input.length} tokens through {tap.used_shape[0]} MoE layers of top-{tap.top_k}"
                )
        return cls(tap, forced)

    def place(self, offsets: list[int], positions: int) -> None:
        self.offsets = offsets
        if self.forced is None:
            return
        # Positions no datum holds (padding, a packed row's filler) take any distinct experts.
        filler_N_L_K = torch.arange(self.tap.top_k).expand(positions, *self.tap.used_shape)
        forced_N_L_K = filler_N_L_K.to(self.tap.dtype).clone()
        for offset, routes in zip(offsets, self.forced):
            forced_N_L_K[offset : offset + len(routes)] = routes.to(self.tap.dtype)
        self.tap.forced = forced_N_L_K

    def per_datum(self, routes_N_L_K: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
        return [routes_N_L_K[o : o + n] for o, n in zip(self.offsets, lengths)]


def first_trained(weights: Sequence[float]) -> int:
    return next((t for t, w in enumerate(weights) if w > 0), len(weights))


def pad_rows(rows: Sequence[Sequence[int]], left: bool = False, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids [B, width] and the mask of real tokens, or None when no row is padded (so the
    forward can skip building masks)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        span = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, span] = torch.tensor(r, dtype=torch.long)
        mask[i, span] = 1
    return ids, (None if all(len(r) == width for r in rows) else mask)


def left_padded_positions(mask_B_T: torch.Tensor | None, B: int, T: int) -> torch.Tensor:
    """Position ids that start at 0 on each row's first real token (rows are left-padded)."""
    if mask_B_T is None:
        return torch.arange(T).expand(B, T)
    return (mask_B_T.cumsum(-1) - 1).clamp(min=0)


def token_logprobs(
    forward: TransformersForward, hidden_N_E: torch.Tensor, targets_N: torch.Tensor, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(head(hidden))[target] per position, in float32, and with ``entropy`` the
    policy's entropy −Σ p log p over the vocabulary at each position (no gradient; None without).

    The fused head of :mod:`fused_logprobs`: only one chunk of positions' logits exists at a time,
    in forward and in backward, and nothing of the vocabulary's size is kept for backward.
    """
    return linear_logprobs(_linear_head(forward.model, hidden_N_E), hidden_N_E, targets_N, entropy)


def _linear_head(model: Any, hidden_N_E: torch.Tensor) -> LinearHead:
    """The model's output layer as a linear map of ``hidden_N_E`` (its LoRA adapter's term
    included): what :meth:`TransformersForward.head` and peft compute, taken apart for the fused head."""
    layer = model.get_output_embeddings()
    low_rank = None
    if hasattr(layer, "lora_A"):
        adapters = [a for a in layer.active_adapters if a in layer.lora_A]
        if layer.merged and layer.disable_adapters:
            raise PluginError("the output layer's LoRA adapter is merged into it and disabled: unmerge it before scoring")
        if adapters and not layer.merged and not layer.disable_adapters:
            if len(adapters) > 1 or adapters[0] in layer.lora_variant or layer.fan_in_fan_out:
                raise PluginError(f"the output layer's LoRA adapters {adapters} are not one plain LoRA adapter")
            (name,) = adapters
            down, up = layer.lora_A[name], layer.lora_B[name]
            if not isinstance(layer.lora_dropout[name], torch.nn.Identity) or up.bias is not None:
                raise PluginError("the output layer's LoRA adapter has dropout or a bias: grpo-core's adapters have neither")
            low_rank = LowRank(down(hidden_N_E.to(down.weight.dtype)), up.weight, layer.scaling[name])
        layer = layer.get_base_layer()
    if not isinstance(layer, torch.nn.Linear):
        raise PluginError(f"the output layer is a {type(layer).__name__}, not a linear layer: grpo-core's fused logprobs need one")
    return LinearHead(layer.weight, layer.bias, low_rank, getattr(model.config, "final_logit_softcapping", None))


def on_host(
    logprobs: Sequence[torch.Tensor], entropy: Sequence[torch.Tensor] | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Each datum's logprobs (differentiable where they are) and entropies in host memory, in one
    device→host copy for them all: a copy per datum waits on the device once per datum (and a
    backward through them copies each gradient back on its own; here one copy back too)."""
    if not logprobs or logprobs[0].device.type == "cpu":
        return list(logprobs), None if entropy is None else list(entropy)
    return _gathered_on_host(logprobs, entropy)


def _gathered_on_host(
    logprobs: Sequence[torch.Tensor], entropy: Sequence[torch.Tensor] | None
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    lengths = [len(lp) for lp in logprobs]
    rows = [torch.cat(list(logprobs))] + ([] if entropy is None else [torch.cat(list(entropy)).detach()])
    host_R_N = torch.stack(rows).cpu()
    return list(host_R_N[0].split(lengths)), None if entropy is None else list(host_R_N[1].split(lengths))


def trained_entropy_sum(datums: Sequence[tinker.Datum], entropy_by_datum: Sequence[torch.Tensor]) -> tuple[float, float]:
    """Σ entropy·weight over the datums' targets, and Σ weight: the mean entropy of their trained
    tokens is the first over the second (summed first, so shares of a batch combine)."""
    total = weight = 0.0
    for datum, entropy_T in zip(datums, entropy_by_datum):
        weights_T = torch.tensor(datum.loss_fn_inputs["weights"].data, dtype=torch.float32)
        total += float((entropy_T.cpu() * weights_T).sum())
        weight += float(weights_T.sum())
    return total, weight


def mean_entropy(total: float, weight: float) -> float:
    """The mean of :func:`trained_entropy_sum` (NaN when no token is trained: a mean of nothing)."""
    return total / weight if weight else math.nan


def _logprobs_at(
    forward: TransformersForward, hidden_B_K_E: torch.Tensor, targets_B_K: torch.Tensor, lengths_B: Sequence[int], entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, K] target logprobs (and entropies), 0.0 past each row's length (padding: never sent through the head)."""
    B, K = targets_B_K.shape
    real_B_K = torch.arange(K) < torch.tensor(lengths_B).unsqueeze(-1)
    real_dev = real_B_K.to(hidden_B_K_E.device)

    def placed(values_N: torch.Tensor) -> torch.Tensor:
        return torch.zeros(B, K, dtype=torch.float32, device=hidden_B_K_E.device).masked_scatter(real_dev, values_N)

    return _map_scores(placed, *token_logprobs(forward, hidden_B_K_E[real_dev], targets_B_K.to(hidden_B_K_E.device)[real_dev], entropy))


def _map_scores(layout: Callable[[torch.Tensor], Any], logprobs: torch.Tensor, entropy: torch.Tensor | None) -> tuple[Any, Any]:
    """``layout`` applied to the logprobs and, where computed, to the entropies: a position's
    entropy lies where its logprob does on every path."""
    return layout(logprobs), None if entropy is None else layout(entropy)


def _logprobs_one_pass(
    forward: TransformersForward,
    inputs: list,
    targets: list,
    starts: list[int],
    device: torch.device,
    routing: DatumRouting | None = None,
    entropy: bool = False,
    images: PlacedImages | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    input_ids_B_T, attention_B_T = pad_rows(inputs)
    targets_B_T, _ = pad_rows(targets)
    B, T = input_ids_B_T.shape
    if routing is not None:
        routing.place([i * T for i in range(B)], B * T)
    start = min(*starts, T - 1)
    # Right padding: real tokens never attend to a pad, so positions need no correction.
    with images.placed([i * T for i in range(B)]) if images is not None else nullcontext():
        hidden_B_K_E = forward.hidden_states(
            input_ids=input_ids_B_T.to(device),
            position_ids=torch.arange(T).expand(B, T).to(device),
            attention_mask=None if attention_B_T is None else attention_B_T.to(device),
            keep=T - start,
        )
    scored_B_K = _logprobs_at(forward, hidden_B_K_E, targets_B_T[:, start:], [max(0, len(x) - start) for x in inputs], entropy)

    def rows(scores_B_K: torch.Tensor) -> list[torch.Tensor]:
        scores_B_T = torch.cat([scores_B_K.new_zeros(B, start), scores_B_K], dim=1)
        # A row whose training starts later than the batch's first gets 0.0 before it, as on every path.
        return [torch.cat([scores_B_T.new_zeros(s), scores_B_T[i, s : len(x)]]) for i, (x, s) in enumerate(zip(inputs, starts))]

    return _map_scores(rows, *scored_B_K)


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Sequences (by index) placed end to end in rows of ``width`` (at least the longest):
    first fit, longest first."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, room in enumerate(free) if room >= lengths[i]), None)
        if row is None:
            rows.append([])
            free.append(width)
            row = len(rows) - 1
        rows[row].append(i)
        free[row] -= lengths[i]
    return rows


def packed_layout(lengths: Sequence[int], token_cost: float, pair_cost: float) -> list[list[int]]:
    """The rows (see :func:`pack_rows`) of least estimated cost, over widths of 1, 2, 4, ... times
    the longest sequence: a row of W positions costs ``W·token_cost + W²·pair_cost`` (attention
    computes every pair of a row, masked or not). Rows as wide as the longest never cost more
    than padding (as many or fewer rows of the same width); wider ones leave less filler and
    more attention, which pays where the layers' weights outweigh attention (0.6B: 2x the longest)."""
    best: tuple[float, list[list[int]]] | None = None
    width = max(lengths)
    while True:
        rows = pack_rows(lengths, width)
        used = max(sum(lengths[i] for i in row) for row in rows)
        cost = len(rows) * used * (token_cost + used * pair_cost)
        if best is None or cost < best[0]:
            best = (cost, rows)
        if len(rows) == 1:
            return best[1]
        width *= 2


def _logprobs_packed(
    forward: TransformersForward,
    inputs: list,
    targets: list,
    starts: list[int],
    rows: list[list[int]],
    device: torch.device,
    routing: DatumRouting | None = None,
    entropy: bool = False,
    images: PlacedImages | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Every sequence whole, packed into ``rows`` with position ids that restart at 0 on each
    sequence and no attention mask: transformers' packed-sequence detection then keeps each
    sequence from attending to the others. A row's unused tail is a filler sequence of its own
    (positions from 0 again), so no row needs a padding mask."""
    width = max(sum(len(inputs[i]) for i in row) for row in rows)
    R = len(rows)
    # The filler's token ids do not matter: no other sequence sees it, and it is never scored.
    ids_R_W = torch.zeros(R, width, dtype=torch.long)
    positions_R_W = torch.zeros(R, width, dtype=torch.long)
    offsets = [0] * len(inputs)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            ids_R_W[r, at : at + len(inputs[i])] = torch.tensor(inputs[i], dtype=torch.long)
            positions_R_W[r, at : at + len(inputs[i])] = torch.arange(len(inputs[i]))
            offsets[i] = r * width + at
            at += len(inputs[i])
        positions_R_W[r, at:] = torch.arange(width - at)
    if routing is not None:
        routing.place(offsets, R * width)
    with images.placed(offsets) if images is not None else nullcontext():
        hidden_R_W_E = forward.hidden_states(input_ids=ids_R_W.to(device), position_ids=positions_R_W.to(device))
    # Only the trained positions go through the head, in the order of the sequences.
    at_N = torch.cat([torch.arange(offsets[i] + s, offsets[i] + len(x)) for i, (x, s) in enumerate(zip(inputs, starts))])
    targets_N = torch.tensor([t for y, s in zip(targets, starts) for t in y[s:]], dtype=torch.long)
    hidden_N_E = hidden_R_W_E.reshape(R * width, -1)[at_N.to(device)]
    scored = [len(x) - s for x, s in zip(inputs, starts)]

    def rows(scores_N: torch.Tensor) -> list[torch.Tensor]:
        return [torch.cat([part.new_zeros(s), part]) for part, s in zip(scores_N.split(scored), starts)]

    return _map_scores(rows, *token_logprobs(forward, hidden_N_E, targets_N.to(device), entropy))


def _logprobs_shared_prefix(
    forward: TransformersForward,
    inputs: list,
    targets: list,
    starts: list[int],
    prefixes: list[tuple],
    distinct: list[tuple],
    device: torch.device,
    entropy: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    prefix_ids_U_P, prefix_mask_U_P = pad_rows(distinct, left=True)
    U, P = prefix_ids_U_P.shape
    cache = forward.new_cache()
    forward.hidden_states(
        input_ids=prefix_ids_U_P.to(device),
        position_ids=left_padded_positions(prefix_mask_U_P, U, P).to(device),
        attention_mask=None if prefix_mask_U_P is None else prefix_mask_U_P.to(device),
        past_key_values=cache,
        keep=1,
    )
    slot = {p: i for i, p in enumerate(distinct)}
    row_to_prefix = torch.tensor([slot[p] for p in prefixes])
    cache.batch_select_indices(row_to_prefix.to(device))
    suffix_ids_B_S, suffix_mask_B_S = pad_rows([x[s:] for x, s in zip(inputs, starts)])
    suffix_targets_B_S, _ = pad_rows([y[s:] for y, s in zip(targets, starts)])
    B, S = suffix_ids_B_S.shape
    if prefix_mask_U_P is None and suffix_mask_B_S is None:
        attention_B_K = None
    else:
        prefix_part = torch.ones(B, P, dtype=torch.long) if prefix_mask_U_P is None else prefix_mask_U_P[row_to_prefix]
        suffix_part = torch.ones(B, S, dtype=torch.long) if suffix_mask_B_S is None else suffix_mask_B_S
        attention_B_K = torch.cat([prefix_part, suffix_part], dim=1).to(device)
    hidden_B_S_E = forward.hidden_states(
        input_ids=suffix_ids_B_S.to(device),
        position_ids=(torch.tensor(starts).unsqueeze(-1) + torch.arange(S)).to(device),
        attention_mask=attention_B_K,
        past_key_values=cache,
    )
    scored_B_S = _logprobs_at(forward, hidden_B_S_E, suffix_targets_B_S, [len(x) - s for x, s in zip(inputs, starts)], entropy)

    def rows(scores_B_S: torch.Tensor) -> list[torch.Tensor]:
        return [torch.cat([scores_B_S.new_zeros(s), scores_B_S[i, : len(x) - s]]) for i, (x, s) in enumerate(zip(inputs, starts))]

    return _map_scores(rows, *scored_B_S)
