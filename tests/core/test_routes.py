"""Mixture-of-experts routes as the core reads them (core/routes.py)."""

from __future__ import annotations

import torch

from grpo_core.routes import EXPERT_COUNT_FIELDS, agreement


def test_agreement_compares_sets_of_experts_per_layer():
    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    b = torch.tensor([[[1, 0], [2, 4]], [[4, 5], [7, 6]]])
    assert agreement(a, b).tolist() == [[True, False], [True, True]]


def test_agreement_of_uint8_and_int16_routes_and_of_no_tokens():
    # The sampler keeps uint8 routes, the trainer may return int16: the sets are compared, not the dtypes.
    used = torch.tensor([[[3, 1]]], dtype=torch.uint8)
    assert agreement(used, torch.tensor([[[1, 3]]], dtype=torch.int16)).tolist() == [[True]]
    assert agreement(torch.zeros(0, 2, 2, dtype=torch.uint8), torch.zeros(0, 2, 2, dtype=torch.uint8)).shape == (0, 2)


def test_expert_count_fields_name_the_families_replayed():
    # Qwen3-MoE (num_experts), Mixtral (num_local_experts), DeepSeek (n_routed_experts).
    assert {"num_experts", "num_local_experts", "n_routed_experts"} <= set(EXPERT_COUNT_FIELDS)
