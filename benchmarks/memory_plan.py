"""The memory plan's estimate (engine/memory_plan.py) against the measured peak of training steps
on a CPU, per weight dtype and --optimizer-state, for the tests' tiny model and the Qwen3-0.6B shape.

    flock /tmp/grpo-bigmem.lock python benchmarks/memory_plan.py [--shape tiny|0.6b] [--cases float32:fp32,bfloat16:8bit,...]
                                                                   [--steps 2] [--batch 8] [--tokens 64]

Each case runs in its own process: the local backend's trainer (no reference, no sampler copy:
the plan is asked for the same), ``--steps`` forward/backward + AdamW steps over ``--batch``
sequences of ``--tokens`` tokens. Measured: the peak resident memory (VmHWM) minus the process's
resident memory after its imports (torch, transformers, grpo_core: ~0.5 GB that no plan of the
model's memory includes; the device's free memory is read after them too). Printed: the estimate,
the measured peak above that baseline, their ratio, and for the 0.6B shape how much each
--optimizer-state lowers the measured peak against fp32 moments beside the expected bytes per
parameter (8 - moment bytes).

``--worker DTYPE STATE MODEL`` is one case (what the script starts).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "scripts"))

ALL_CASES = [f"{d}:{s}" for d in ("float32", "bfloat16") for s in ("fp32", "bf16", "8bit")]


def rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(dtype: str, optimizer_state: str, model: str, steps: int, batch: int, tokens: int) -> dict:
    import tinker
    import torch

    from grpo_core.config import RunConfig
    from grpo_core.engine.memory_plan import CPU_RUNTIME_BYTES, model_size, plan
    from grpo_core.plugins.backends.local import LocalBackend

    torch.set_num_threads(1)
    baseline = rss("VmRSS")
    config = RunConfig(model=model, threads=1, dtype=dtype, optimizer_state=optimizer_state, memory_check=False)
    trainer = LocalBackend().make_trainer(config=config)
    generator = torch.Generator().manual_seed(0)
    datums = []
    for _ in range(batch):
        ids = torch.randint(3, len(trainer.tokenizer), (tokens + 1,), generator=generator).tolist()
        inputs = {"target_tokens": ids[1:], "weights": [1.0] * tokens}
        datums.append(tinker.Datum(model_input=tinker.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs))

    def loss_fn(ds, logprobs):
        return sum(lp.sum() for lp in logprobs) / -len(ds), {}

    for _ in range(steps):
        trainer.forward_backward_custom(datums, loss_fn)
        trainer.optim_step(tinker.AdamParams(learning_rate=1e-5))
    size = model_size(model)
    estimate = plan(size, getattr(torch, dtype), optimizer_state, batch * tokens, False, None, False, runtime=CPU_RUNTIME_BYTES)
    return {
        "dtype": dtype,
        "state": optimizer_state,
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "estimate": estimate.peak,
        "phase": estimate.phase,
        "measured": rss("VmHWM") - baseline,
        "baseline": baseline,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("tiny", "0.6b"), default="tiny")
    parser.add_argument("--cases", default=",".join(ALL_CASES))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--worker", nargs=3, metavar=("DTYPE", "STATE", "MODEL"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.steps, args.batch, args.tokens)))
        return
    from build_shape_model import build

    if args.shape == "tiny":
        model = HERE / ".cache" / "default-shape-2L"
        if not (model / "config.json").is_file():
            build(model, "default", 2, "embedded", seed=0)
    else:
        model = HERE / ".cache" / "qwen3-0.6b-shape-28L-qwen-vocab"
        if not (model / "config.json").is_file():
            build(model, "qwen3-0.6b", 28, "qwen", seed=0)
    results = []
    for case in args.cases.split(","):
        dtype, state = case.split(":")
        command = [sys.executable, __file__, "--worker", dtype, state, str(model), "--steps", str(args.steps), "--batch", str(args.batch),
                   "--tokens", str(args.tokens)]  # fmt: skip
        out = subprocess.run(command, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            sys.exit(f"{case} failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)  # each case as it ends: a 0.6B case takes minutes
    first = results[0]
    print(
        f"{args.shape} shape: {first['parameters'] / 1e6:.1f}M parameters; CPU, 1 thread; "
        f"{args.steps} steps of {args.batch} x {args.tokens} tokens"
    )
    baseline = first["baseline"] / 1e9
    print(f"measured = peak RSS (VmHWM) - RSS after imports (baseline {baseline:.2f} GB); estimate = engine/memory_plan.py")
    print(
        f"{'dtype':<9} {'moments':<8} {'estimate GB':>11} {'measured GB':>11} {'est/meas':>8}  "
        f"{'saved vs fp32 moments, B/param':>30}  phase"
    )
    for r in results:
        fp32 = next((f for f in results if f["dtype"] == r["dtype"] and f["state"] == "fp32"), None)
        saved = ""
        if fp32 is not None and r is not fp32:
            from grpo_core.engine.optim import moment_bytes

            measured = (fp32["measured"] - r["measured"]) / r["parameters"]
            saved = f"{measured:.2f} (expected {8 - moment_bytes(r['state']):.2f})"
        print(
            f"{r['dtype']:<9} {r['state']:<8} {r['estimate'] / 1e9:>11.3f} {r['measured'] / 1e9:>11.3f} "
            f"{r['estimate'] / r['measured']:>8.2f}  {saved:>30}  {r['phase']}"
        )


if __name__ == "__main__":
    main()
