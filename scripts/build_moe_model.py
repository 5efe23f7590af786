"""Build a tiny Qwen3-MoE on the embedded default task, for router-replay measurements (docs/moe.md).

    python scripts/build_moe_model.py [--out /tmp/tiny-qwen3-moe] [--steps 300] [--seed 0]

Nothing is downloaded: the tokenizer is the embedded default model's (core/assets/default), the
weights start random, and the model is trained briefly (next-token loss on the default task's
"Question: ...\\nAnswer: ..." rows, plus transformers' load-balancing loss) so that its routers
route by content rather than as random projections do: a few minutes on one CPU thread. The
folder it writes is a plain transformers model that ``grpo-core run --model FOLDER`` takes.

It prints the final loss and, per MoE layer, the busiest expert's share of the selections over
the mean share on held-out rows (1 = even), so a build whose routing collapsed shows it.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

from grpo_core.embedded import ASSETS
from grpo_core.engine.moe_routing import load_max_over_mean, tapped


def rows(split: str) -> list[str]:
    lines = (ASSETS / "task" / f"{split}.jsonl").read_text().splitlines()
    return [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in map(json.loads, lines)]


def batch(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    encoded = tokenizer([t + tokenizer.eos_token for t in texts], return_tensors="pt", padding=True)
    labels = encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)
    return encoded["input_ids"], labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/tiny-qwen3-moe")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(ASSETS)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen3MoeForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    train = rows("train")
    started = time.time()
    model.train()
    for step in range(args.steps):
        input_ids, labels = batch(tokenizer, random.sample(train, 32))
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f} ({time.time() - started:.0f} s)")
    model.eval()
    model.config.output_router_logits = False
    input_ids, _ = batch(tokenizer, rows("test")[:64])
    with torch.no_grad(), tapped(model) as tap:
        model(input_ids=input_ids)
        routes = tap.take()
    balance = load_max_over_mean(routes, config.num_experts)
    print("busiest expert over the mean, per layer:", [round(float(b), 2) for b in balance])
    out = Path(args.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
