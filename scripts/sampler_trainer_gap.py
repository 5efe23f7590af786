"""The local sampler's logprobs against the trainer's, per trainer path, in fp32 (or --dtype).

    python scripts/sampler_trainer_gap.py [MODEL] [--fast-forward true|false] [--group 8] [--tokens 24]

Samples 16 prompts ("what is A plus B?", A, B < 4) × --group completions at temperature 1 with the
local sampler (the fused decoder, or transformers' forward with --fast-forward false), then scores
the sampled tokens with the trainer's forward three ways: the shared-prompt path (the default for a
group), whole rows packed, whole rows padded. Prints the largest and the mean |Δ logprob| of each.
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="default")
    parser.add_argument("--fast-forward", choices=["true", "false"], default="true")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    import tinker
    import torch

    from grpo_core import SamplingParams
    from grpo_core.config import RunConfig
    from grpo_core.engine.logprobs import target_logprobs
    from grpo_core.plugins.backends.local import LocalBackend
    from grpo_core.plugins.samplers.local import LocalSamplerPlugin

    torch.set_num_threads(1)
    config = RunConfig(model=args.model, dtype=args.dtype)
    trainer = LocalBackend(fast_forward=args.fast_forward == "true").make_trainer(config=config)
    sampler = LocalSamplerPlugin().make_sampler(config=config, trainer=trainer)
    prompts = [trainer.tokenizer(f"what is {a} plus {b}?")["input_ids"] for a in range(4) for b in range(4)]
    groups = sampler.sample(prompts, args.group, SamplingParams(max_tokens=args.tokens, temperature=1.0))
    datums, sampled = [], []
    for prompt, group in zip(prompts, groups):
        for completion in group:
            tokens = prompt + completion.tokens
            weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion.tokens)
            targets = {"target_tokens": tokens[1:], "weights": weights}
            datums.append(tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=targets))
            sampled.append((len(prompt) - 1, torch.tensor(completion.logprobs)))
    paths = {"shared prompt": {}, "whole rows, packed": {"one_pass": True, "packed": True}, "whole rows, padded": {"one_pass": True}}
    print(f"{sum(len(lp) for _, lp in sampled)} sampled tokens; sampler forward: {type(sampler.forward_fn).__name__}")
    with torch.no_grad():
        for name, how in paths.items():
            logprobs, _ = target_logprobs(trainer.forward_fn, datums, trainer.device, **how)
            gaps = torch.cat([(lp[start:] - want).abs() for lp, (start, want) in zip(logprobs, sampled)])
            print(f"{name}: max {float(gaps.max()):.3g}, mean {float(gaps.mean()):.3g}")


if __name__ == "__main__":
    main()
