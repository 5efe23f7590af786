"""Prototypes of the speed-ups suggested in docs/performance.md, measured against grpo-core as it is.

    python benchmarks/proto_speedups.py [--config overhead|compute] [--repeats 5] [--threads 1]

Nothing in grpo-core is changed; each variant is timed interleaved with the current code on the
benchmark's model (8 prompts x G=8, 16-token prompts, forced completion length):

- training: grpo-core's ``LocalTrainer.forward_backward_custom`` against a shared-prefix forward
  (each group's prompt run once with ``use_cache=True`` and gradients on, its KV cache repeated G
  times, then the completions on top of it), after checking that both give the same logprobs
  and gradients;
- sampling: grpo-core's ``LocalSampler.sample`` against the same loop under
  ``torch.inference_mode`` with inverse-CDF draws (one uniform per row instead of
  ``torch.multinomial``'s exponential per vocabulary entry), and against that plus prefilling
  each prompt once and repeating its KV cache G times.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_common import CACHE, CONFIGS, build_model


def timeit(variants: dict[str, Any], repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in variants}
    for f in variants.values():
        f()  # warmup
    for _ in range(repeats):
        for name, f in variants.items():
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    return times


def report(title: str, times: dict[str, list[float]]) -> None:
    print(title)
    base = sorted(next(iter(times.values())))[len(next(iter(times.values()))) // 2]
    for name, v in times.items():
        med = sorted(v)[len(v) // 2]
        print(f"  {name:<48} min {min(v) * 1e3:8.1f} ms  median {med * 1e3:8.1f} ms  ({med / base:.2f}x of current)")


def inverse_cdf_draw(self: Any, logits_A_V: Any, params: Any) -> tuple[Any, Any]:
    """Temperature only (the benchmark's setting): one uniform per row, searchsorted in the CDF."""
    import torch

    logprobs_A_V = (logits_A_V / params.temperature).log_softmax(-1)
    cdf_A_V = logprobs_A_V.exp().cumsum(-1)
    u_A1 = torch.rand(cdf_A_V.shape[0], 1, generator=self.generator, device=cdf_A_V.device) * cdf_A_V[:, -1:]
    token_A = torch.searchsorted(cdf_A_V, u_A1).squeeze(-1).clamp_(max=cdf_A_V.shape[-1] - 1)
    return token_A, logprobs_A_V.gather(-1, token_A.unsqueeze(-1)).squeeze(-1)


def shared_prefill_generate(sampler: Any, prompts: list[list[int]], G: int, params: Any) -> list[Any]:
    """The sampler's loop with each prompt prefilled once (no stop handling: lengths are forced here)."""
    import torch
    from grpo_core.types import Completion
    from transformers import DynamicCache

    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, P, dtype=torch.long)
    att = torch.zeros(B, P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p)
        att[i, P - len(p) :] = 1
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    with torch.inference_mode():
        out = sampler.model(input_ids=ids, attention_mask=att, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1, :].float().repeat_interleave(G, 0)
        cache.batch_repeat_interleave(G)
        attention, position_ids = att.repeat_interleave(G, 0), pos.repeat_interleave(G, 0)
        tokens, logprobs = [], []
        for step in range(params.max_tokens):
            token_A, logprob_A = inverse_cdf_draw(sampler, logits, params)
            tokens.append(token_A)
            logprobs.append(logprob_A)
            if step == params.max_tokens - 1:
                break
            attention = torch.cat([attention, attention.new_ones(B * G, 1)], dim=1)
            position_ids = position_ids[:, -1:] + 1
            out = sampler.model(
                input_ids=token_A.unsqueeze(-1), attention_mask=attention, position_ids=position_ids, past_key_values=cache, use_cache=True, logits_to_keep=1
            )
            logits = out.logits[:, -1, :].float()
    toks, lps = torch.stack(tokens, 1).tolist(), torch.stack(logprobs, 1).tolist()
    return [Completion(tokens=t, logprobs=lp, finish_reason="length") for t, lp in zip(toks, lps)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=["overhead", "compute"], default="compute")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch
    from grpo_core.backend import sample_to_datum
    from grpo_core.plugins.backends import local
    from grpo_core.types import Prompt, Sample, SamplingParams
    from transformers import DynamicCache

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    cfg = CONFIGS[args.config]
    P, L, G, NP = cfg["prompt_tokens"], cfg["completion_tokens"], cfg["group_size"], cfg["prompts_per_step"]
    model_dir = build_model(CACHE / "models" / args.config, args.config)
    model, tokenizer = local.load_model(str(model_dir), torch.device("cpu"), "sdpa")
    trainer = local.LocalTrainer(model=model, tokenizer=tokenizer, device=torch.device("cpu"), autocast_dtype=None)
    gen = torch.Generator().manual_seed(0)
    prompts_NP_P = torch.randint(1, 500, (NP, P), generator=gen)
    comps_B_L = torch.randint(1, 500, (NP * G, L), generator=gen)
    seqs_B_T = torch.cat([prompts_NP_P.repeat_interleave(G, 0), comps_B_L], 1)
    samples = [
        Sample(prompt=Prompt(id="p", text="p"), tokens=s.tolist(), sampling_logprobs=[0.0] * (P + L), loss_mask=[0.0] * P + [1.0] * L, text="", finish_reason="length", policy_version=0)
        for s in seqs_B_T
    ]
    datums = [sample_to_datum(s) for s in samples]

    def current_logprobs() -> torch.Tensor:
        return torch.stack(local.target_logprobs(model, datums, torch.device("cpu"), None))[:, P - 1 :]

    def shared_logprobs() -> torch.Tensor:
        cache = DynamicCache()
        first = model(input_ids=prompts_NP_P, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        cache.batch_repeat_interleave(G)
        pos = torch.arange(P, P + L - 1).expand(NP * G, -1)
        rest = model(input_ids=comps_B_L[:, :-1], past_key_values=cache, position_ids=pos, use_cache=True).logits
        logits = torch.cat([first.repeat_interleave(G, 0).unsqueeze(1), rest], 1)
        return torch.gather(logits.float().log_softmax(-1), -1, comps_B_L.unsqueeze(-1)).squeeze(-1)

    params_list = list(model.parameters())
    a, b = current_logprobs(), shared_logprobs()
    grads_a = torch.autograd.grad(a.sum(), params_list)
    grads_b = torch.autograd.grad(b.sum(), params_list)
    max_lp = float((a - b).detach().abs().max())
    max_grad = max(float((x - y).abs().max() / (x.abs().max() + 1e-12)) for x, y in zip(grads_a, grads_b))
    print(f"{args.config}: shared-prefix logprobs differ by at most {max_lp:.1e}, gradients by {max_grad:.1e} (relative)")

    adv_B_1 = torch.randn(NP * G, 1)

    def surrogate(lp: torch.Tensor) -> torch.Tensor:
        ratio = torch.exp(lp - lp.detach())
        return -torch.minimum(ratio * adv_B_1, ratio.clamp(0.8, 1.2) * adv_B_1).sum(-1).mean()

    def train_current() -> None:
        def loss_fn(_d: Any, lps: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
            return surrogate(torch.stack(lps)[:, P - 1 :]), {}

        trainer.forward_backward_custom(datums, loss_fn)
        model.zero_grad(set_to_none=True)

    def train_shared() -> None:
        surrogate(shared_logprobs()).backward()
        model.zero_grad(set_to_none=True)

    report(f"training forward+backward, {NP * G} sequences of {P}+{L} tokens:", timeit({"current (forward_backward_custom)": train_current, "shared prefix": train_shared}, args.repeats))

    sampler = local.LocalSampler(model=model, tokenizer=tokenizer, device=torch.device("cpu"), autocast_dtype=None, seed=0)
    prompt_lists = prompts_NP_P.tolist()
    params = SamplingParams(max_tokens=L, temperature=1.0, top_p=1.0, top_k=0, stop=[])
    original_draw = local.LocalSampler._draw

    def sample_current() -> None:
        sampler.sample(prompt_lists, G, params)

    def sample_fast_draw() -> None:
        local.LocalSampler._draw = inverse_cdf_draw
        try:
            with torch.inference_mode():
                sampler.sample(prompt_lists, G, params)
        finally:
            local.LocalSampler._draw = original_draw

    def sample_shared() -> None:
        shared_prefill_generate(sampler, prompt_lists, G, params)

    report(
        f"sampling {NP} prompts x G={G}, {L} tokens:",
        timeit({"current (LocalSampler.sample)": sample_current, "inference_mode + inverse-CDF draw": sample_fast_draw, "+ prefill each prompt once": sample_shared}, args.repeats),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
