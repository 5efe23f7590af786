"""Interleaved A/B, in one process, of what the local backend does to keep a CPU step's peak
memory down: the KL reference offloaded (mapped from a file for each forward) against one
held in memory, and glibc's mmap threshold fixed at 1 MiB against 32 MiB (where its dynamic
threshold ends up) for the trainer's forward, backward and optimizer step.

    python scripts/ab_host_memory.py MODEL [--rounds 5] [--prompts 2] [--group 4] [--tokens 32] [--dtype float32]

MODEL is a folder (e.g. from scripts/build_shape_model.py). Each round runs both sides of each
comparison once, in alternating order, so machine noise hits both alike; the medians and their
ratio are printed.
"""

from __future__ import annotations

import statistics

from ab_common import interleaved_times, parse_arguments, prompt_ids


def main() -> None:
    args = parse_arguments(__doc__)

    import tinker
    import torch

    from grpo_core import Sample
    from grpo_core.backend import sample_to_datum
    from grpo_core.config import RunConfig
    from grpo_core.engine.host_memory import set_mmap_threshold
    from grpo_core.plugins.backends.local import LocalBackend

    config = RunConfig(model=args.model, dtype=args.dtype)
    trainer = LocalBackend().make_trainer(config=config)
    references = {place: LocalBackend(reference=place).make_reference(config=config, trainer=trainer) for place in ("memory", "offload")}
    tok = trainer.tokenizer
    generator = torch.Generator().manual_seed(0)
    datums = []
    for prompt in prompt_ids(tok, args.prompts):
        for _ in range(args.group):
            completion = torch.randint(0, len(tok), (args.tokens,), generator=generator).tolist()
            sample = Sample(
                prompt=None,
                tokens=prompt + completion,
                sampling_logprobs=[0.0] * (len(prompt) + args.tokens),
                loss_mask=[0.0] * len(prompt) + [1.0] * args.tokens,
                text="",
                finish_reason="length",
                policy_version=0,
            )
            datums.append(sample_to_datum(sample))

    def train() -> None:
        trainer.forward_backward_custom(datums, lambda d, lps: (-sum(lp.mean() for lp in lps) * 1e-3, {}))
        trainer.optim_step(tinker.AdamParams(learning_rate=1e-6))

    thresholds = {"1MiB": 1 << 20, "32MiB": 32 << 20}
    train()  # the optimizer's state exists from here on, as in every step after the first

    def train_with_mmap_threshold(threshold: int) -> None:
        set_mmap_threshold(threshold)
        train()

    times = interleaved_times(
        args.rounds,
        [
            {f"reference {place}": lambda place=place: references[place].forward(datums) for place in ("offload", "memory")},
            {f"train, mmap threshold {name}": lambda t=t: train_with_mmap_threshold(t) for name, t in thresholds.items()},
        ],
    )
    threads = torch.get_num_threads()
    print(f"model {args.model}, {args.dtype}, {len(datums)} sequences, {args.tokens} tokens, {threads} threads, {args.rounds} rounds")
    for a, b in (("reference offload", "reference memory"), ("train, mmap threshold 1MiB", "train, mmap threshold 32MiB")):
        ma, mb = statistics.median(times[a]), statistics.median(times[b])
        ratios = sorted(x / y for x, y in zip(times[a], times[b]))
        print(f"{a} {ma:7.3f} s  {b} {mb:7.3f} s  ratio of medians {ma / mb:5.3f}  per-round ratios {' '.join(f'{r:.3f}' for r in ratios)}")


if __name__ == "__main__":
    main()
