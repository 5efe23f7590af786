"""Interleaved A/B, in one process, of the trainer's two layouts for sequences that run whole:
packed end to end (``padding_free=true``) against right-padded rows. One forward and backward
of the trained tokens' logprobs per call, as forward_backward_custom runs it.

    python scripts/ab_padding_free.py MODEL [--rounds 5] [--sequences 16] [--prompt 10,60] [--completion 5,200]
                                            [--layout ab|packed|padded] [--threads 1]

Sequences are random tokens: a prompt and a completion of lengths drawn uniformly from the given
ranges (one seed), every prompt distinct (so the shared-prefix path does not apply). ``ab`` runs
both layouts each round in alternating order and prints the medians and their ratio; ``packed``
or ``padded`` runs one of them only and prints its median and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prompt", default="10,60")
    parser.add_argument("--completion", default="5,200")
    parser.add_argument("--layout", choices=["ab", "packed", "padded"], default="ab")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import tinker
    import torch

    from grpo_core.engine.forward import TransformersForward
    from grpo_core.engine.logprobs import packed_layout, target_logprobs
    from grpo_core.engine.models import load_model

    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, torch.device("cpu"), "auto")
    forward = TransformersForward(model, padding_free=True)
    if forward.packing_problem is not None:
        raise SystemExit(f"this model does not pack: {forward.packing_problem}")
    rng = random.Random(0)
    (p_lo, p_hi), (c_lo, c_hi) = (map(int, r.split(",")) for r in (args.prompt, args.completion))
    datums = []
    for _ in range(args.sequences):
        prompt, completion = rng.randint(p_lo, p_hi), rng.randint(c_lo, c_hi)
        tokens = [rng.randrange(2, model.config.vocab_size) for _ in range(prompt + completion)]
        weights = [0.0] * (prompt - 1) + [1.0] * completion
        targets = {"target_tokens": tokens[1:], "weights": weights}
        datums.append(tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=targets))
    lengths = [len(d.model_input.to_ints()) for d in datums]
    rows = packed_layout(lengths, *forward.layer_costs)
    width = max(sum(lengths[i] for i in row) for row in rows)
    print(f"{len(lengths)} sequences, {sum(lengths)} tokens: padded {len(lengths)} x {max(lengths)}, packed {len(rows)} x {width}")
    if len(rows) == len(lengths):
        raise SystemExit("packing leaves as many rows as sequences here: the trainer pads (nothing to compare)")

    def step(packed: bool) -> float:
        started = time.perf_counter()
        logprobs, _ = target_logprobs(forward, datums, torch.device("cpu"), one_pass=True, packed=packed)
        sum(lp.sum() for lp in logprobs).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    if args.layout != "ab":
        times = [step(args.layout == "packed") for _ in range(args.rounds)]
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{args.layout}: median {statistics.median(times):.3f} s, peak RSS {peak:.0f} MB")
        return
    step(True), step(False)  # warm-up
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for packed in (True, False) if r % 2 == 0 else (False, True):
            times[packed].append(step(packed))
    packed, padded = statistics.median(times[True]), statistics.median(times[False])
    print(f"packed {packed:.3f} s, padded {padded:.3f} s (medians of {args.rounds}): packed/padded {packed / padded:.3f}")


if __name__ == "__main__":
    main()
