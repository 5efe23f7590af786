"""Tiny random mixture-of-experts models for the router-replay tests (built here, never downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.conftest import build_tiny_tokenizer

MOE_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"head_dim": 16, "num_experts": 8, "moe_intermediate_size": 32}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 8}),
}


def build_tiny_moe(family: str, path: Path | None = None, seed: int = 0, layers: int = 2) -> Any:
    """A random ``family`` model (8 experts, top-2, ``layers`` layers) with the tiny tokenizer; saved to ``path`` when given."""
    import torch
    import transformers

    config_name, model_name, extra = MOE_FAMILIES[family]
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )
    model = getattr(transformers, model_name)(config)
    # Routers start at zero in some families: random ones, so that tokens go to different experts.
    for name, param in model.named_parameters():
        if name.endswith("gate.weight"):
            torch.nn.init.normal_(param, std=0.5)
    if path is not None:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return model.eval()
