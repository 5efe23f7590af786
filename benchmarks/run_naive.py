"""Benchmark worker: the same GRPO step in plain PyTorch + transformers, no framework.

``python run_naive.py SPEC.json RESULT.json [--bf16]``. Per step: ``model.generate`` (KV cache,
temperature 1, no top-k/top-p) for every prompt G times in one batch, decode, reward,
group-normalized advantages, one forward over prompt+completion keeping only the completion
logits, the clipped GRPO surrogate (on-policy: ratio = exp(logp - logp.detach())), backward,
gradient clipping at 1.0, AdamW. What a person would write by hand: the floor a framework adds
its overhead to. ``--bf16``: generate and the training forward under bf16 autocast, the weights
and AdamW state in fp32 (what TRL's ``bf16=True`` does).
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import current_rss_mb, load_spec, peak_rss_mb, reward_of_text, write_result


def main(spec_path: str, result_path: str, *flags: str) -> None:
    import torch
    import transformers

    unknown = set(flags) - {"--bf16"}
    if unknown:
        raise SystemExit(f"run_naive.py: unknown flags {sorted(unknown)}")
    info: dict = {}
    steps = naive_loop(load_spec(spec_path), info=info, bf16="--bf16" in flags)
    write_result(
        result_path,
        {
            "contender": "naive",
            "flags": list(flags),
            "rss_start_mb": info.get("rss_start_mb"),
            "steps": steps,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "split": {
                "sample": "tokenize + model.generate",
                "reward": "decode + rewards + advantages",
                "train": "forward/backward + clip + AdamW",
            },
        },
    )


def naive_loop(spec: dict, on_step=None, info: dict | None = None, bf16: bool = False) -> list[dict]:
    """Run warmup + spec["steps"] steps; ``on_step(step)`` is called after each (step 1 = warmup).

    ``bf16``: the model runs under CPU bf16 autocast (weights and optimizer state stay fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    model.eval()  # no dropout, as in grpo-core (Qwen3 has none anyway)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["learning_rate"], weight_decay=0.0)
    P, L, G, B = spec["prompt_tokens"], spec["completion_tokens"], spec["group_size"], spec["prompts_per_step"]
    prompts = spec["prompts"]
    eps = 0.2
    precision = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else nullcontext
    if info is not None:
        info["rss_start_mb"] = current_rss_mb()
    steps = []
    prev, prev_cpu = time.perf_counter(), time.process_time()
    for step in range(spec["steps"] + 1):
        batch = prompts[step * B : (step + 1) * B]
        t0 = time.perf_counter()
        input_ids = torch.tensor([tokenizer(p)["input_ids"] for p in batch]).repeat_interleave(G, dim=0)
        with torch.no_grad(), precision():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=L,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        completion = out[:, P:]
        t1 = time.perf_counter()
        texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
        rewards = torch.tensor([reward_of_text(t) for t in texts]).view(B, G)
        advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-8)).view(-1, 1)
        t2 = time.perf_counter()
        with precision():
            logits = model(input_ids=out[:, :-1], logits_to_keep=L, use_cache=False).logits
        logprobs = torch.gather(logits.float().log_softmax(-1), -1, completion.unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logprobs - logprobs.detach())
        surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - eps, 1 + eps) * advantages)
        loss = -surrogate.sum(-1).mean()  # grpo-core's default aggregation: token sum, sequence mean
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3, cpu = time.perf_counter(), time.process_time()
        steps.append(
            {
                "period": t3 - prev,
                "cpu": cpu - prev_cpu,
                "sample": t1 - t0,
                "reward": t2 - t1,
                "train": t3 - t2,
                "completion_lengths": [int(completion.shape[1])] * completion.shape[0],
                "peak_rss_mb": peak_rss_mb(),
            }
        )
        prev, prev_cpu = t3, cpu
        if on_step is not None:
            on_step(step + 1)
    return steps


if __name__ == "__main__":
    main(*sys.argv[1:])
