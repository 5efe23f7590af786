"""The trainer's step eager against ``--backend-opt compile=true`` (each decoder layer compiled, dynamic
shapes) on the embedded default model and the random ``compute`` model of bench_common (hidden 384,
6 layers): 8 steps of changing prompt and completion lengths (packed; ``--shared``: 4 completions per
prompt, the shared-prefix path), each contender in a fresh process, alternated ``--repeats`` times.
Prints per model and contender the median step time of steps 3-8 and the spread over repeats, the
first two steps (compiling), the frames compiled and recompiles, and the ratio eager / compiled.

    OMP_NUM_THREADS=1 python benchmarks/compile.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_common import CACHE, build_model

STEPS = 8
MODELS = ("default", "compute")


def batch(step: int, shared: bool, generator: object) -> list:
    import torch
    from tinker import Datum, ModelInput

    prompt_tokens, datums = 10 + 3 * step, []
    prompt: list[int] = []
    for g in range(8):
        if not shared or g % 4 == 0:
            prompt = torch.randint(2, 300, (prompt_tokens,), generator=generator).tolist()
        completion = torch.randint(2, 300, (5 + (7 * step + 3 * g) % 30,), generator=generator).tolist()
        tokens = prompt + completion
        weights = [0.0] * (prompt_tokens - 1) + [1.0] * len(completion)
        datums.append(
            Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})
        )
    return datums


def worker(model: str, compile: bool, shared: bool) -> dict:
    import tinker
    import torch
    import torch._dynamo.utils

    from grpo_core.config import RunConfig
    from grpo_core.engine.compile import CompiledLayers
    from grpo_core.plugins.backends.local import LocalBackend

    torch.manual_seed(0)
    config = RunConfig() if model == "default" else RunConfig(model=str(build_model(CACHE / "compile-bench" / model, model)))
    trainer = LocalBackend(compile=False).make_trainer(config=config)
    if compile:
        # The backend refuses compile=true for a run whose groups share their prompts (every forward
        # cached, eager); these batches are the trainer's own, distinct prompts packed unless --shared.
        trainer.compiled_layers = CompiledLayers(trainer.model)
    generator = torch.Generator().manual_seed(0)
    times = []
    for step in range(STEPS):
        start = time.perf_counter()
        trainer.forward_backward_custom(batch(step, shared, generator), lambda d, lps: (-sum(lp.sum() for lp in lps), {}))
        trainer.optim_step(tinker.AdamParams(learning_rate=1e-5))
        times.append(time.perf_counter() - start)
    counters = torch._dynamo.utils.counters
    return {
        "times": times,
        "frames": int(counters["stats"]["unique_graphs"]),
        "recompiles": sum(counters["recompiles"].values()) if "recompiles" in counters else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--shared", action="store_true", help="4 completions per prompt: the shared-prefix path")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        model, compiled = args.worker.split(":")
        print(json.dumps(worker(model, compiled == "1", args.shared)))
        return
    for model in args.models.split(","):
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.repeats):
            for compiled in (False, True):
                command = [sys.executable, __file__, "--worker", f"{model}:{int(compiled)}"] + (["--shared"] if args.shared else [])
                out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
                runs[compiled].append(json.loads(out.strip().splitlines()[-1]))
        medians = {}
        for compiled, results in runs.items():
            steady = [statistics.median(r["times"][2:]) for r in results]
            medians[compiled] = statistics.median(steady)
            first = statistics.median(sum(r["times"][:2]) for r in results)
            print(
                f"{model:8} {'compiled' if compiled else 'eager':8} step {medians[compiled] * 1000:7.1f} ms "
                f"(repeats {min(steady) * 1000:.1f}-{max(steady) * 1000:.1f}); steps 1-2 {first:6.1f} s; "
                f"frames compiled {results[0]['frames']}, recompiles {results[0]['recompiles']}"
            )
        print(f"{model:8} eager / compiled = {medians[False] / medians[True]:.2f}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
