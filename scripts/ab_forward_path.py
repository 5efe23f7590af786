"""Interleaved A/B, in one process, of the local sampler's two forwards: the fused decoder
(``fast_forward=true``) against transformers' own. Sampling only: the fused decoder has no
backward, and the trainer runs transformers' forward either way.

    python scripts/ab_forward_path.py MODEL [--rounds 5] [--prompts 2] [--group 4] [--tokens 32] [--dtype float32]

MODEL is a folder (e.g. from scripts/build_shape_model.py) or ``default``. Each round runs every
contender once, in alternating order, so machine noise hits both alike; the medians and their
ratio are printed.
"""

from __future__ import annotations

import statistics

from ab_common import interleaved_times, parse_arguments, prompt_ids


def main() -> None:
    args = parse_arguments(__doc__)

    import torch

    from grpo_core import SamplingParams
    from grpo_core.config import RunConfig
    from grpo_core.plugins.backends.local import LocalBackend
    from grpo_core.plugins.samplers.local import LocalSamplerPlugin

    config = RunConfig(model=args.model, dtype=args.dtype)
    contenders = {}
    for fast in (True, False):
        trainer = LocalBackend(fast_forward=fast).make_trainer(config=config)
        sampler = LocalSamplerPlugin().make_sampler(config=config, trainer=trainer)
        contenders["fused" if fast else "transformers"] = (trainer, sampler)
    trainer, sampler = contenders["fused"]
    tok = trainer.tokenizer
    prompts = prompt_ids(tok, args.prompts)
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, stop_token_ids=[])
    for _, warm_up in contenders.values():
        warm_up.sample(prompts, args.group, params)

    times = interleaved_times(
        args.rounds,
        [{name: lambda sampler=sampler: sampler.sample(prompts, args.group, params) for name, (_, sampler) in contenders.items()}],
    )
    sequences = len(prompts) * args.group
    print(f"model {args.model}, {args.dtype}, {sequences} sequences, {args.tokens} tokens, {torch.get_num_threads()} threads")
    fused, plain = (statistics.median(times[n]) for n in ("fused", "transformers"))
    print(f"sample fused {fused:7.3f} s  transformers {plain:7.3f} s  transformers/fused {plain / fused:5.2f}")


if __name__ == "__main__":
    main()
