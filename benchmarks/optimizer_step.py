"""The bf16 optimizer step (StochasticRoundingAdamW, its eager and its compiled kernel:
``--backend-opt optimizer_kernel``) against torch's fused float32 AdamW on the same parameter list:
Qwen3-0.6B's shapes (28 layers, hidden 1024, 151,936-row tied embedding), or fewer layers and a
shorter vocabulary on a CPU. Prints each step's median time and its ratio to float32's.

    python benchmarks/optimizer_step.py                      # CPU: 2 layers, 18,992 rows, 1 thread
    python benchmarks/optimizer_step.py --device cuda --layers 28 --vocab 151936
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from grpo_core.engine.optim import StochasticRoundingAdamW, make_optimizer

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 1024, 3072, 16, 8, 128


def qwen3_shapes(layers: int, vocab: int) -> list[tuple[int, ...]]:
    """Qwen3-0.6B's trained tensors (the output layer is the embedding, tied)."""
    layer = [
        (HEADS * HEAD_DIM, HIDDEN),
        (KV_HEADS * HEAD_DIM, HIDDEN),
        (KV_HEADS * HEAD_DIM, HIDDEN),
        (HIDDEN, HEADS * HEAD_DIM),
        (HEAD_DIM,),
        (HEAD_DIM,),
        (INTERMEDIATE, HIDDEN),
        (INTERMEDIATE, HIDDEN),
        (HIDDEN, INTERMEDIATE),
        (HIDDEN,),
        (HIDDEN,),
    ]
    return [(vocab, HIDDEN)] + layer * layers + [(HIDDEN,)]


def time_steps(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], steps: int, device: torch.device) -> float:
    """The median seconds of ``steps`` optimizer steps, after one that makes the state (and builds
    a compiled kernel)."""
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    times = []
    for _ in range(steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151936 // 8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shapes = qwen3_shapes(args.layers, args.vocab)
    torch.manual_seed(0)
    results = {}
    for name, dtype, kernel in (
        ("float32, torch.optim.AdamW(fused)", torch.float32, "eager"),
        ("bfloat16, SR-AdamW eager", torch.bfloat16, "eager"),
        ("bfloat16, SR-AdamW compiled", torch.bfloat16, "compiled"),
    ):
        params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype) * 0.02) for s in shapes]
        optimizer = make_optimizer(params, 0, device, kernel=kernel)  # what the local backend runs for this dtype
        assert isinstance(optimizer, StochasticRoundingAdamW) == (dtype == torch.bfloat16)
        results[name] = time_steps(optimizer, params, args.steps, device)
        del params, optimizer
    elements = sum(torch.Size(s).numel() for s in shapes)
    print(f"{len(shapes)} tensors, {elements / 1e6:.1f} M elements on {device} ({args.threads} thread(s) on a CPU)")
    baseline = results["float32, torch.optim.AdamW(fused)"]
    for name, seconds in results.items():
        print(f"{name:36s} {seconds * 1e3:9.1f} ms {seconds / baseline:6.2f}x")


if __name__ == "__main__":
    main()
