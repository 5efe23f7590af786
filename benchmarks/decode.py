"""Milliseconds per decode step of the local sampler's paths, side by side, at a Qwen3 shape:

- forward only: the fused decoder and transformers' own (``TransformersStepper``) over a static
  cache, eager and (CUDA) as a CUDA graph;
- the whole step (forward, sampler, stop bookkeeping, :func:`grpo_core.engine.decoding.decode_step`):
  eager with ``draw`` (decode=eager / graphs), and compiled with the one-pass sampler
  (decode=compiled; on CUDA also captured as a graph);
- the sampler alone on [batch, vocabulary] fp32 logits: ``draw`` against the one-pass ``sample``.

Each fused path runs twice where the two differ: its attention over the whole cache capacity,
and over the live prefix (the slots up to the step's own, rounded up to ``ATTEND_BLOCK``: what
the sampler runs); each row says how many slots a step attends to. ``--capacity`` sets a long
cache, the early steps of a long generation (the long workload: 32 + 2048 slots).

With ``--kernels`` (CUDA) each path's kernels per step are counted with torch.profiler over one
un-graphed step. Ratios are printed against the first row of each group.

    python benchmarks/decode.py                             # CPU, fp32 and bf16, the scaled-down shape
    python benchmarks/decode.py --compiled                  # also the compiled step on the CPU (inductor's C++: minutes)
    python benchmarks/decode.py --capacity 2176 --dtypes float32   # a long cache: the live prefix against the capacity
    python benchmarks/decode.py --device cuda --shape 0.6b --kernels   # the issue's shape, graphs, kernel counts
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

SHAPES = {
    # scaled down for a CPU: hidden 256, 4 layers, vocabulary 8192
    "small": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2},
    # Qwen3-0.6B (benchmarks/gpu.py's shape)
    "0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8},
}


def qwen3(shape: str, vocab: int, dtype: torch.dtype, device: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    head_dim = 64 if shape == "small" else 128
    config = Qwen3Config(vocab_size=vocab, head_dim=head_dim, max_position_embeddings=4096, tie_word_embeddings=True, **SHAPES[shape])
    with torch.device(device):
        return Qwen3ForCausalLM(config).to(dtype=dtype).eval()


def timed(run: Callable[[], None], steps: int, device: str) -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    began = time.perf_counter()
    for _ in range(steps):
        run()
    sync()
    return 1000 * (time.perf_counter() - began) / steps


def kernels_per_call(run: Callable[[], None]) -> int:
    from torch.autograd import DeviceType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        run()
        torch.cuda.synchronize()
    return sum(1 for e in profile.events() if e.device_type == DeviceType.CUDA)


def graphed(run: Callable[[], None]) -> Callable[[], None]:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def rig(model, path: str, args: argparse.Namespace, prefix: bool) -> tuple[Callable[[], None], int, int]:
    """One step of ``path`` over a prefilled batch (the first calls warm it up: kernels chosen,
    workspaces allocated, a compiled step compiled), the cache slots it attends to (``prefix``:
    the live prefix's block, else the capacity) and the capacity."""
    from grpo_core.engine import decoding, sampling
    from grpo_core.engine.decoding import DecodeState, DrawRule, FusedStepper, TransformersStepper, decode_step, draw
    from grpo_core.engine.fast_decoder import FastDecoder
    from grpo_core.engine.forward import TransformersForward

    device = next(model.parameters()).device
    B, P, M = args.batch, args.prompt, args.steps * 2 + 16
    capacity = max(decoding.round_capacity(P + M), args.capacity)
    # Every slot the run writes is below P + M: one width covers them all.
    width = decoding.attended_width(P + M - 1, capacity) if prefix else capacity
    compiled = path == "compiled step"
    if path.startswith("transformers"):
        stepper = TransformersStepper(TransformersForward(model), capacity)
    else:
        stepper = FusedStepper(FastDecoder(model), capacity, keep_dtype=compiled)
    ids = torch.randint(0, args.vocab, (1, P), device=device)
    logits = stepper.prefill(ids, torch.arange(P, device=device)[None], None)
    stepper.expand(B)
    valid = torch.zeros(B, capacity, dtype=torch.bool, device=device)
    valid[:, :P] = True
    state = DecodeState.around(logits.expand(B, -1).clone(), torch.full((B, 1), P - 1, device=device), valid, M, sampled=True)
    state.start(state.logits_B_V, state.position_B_1, state.valid_B_C, P, torch.Generator(device).manual_seed(0))
    state = state.head(B, width)
    if path.endswith("forward"):
        token = torch.randint(0, args.vocab, (B, 1), device=device)

        def step() -> None:
            state.position_B_1.add_(1)
            state.valid_B_C.index_fill_(1, state.slot_1, True)
            state.logits_B_V.copy_(stepper.step(token, state.position_B_1, state.valid_B_C, state.slot_1))
            state.slot_1.add_(1)

        return step, width, capacity
    rule = DrawRule(sampling.sample if compiled else draw, 1.0, 0, 1.0, torch.tensor([args.vocab - 1], device=device))
    fn = torch.compile(decode_step, fullgraph=True, dynamic=False) if compiled else decode_step
    return (lambda: fn(state, rule, stepper, True)), width, capacity


def main() -> None:
    from grpo_core.engine.decoding import ATTEND_BLOCK, draw
    from grpo_core.engine.sampling import sample

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=list(SHAPES), default="small")
    parser.add_argument("--vocab", type=int, default=None, help="default 8192 (small), 151936 (0.6b)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--capacity", type=int, default=0, help="cache slots (default: prompt + room for the steps, rounded up to 128)")
    parser.add_argument("--dtypes", default=None, help="comma-separated; default float32,bfloat16 (CPU), bfloat16 (CUDA)")
    parser.add_argument("--compiled", action="store_true", help="the compiled step on a CPU too (always on CUDA)")
    parser.add_argument("--kernels", action="store_true", help="CUDA: kernels per un-graphed step (torch.profiler)")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    args.vocab = args.vocab or (8192 if args.shape == "small" else 151936)
    dtypes = args.dtypes or ("bfloat16" if cuda else "float32,bfloat16")
    print(
        f"Qwen3 {args.shape} shape, vocabulary {args.vocab}; batch {args.batch}, prompt {args.prompt}; {args.steps} timed steps; "
        f"attention blocks of {ATTEND_BLOCK} slots"
    )
    for name in dtypes.split(","):
        dtype = getattr(torch, name)
        model = qwen3(args.shape, args.vocab, dtype, args.device)
        paths = ["fused forward", "transformers forward", "eager step (draw)"] + (["compiled step"] if cuda or args.compiled else [])
        first = None
        with torch.inference_mode():
            for path in paths:
                # transformers' StaticCache hands attention the whole capacity.
                for prefix in (False, True) if not path.startswith("transformers") else (False,):
                    run, width, capacity = rig(model, path, args, prefix)
                    if prefix and width == capacity:
                        continue  # the live prefix's block is the whole cache: the row above
                    began = time.perf_counter()
                    for _ in range(3):
                        run()
                    warm_s = time.perf_counter() - began
                    kernels = f", {kernels_per_call(run)} kernels/step" if cuda and args.kernels else ""
                    for graph in (False, True) if cuda else (False,):
                        ms = timed(graphed(run) if graph else run, args.steps, args.device)
                        first = first or ms
                        warm = f", first 3 calls {warm_s:.1f} s" if path == "compiled step" and not graph else ""
                        how = "graph" if graph else "eager" if path != "compiled step" else "no graph"
                        print(
                            f"{name:9s} {path:22s} {how:8s} attends {width:5d}/{capacity} slots: "
                            f"{ms:8.3f} ms/step ({ms / first:.2f}x the first row){kernels}{warm}"
                        )
    logits = torch.randn(args.batch, args.vocab, device=args.device) * 3
    u = torch.rand(args.batch, 1, device=args.device)
    samplers = {"draw (full-row cumsum)": draw, "one-pass sample": sample}
    if cuda or args.compiled:
        samplers["one-pass sample, compiled"] = torch.compile(sample, fullgraph=True, dynamic=False)
    base = None
    for label, fn in samplers.items():
        for _ in range(3):
            fn(logits, 1.0, 0, 1.0, u)
        ms = timed(lambda fn=fn: fn(logits, 1.0, 0, 1.0, u), args.steps, args.device)
        base = base or ms
        print(f"sampler [{args.batch}, {args.vocab}] fp32 {label:28s}: {1000 * ms:9.1f} us ({ms / base:.2f}x draw)")


if __name__ == "__main__":
    main()
