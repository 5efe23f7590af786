"""Peak memory per process and step time of the fsdp backend on 2 ranks against the local backend
(one process), on the Qwen3-0.6B shape, on a CPU.

    flock /tmp/grpo-bigmem.lock python benchmarks/fsdp_memory.py [--layers 28] [--steps 3] [--batch 8] [--tokens 64]

Builds the model once (scripts/build_shape_model.py: Qwen3-0.6B's shape, float32, the embedded
vocabulary) under benchmarks/.cache, then runs each backend in its own process: ``--steps``
training steps (one forward/backward of a custom loss over ``--batch`` sequences of ``--tokens``
tokens, then AdamW) after one warm-up step. Measured: the step time (median) and each process's
peak resident memory (VmHWM). Computed, not measured, beside them: what the training state alone
takes per process by arithmetic (weights, gradients and AdamW's two moments in float32, 16 bytes
per parameter; divided by the number of ranks for fsdp, which shards it).

``python benchmarks/fsdp_memory.py --worker PROCESSES MODEL ...`` is one run (what the script starts;
1 process: the local backend, more: fsdp with that many ranks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "scripts"))


def peak_rss_gib(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc status")


def worker(world: int, model: str, steps: int, batch: int, tokens: int) -> dict:
    import tinker
    import torch

    from grpo_core.config import RunConfig
    from grpo_core.plugins.backends.fsdp import FSDPBackend
    from grpo_core.plugins.backends.local import LocalBackend

    torch.set_num_threads(1)
    config = RunConfig(model=model, threads=1)
    trainer = LocalBackend().make_trainer(config=config) if world == 1 else FSDPBackend(nproc=world).make_trainer(config=config)
    gen = torch.Generator().manual_seed(0)
    datums = []
    for _ in range(batch):
        ids = torch.randint(3, len(trainer.tokenizer), (tokens + 1,), generator=gen).tolist()
        weights = [0.0] * (tokens // 4) + [1.0] * (tokens - tokens // 4)
        inputs = {"target_tokens": ids[1:], "weights": weights}
        datums.append(tinker.Datum(model_input=tinker.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs))

    def loss_fn(ds, logprobs):
        return sum((lp * torch.tensor(d.loss_fn_inputs["weights"].data)).sum() for d, lp in zip(ds, logprobs)) / -len(ds), {}

    times = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        trainer.forward_backward_custom(datums, loss_fn)
        trainer.optim_step(tinker.AdamParams(learning_rate=1e-5))
        if step:  # the first step makes AdamW's state: a warm-up
            times.append(time.perf_counter() - t0)
    parameters = sum(p.numel() for p in torch.nn.Module.parameters(_policy_module(trainer, world)))
    ranks = [peak_rss_gib()] + ([peak_rss_gib(w.pid) for w in trainer.group.workers] if world > 1 else [])
    if world > 1:
        trainer.close()
    return {"world": world, "step_s": statistics.median(times), "peak_gib": ranks, "parameters": parameters}


def _policy_module(trainer, world):
    if world == 1:
        return trainer.model
    # The sharded parameters' global sizes: the whole model's count.
    return trainer.group.local.models["policy"].lm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--worker", nargs=2, metavar=("WORLD", "MODEL"))
    args = parser.parse_args()
    if args.worker:
        world, model = int(args.worker[0]), args.worker[1]
        print(json.dumps(worker(world, model, args.steps, args.batch, args.tokens)))
        return
    from build_shape_model import build

    model = HERE / ".cache" / f"qwen3-0.6b-shape-{args.layers}L"
    if not (model / "config.json").is_file():
        build(model, "qwen3-0.6b", args.layers, "embedded", seed=0)
    results = []
    for world in (1, 2):
        out = subprocess.run(
            [sys.executable, __file__, "--worker", str(world), str(model), "--steps", str(args.steps), "--batch", str(args.batch),
             "--tokens", str(args.tokens)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if out.returncode != 0:
            sys.exit(f"{backend_of(world)} failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"Qwen3-0.6B shape, {args.layers} layers, {results[0]['parameters'] / 1e6:.0f}M parameters, float32, CPU, 1 thread per process")
    print(f"batch {args.batch} x {args.tokens} tokens; measured: median step time of {args.steps} steps after a warm-up, peak RSS")
    print("computed (arithmetic, not measured): training state = 16 B per parameter (float32 weights, gradients, AdamW moments) / ranks")
    header = f"{'backend':<16}  {'measured step s':>15}  {'measured peak RSS GiB per process':<34}  computed state GiB per process"
    print(header)
    for r in results:
        state = 16 * r["parameters"] / r["world"] / 2**30
        peaks = ", ".join(f"{g:.2f}" for g in r["peak_gib"])
        print(f"{backend_of(r['world']):<16}  {r['step_s']:>15.2f}  {peaks:<34}  {state:.2f}")


def backend_of(processes: int) -> str:
    return "local, 1 process" if processes == 1 else f"fsdp, {processes} ranks"


if __name__ == "__main__":
    main()
