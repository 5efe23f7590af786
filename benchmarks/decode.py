"""Milliseconds per decode step of the local sampler's two forwards over a static cache: the fused
decoder and transformers' own (``TransformersStepper``), at a scaled-down Qwen3 shape and batch 64,
in float32 and bfloat16, on the CPU or, where one is present, on CUDA (eager and as a CUDA graph).

    python benchmarks/decode.py                 # CPU, fp32 and bf16
    python benchmarks/decode.py --device cuda   # also the graphed step
"""

from __future__ import annotations

import argparse
import time

import torch


def qwen3(hidden: int, layers: int, vocab: int, dtype: torch.dtype, device: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    heads = max(2, hidden // 64)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64, max_position_embeddings=4096,
        tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen3ForCausalLM(config).to(device=device, dtype=dtype).eval()


def ms_per_step(stepper, batch: int, prompt: int, steps: int, graphed: bool, vocab: int) -> float:
    device = next(stepper_model(stepper).parameters()).device
    ids = torch.randint(0, vocab, (1, prompt), device=device)
    positions = torch.arange(prompt, device=device)[None]
    stepper.prefill(ids, positions, None)
    stepper.expand(batch)
    valid = torch.zeros(batch, prompt + steps + 8, dtype=torch.bool, device=device)
    valid[:, :prompt] = True
    position = torch.full((batch, 1), prompt - 1, device=device)
    slot = torch.tensor([prompt], device=device)
    token = torch.randint(0, vocab, (batch, 1), device=device)
    logits = torch.empty(batch, vocab, device=device)

    def step() -> None:
        position.add_(1)
        valid.index_fill_(1, slot, True)
        logits.copy_(stepper.step(token, position, valid, slot))
        slot.add_(1)

    for _ in range(3):  # warm-up: kernels chosen, workspaces allocated
        step()
    run = step
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    began = time.perf_counter()
    for _ in range(steps):
        run()
    sync()
    return 1000 * (time.perf_counter() - began) / steps


def stepper_model(stepper):
    return stepper.decoder.model if hasattr(stepper, "decoder") else stepper.forward.model


def main() -> None:
    from grpo_core.engine.decoding import FusedStepper, TransformersStepper
    from grpo_core.engine.fast_decoder import FastDecoder
    from grpo_core.engine.forward import TransformersForward

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    print(f"Qwen3 shape: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; batch {args.batch}, prompt {args.prompt}")
    for dtype in (torch.float32, torch.bfloat16):
        model = qwen3(args.hidden, args.layers, args.vocab, dtype, args.device)
        capacity = args.prompt + args.steps + 8
        with torch.inference_mode():
            for name, stepper_type, forward_type in (
                ("fused decoder", FusedStepper, FastDecoder),
                ("transformers+static cache", TransformersStepper, TransformersForward),
            ):
                for graphed in (False, True) if args.device.startswith("cuda") else (False,):
                    ms = ms_per_step(stepper_type(forward_type(model), capacity), args.batch, args.prompt, args.steps, graphed, args.vocab)
                    print(f"{str(dtype).removeprefix('torch.'):9s} {name:27s} {'graph' if graphed else 'eager'}: {ms:8.2f} ms/step")


if __name__ == "__main__":
    main()
