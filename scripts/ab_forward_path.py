"""Interleaved A/B, in one process, of the local backend's two forwards: the fused decoder
(``fast_forward=true``) against transformers' own, for training (forward + backward of one
step's batch) and for sampling.

    python scripts/ab_forward_path.py MODEL [--rounds 5] [--prompts 2] [--group 4] [--tokens 32] [--dtype float32]

MODEL is a folder (e.g. from scripts/build_shape_model.py) or ``default``. Each round runs every
contender once, in alternating order, so machine noise hits both alike; the medians and their
ratio are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    import torch

    from grpo_core import Sample, SamplingParams
    from grpo_core.backend import sample_to_datum
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
    prompts = [tok(f"Question: Tom has {i + 3} apples and buys {i + 5} more. How many?\nAnswer:")["input_ids"] for i in range(args.prompts)]
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0, stop_token_ids=[])
    groups = sampler.sample(prompts, args.group, params)
    samples = [
        Sample(prompt=None, tokens=p + c.tokens, sampling_logprobs=[0.0] * len(p) + c.logprobs,
               loss_mask=[0.0] * len(p) + [1.0] * len(c.tokens), text="", finish_reason=c.finish_reason, policy_version=0)
        for p, g in zip(prompts, groups) for c in g
    ]  # fmt: skip
    datums = [sample_to_datum(s) for s in samples]

    def loss_fn(_datums, logprobs):
        return -sum(lp.sum() for lp in logprobs) / len(logprobs), {}

    times: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.rounds):
        order = list(contenders.items())
        for name, (trainer, sampler) in order if round_index % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            trainer.forward_backward_custom(datums, loss_fn)
            times.setdefault(("train", name), []).append(time.perf_counter() - started)
            trainer.model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            with torch.no_grad():
                sampler.sample(prompts, args.group, params)
            times.setdefault(("sample", name), []).append(time.perf_counter() - started)
    print(f"model {args.model}, {args.dtype}, {len(datums)} sequences, {args.tokens} tokens, {torch.get_num_threads()} threads")
    for phase in ("train", "sample"):
        fused, plain = (statistics.median(times[(phase, n)]) for n in ("fused", "transformers"))
        print(f"{phase:6s} fused {fused:7.3f} s  transformers {plain:7.3f} s  transformers/fused {plain / fused:5.2f}")


if __name__ == "__main__":
    main()
