"""Mixture-of-experts routes as the core reads them: which config fields count a model's experts
(``--router-replay`` checks them before any model loads), and where two routings of the same
tokens agree (``moe/router_agreement``). Plugins that record and force routes import these."""

from __future__ import annotations

from typing import Any

EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""The config.json fields (of a model or its ``text_config``) that give the experts of each MoE layer."""


def agreement(used_N_L_K: Any, reference_N_L_K: Any) -> Any:
    """Per (position, layer): whether both selected the same set of experts (order aside), ``[N, L]``."""
    a = used_N_L_K.long().sort(dim=-1).values
    b = reference_N_L_K.long().sort(dim=-1).values
    return (a == b).all(dim=-1)
