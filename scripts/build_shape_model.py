"""Build a random-weight Qwen3 with a real model's shape, for memory and speed measurements.

    python scripts/build_shape_model.py OUT [--shape qwen3-0.6b|default] [--layers 28] [--vocab embedded|qwen]
                                            [--dtype float32|bfloat16] [--seed 0]

``--shape qwen3-0.6b`` (the default) is Qwen3-0.6B's (hidden 1024, 16 query / 8 key-value heads
of 128, MLP 3072, tied embeddings; 28 layers); ``--shape default`` is the embedded model's
(hidden 128, 4 / 2 heads of 32, MLP 384); ``--layers`` sets the depth. The tokenizer is the embedded default
model's, so the folder runs with the default task; ``--vocab qwen`` gives the model Qwen's
151,936-row vocabulary anyway (the tokenizer's ids are the first rows), so that logits cost
what they cost on the real model. Weights are drawn from one seed and stored in ``--dtype``
(bfloat16 is how real checkpoints ship: a bf16 run then loads without a float32 file to read).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

QWEN_VOCAB = 151_936
SHAPES = {
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128},
    "default": {"hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
}


def build(out: Path, shape: str, layers: int, vocab: str, seed: int, dtype: str = "float32") -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from grpo_core.embedded import ASSETS

    tokenizer = AutoTokenizer.from_pretrained(ASSETS)
    config = Qwen3Config(
        vocab_size=QWEN_VOCAB if vocab == "qwen" else len(tokenizer),
        **SHAPES[shape],
        num_hidden_layers=layers,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    torch.set_default_dtype(getattr(torch, dtype))
    Qwen3ForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    shutil.copy2(ASSETS / "generation_config.json", out / "generation_config.json")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--vocab", choices=["embedded", "qwen"], default="embedded")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build(args.out, args.shape, args.layers, args.vocab, args.seed, args.dtype))


if __name__ == "__main__":
    main()
