"""The experts each token is routed to in a transformers mixture-of-experts model: recorded
during a forward, or forced in one (router replay).

A token's routing is, per MoE layer, the ``top_k`` experts its router selected: a
``[tokens, layers, top_k]`` tensor of expert indices, held compactly (uint8 up to 256 experts,
int16 above). Forcing replaces the router's selection only: its logits are still computed from
the live hidden states, and the forced experts' gate weights are the live softmax over them
(normalized over the forced experts where the router normalizes its top-k), so the router keeps
its gradient. Forcing a forward's own selections reproduces it exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import torch

from grpo_core.routes import EXPERT_COUNT_FIELDS


@attrs.frozen
class RouterRule:
    """How a router class turns its logits into the gate weights of the experts it selected."""

    normalizes: str | None
    """The router's attribute that says whether it renormalizes its top-k weights to sum to 1
    (None: it always does)."""
    weights_in_logits_dtype: bool
    """The weights are cast back to the logits' dtype (else they stay float32)."""


ROUTER_RULES = {
    "Qwen3MoeTopKRouter": RouterRule(normalizes="norm_topk_prob", weights_in_logits_dtype=True),
    "MixtralTopKRouter": RouterRule(normalizes=None, weights_in_logits_dtype=False),
}
"""The routers whose selection can be recorded and forced, by class name (transformers 5.x:
``forward(hidden) -> (logits, top-k weights, top-k indices)``)."""


def routers(model: Any) -> list[Any]:
    """The model's routers that :data:`ROUTER_RULES` knows, in layer order."""
    return [m for m in model.modules() if type(m).__name__ in ROUTER_RULES]


def routing_problem(model: Any) -> str | None:
    """Why the experts ``model`` routes its tokens to cannot be recorded and forced, or None."""
    if routers(model):
        return None
    config = model.config.get_text_config()
    if any(getattr(config, name, None) for name in EXPERT_COUNT_FIELDS):
        known = ", ".join(sorted(ROUTER_RULES))
        return f"model type '{config.model_type}' routes with a router grpo-core does not know (it replays {known})"
    return f"model type '{config.model_type}' has no mixture-of-experts layers"


def num_experts(model: Any) -> int:
    """How many experts each MoE layer of ``model`` has."""
    config = model.config.get_text_config()
    return next(getattr(config, name) for name in EXPERT_COUNT_FIELDS if getattr(config, name, None))


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest dtype that holds every expert index."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def gate_weights(router: Any, logits_N_E: torch.Tensor, experts_N_K: torch.Tensor) -> torch.Tensor:
    """The gate weights ``router`` gives ``experts_N_K`` from its live logits, as its own forward
    computes them for the experts it selects (differentiable in the logits)."""
    rule = ROUTER_RULES[type(router).__name__]
    weights_N_K = torch.softmax(logits_N_E.float(), dim=-1).gather(-1, experts_N_K)
    if rule.normalizes is None or getattr(router, rule.normalizes):
        weights_N_K = weights_N_K / weights_N_K.sum(dim=-1, keepdim=True)
    return weights_N_K.to(logits_N_E.dtype) if rule.weights_in_logits_dtype else weights_N_K


@attrs.define(eq=False)
class RoutingTap:
    """The routing of the forwards run while it is attached (see :func:`tapped`).

    Each router writes its layer's selection of the forward it runs in: ``take()`` gives the last
    forward's, ``[positions, layers, top_k]`` in the order of the forward's flattened positions
    (batch-major). Set ``forced`` (same shape and order) before a forward to make its routers use
    those experts; ``take_live()`` then still gives what they would have chosen.
    """

    layers: dict[int, int]
    """id(router) -> its layer's index."""
    num_experts: int
    top_k: int
    forced: torch.Tensor | None = None
    used: list[torch.Tensor | None] = attrs.field(factory=list)
    live: list[torch.Tensor | None] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        self.used = [None] * len(self.layers)
        self.live = [None] * len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return route_dtype(self.num_experts)

    @property
    def used_shape(self) -> tuple[int, int]:
        """One position's routing: ``(layers, top_k)``."""
        return (len(self.layers), self.top_k)

    def take(self) -> torch.Tensor:
        """The experts the last forward used, ``[positions, layers, top_k]``, on the CPU."""
        return self._take(self.used)

    def take_live(self) -> torch.Tensor:
        """The experts the last forward's routers chose themselves (the same as ``take()`` unless forced)."""
        return self._take(self.live)

    def _take(self, per_layer: list[torch.Tensor | None]) -> torch.Tensor:
        missing = [layer for layer, t in enumerate(per_layer) if t is None]
        if missing:
            raise RuntimeError(f"no forward routed through MoE layers {missing} since the tap was attached")
        # One copy off the device for every layer (a sampler takes this at each decoded token).
        return torch.stack([t.to(self.dtype) for t in per_layer], dim=1).cpu()

    def hook(self, router: Any, args: Any, output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Any:
        logits_N_E, weights_N_K, experts_N_K = output
        layer = self.layers[id(router)]
        self.live[layer] = experts_N_K.detach()
        if self.forced is None:
            self.used[layer] = experts_N_K.detach()
            return None
        forced_N_K = self.forced[:, layer]
        if forced_N_K.shape != experts_N_K.shape:
            raise ValueError(
                f"forced routing of MoE layer {layer} is {tuple(forced_N_K.shape)}, the forward routes {tuple(experts_N_K.shape)}"
            )
        forced_N_K = forced_N_K.to(experts_N_K.device, torch.long)
        self.used[layer] = forced_N_K
        return logits_N_E, gate_weights(router, logits_N_E, forced_N_K), forced_N_K


@contextmanager
def tapped(model: Any) -> Iterator[RoutingTap]:
    """A :class:`RoutingTap` on ``model``'s routers while the block runs (and a backward in it,
    which recomputes checkpointed layers with the same forcing)."""
    found = routers(model)
    if not found:
        raise ValueError(routing_problem(model))
    experts = num_experts(model)
    if experts > torch.iinfo(torch.int16).max:
        raise ValueError(f"{experts} experts do not fit the int16 routes are held in")
    tap = RoutingTap(layers={id(r): i for i, r in enumerate(found)}, num_experts=experts, top_k=found[0].top_k)
    handles = [r.register_forward_hook(tap.hook) for r in found]
    try:
        yield tap
    finally:
        for handle in handles:
            handle.remove()


def load_max_over_mean(routes_N_L_K: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per layer: the busiest expert's share of the selections over the mean share, ``[L]``
    (1 = every expert equally busy; ``num_experts / top_k`` = every token on the same experts)."""
    N, L, K = routes_N_L_K.shape
    counts_L_E = torch.zeros(L, num_experts)
    counts_L_E.scatter_add_(1, routes_N_L_K.long().permute(1, 0, 2).reshape(L, N * K), torch.ones(L, N * K))
    return counts_L_E.max(dim=-1).values / (N * K / num_experts)
