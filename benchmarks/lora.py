"""LoRA against full fine-tuning on the compute benchmark model: step time and memory.

    python benchmarks/lora.py [--steps 5] [--repeats 2] [--threads 1] [--ranks 8,64] [--json FILE]
    python benchmarks/lora.py --ab [--rounds 7]

Runs grpo-core's synchronous loop on the "compute" configuration (Qwen3, ~9.6M parameters,
8 prompts x G=8, 16-token prompts, forced 32-token completions; benchmarks/README.md), one
subprocess per run so that each peak RSS is its own, interleaving the variants: full
fine-tuning and LoRA at each rank, each without a KL term (no reference model) and with one
(``kl_beta=0.001``: full fine-tuning keeps a frozen copy of the model as its reference, LoRA
runs the same model with its adapters off). Prints one table (docs/performance.md, LoRA).

``python benchmarks/lora.py --worker SPEC.json RESULT.json VARIANT`` is one run (what the
orchestrator starts).

``python benchmarks/lora.py --ab [--rounds 7]``: the same two phases in one process, full
fine-tuning and LoRA interleaved round by round on the same trainers and batch (sampling 8
prompts x G=8 x 32 tokens; forward/backward + AdamW over those 64 sequences), medians per
variant: separate runs on a shared machine differ by more than the effect.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_common import CACHE, load_spec, matmul_peak, write_result

KL_BETA = 0.001
LORA_ALPHA = 32.0


def variants(ranks: list[int]) -> dict[str, dict[str, Any]]:
    """Name -> (lora_rank, kl_beta) of every run kind."""
    out: dict[str, dict[str, Any]] = {}
    for rank in [0, *ranks]:
        name = "full" if rank == 0 else f"lora r={rank}"
        out[name] = {"lora_rank": rank, "kl_beta": 0.0}
        out[f"{name} +KL"] = {"lora_rank": rank, "kl_beta": KL_BETA}
    return out


def worker(spec_path: str, result_path: str, variant_json: str) -> None:
    import run_grpo_core

    spec = load_spec(spec_path)
    variant = json.loads(variant_json)
    run_grpo_core.register_plugins(Path(spec["work_dir"]) / "grpo_core_site")
    import bench_plugins
    import torch

    from grpo_core.engine.trainer import read_trainer_state
    from grpo_core.train import run

    started, started_cpu = time.perf_counter(), time.process_time()
    config = run_grpo_core.make_config(
        spec,
        {
            "plugin_options": {"loss": {"grpo": {"kl_beta": variant["kl_beta"]}}},
            "lora_rank": variant["lora_rank"],
            "lora_alpha": LORA_ALPHA,
        },
    )
    run(config, overwrite=True)
    (checkpoint,) = (Path(config.run_dir) / "checkpoints").iterdir()
    state = read_trainer_state(checkpoint / "trainer")
    moments = [t for s in state["optimizer"]["state"].values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
    steps = run_grpo_core.step_records(bench_plugins.STEPS, started, started_cpu)
    write_result(
        result_path,
        {
            "contender": variant["name"],
            "rss_start_mb": bench_plugins.RUN.get("rss_start_mb"),
            "steps": steps,
            # One first moment per trained tensor (the tied embedding counted once).
            "trained_params": sum(t.numel() for s in state["optimizer"]["state"].values() for k, t in s.items() if k == "exp_avg"),
            "optimizer_state_mb": sum(t.numel() * t.element_size() for t in moments) / 2**20,
            "checkpoint_mb": sum(f.stat().st_size for f in (checkpoint / "trainer").iterdir()) / 2**20,
            "versions": {"torch": torch.__version__},
        },
    )


def ab(ranks: list[int], rounds: int) -> None:
    """Interleaved in-process A/B of the sampling and training phases (medians of ``rounds``)."""
    import statistics

    import tinker
    import torch
    from run import prepare

    from grpo_core import Sample, SamplingParams
    from grpo_core.backend import sample_to_datum
    from grpo_core.config import RunConfig
    from grpo_core.plugins.backends.local import LocalBackend
    from grpo_core.plugins.samplers.local import LocalSamplerPlugin

    spec = prepare("compute", 1, CACHE / "work" / "lora-ab")
    trainers = {}
    for rank in [0, *ranks]:
        torch.manual_seed(0)
        config = RunConfig(model=spec["model_dir"], lora_rank=rank, lora_alpha=LORA_ALPHA, device="cpu")
        trainer = LocalBackend().make_trainer(config=config)
        trainers["full" if rank == 0 else f"lora r={rank}"] = (trainer, LocalSamplerPlugin().make_sampler(config=config, trainer=trainer))
    _, (first, sampler) = next(iter(trainers.items()))
    prompts = [first.tokenizer(p)["input_ids"] for p in spec["prompts"][: spec["prompts_per_step"]]]
    params = SamplingParams(max_tokens=spec["completion_tokens"], temperature=1.0)
    groups = sampler.sample(prompts, spec["group_size"], params)
    datums = [
        sample_to_datum(Sample(prompt=None, tokens=p + c.tokens, sampling_logprobs=[0.0] * len(p) + c.logprobs,
                               loss_mask=[0.0] * len(p) + [1.0] * len(c.tokens), text="", finish_reason="length", policy_version=0))
        for p, g in zip(prompts, groups) for c in g
    ]  # fmt: skip
    advantages = torch.linspace(-1.0, 1.0, len(datums))

    def loss_fn(_datums, logprobs):
        return -sum(a * lp.sum() for a, lp in zip(advantages, logprobs)) / len(logprobs), {}

    # Wall and CPU time of each phase: on a shared machine the CPU time is the steadier of the two.
    times: dict[str, dict[str, list[float]]] = {name: {"sample": [], "train": [], "sample_cpu": [], "train_cpu": []} for name in trainers}
    for _ in range(rounds + 1):  # the first round warms up (allocations, optimizer state)
        for name, (trainer, sampler) in trainers.items():
            t0, c0 = time.perf_counter(), time.process_time()
            sampler.sample(prompts, spec["group_size"], params)
            t1, c1 = time.perf_counter(), time.process_time()
            trainer.forward_backward_custom(datums, loss_fn)
            trainer.optim_step(tinker.AdamParams(learning_rate=1e-5))
            t2, c2 = time.perf_counter(), time.process_time()
            for key, value in (("sample", t1 - t0), ("train", t2 - t1), ("sample_cpu", c1 - c0), ("train_cpu", c2 - c1)):
                times[name][key].append(value)
    medians = {name: {k: statistics.median(v[1:]) for k, v in t.items()} for name, t in times.items()}
    full = medians["full"]
    print(
        f"compute model, {len(datums)} sequences of {spec['prompt_tokens']} + {spec['completion_tokens']} tokens; "
        f"median of {rounds} interleaved rounds, {torch.get_num_threads()} thread(s)"
    )
    print("| variant | sample s (CPU s) | vs full (CPU) | forward/backward + AdamW s (CPU s) | vs full (CPU) |")
    print("|---|---:|---:|---:|---:|")
    for name, m in medians.items():
        print(
            f"| {name} | {m['sample']:.3f} ({m['sample_cpu']:.3f}) | "
            f"{m['sample'] / full['sample']:.2f}x ({m['sample_cpu'] / full['sample_cpu']:.2f}x) | "
            f"{m['train']:.3f} ({m['train_cpu']:.3f}) | {m['train'] / full['train']:.2f}x ({m['train_cpu'] / full['train_cpu']:.2f}x) |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (after one warmup step)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per variant, interleaved")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    parser.add_argument("--ranks", default="8,64", help="LoRA ranks, comma-separated")
    parser.add_argument("--json", type=Path, default=None, help="also write every number to this file")
    parser.add_argument("--ab", action="store_true", help="the in-process interleaved A/B of the two phases instead")
    parser.add_argument("--rounds", type=int, default=7, help="--ab: timed rounds")
    args = parser.parse_args(argv)
    from run import WORKER_ENV, check_lengths, log, prepare, summarize, thread_env

    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    if args.ab:
        ab([int(r) for r in args.ranks.split(",") if r], args.rounds)
        return 0
    kinds = variants([int(r) for r in args.ranks.split(",") if r])
    work = CACHE / "work" / f"lora-{time.strftime('%Y%m%d-%H%M%S')}"
    spec = prepare("compute", args.steps, work)
    probes = [matmul_peak()]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in kinds}
    for repeat in range(args.repeats):
        for name, variant in kinds.items():
            log(f"lora benchmark: {name}, run {repeat + 1}/{args.repeats} ...")
            result_path = work / f"result-{len(results[name])}-{name.replace(' ', '_').replace('=', '')}.json"
            log_path = result_path.with_suffix(".log")
            cmd = [sys.executable, __file__, "--worker", str(work / "spec.json"), str(result_path), json.dumps({**variant, "name": name})]
            with log_path.open("w") as logf:
                proc = subprocess.run(
                    cmd,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    check=False,
                    env={**os.environ, **WORKER_ENV, **thread_env(args.threads)},
                    cwd=work,
                )
            if proc.returncode != 0:
                raise RuntimeError(
                    f"{name} failed (exit {proc.returncode}); log {log_path}:\n" + "\n".join(log_path.read_text().splitlines()[-30:])
                )
            result = json.loads(result_path.read_text())
            check_lengths(result, spec)
            results[name].append(result)
    probes.append(matmul_peak())
    peak = max(p["peak_flops"] for p in probes)
    rows = []
    for name, runs in results.items():
        s = summarize(runs, spec, peak)
        rows.append(
            {
                "variant": name,
                **{k: s[k] for k in ("step_s", "step_s_min", "step_s_max", "sample_s", "train_s", "peak_rss_mb", "rss_start_mb")},
                "trained_params": runs[0]["trained_params"],
                "optimizer_state_mb": runs[0]["optimizer_state_mb"],
                "checkpoint_mb": runs[0]["checkpoint_mb"],
                "peak_rss_mb_runs": [r["peak_rss_mb"] for r in runs],
            }
        )
    for r in rows:
        # Weights, gradients, Adam's moments and the reference's own weights (full fine-tuning's
        # frozen copy; LoRA scores with the same model): what stays allocated across steps.
        weights_mb = spec["params"]["all"] * 4 / 2**20
        reference_mb = weights_mb if r["variant"].startswith("full") and r["variant"].endswith("+KL") else 0.0
        r["training_state_mb"] = weights_mb + r["trained_params"] * 4 / 2**20 + r["optimizer_state_mb"] + reference_mb
    full = {r["variant"]: r for r in rows}
    lines = [
        (
            f"compute model ({spec['params']['all'] / 1e6:.2f}M parameters), {spec['prompts_per_step']} prompts x G={spec['group_size']}, "
            f"{spec['prompt_tokens']} + {spec['completion_tokens']} tokens; {args.repeats} runs x {args.steps} timed steps per variant, "
            f"{args.threads or 'default'} torch thread(s), lora_alpha {LORA_ALPHA:g}, kl_beta {KL_BETA:g} in the +KL rows; "
            f"{time.strftime('%Y-%m-%d')}"
        ),
        "",
        (
            "| variant | trained params | step s (min-max) | vs full | sample s | train s | optimizer state MB | training state MB | "
            "checkpoint MB | RSS at start MB | peak RSS MB | growth MB |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = full["full +KL" if r["variant"].endswith("+KL") else "full"]
        lines.append(
            f"| {r['variant']} | {r['trained_params']:,} | {r['step_s']:.2f} ({r['step_s_min']:.2f}-{r['step_s_max']:.2f}) | "
            f"{r['step_s'] / base['step_s']:.2f}x | {r['sample_s']:.2f} | {r['train_s']:.2f} | "
            f"{r['optimizer_state_mb']:.1f} | {r['training_state_mb']:.1f} | "
            f"{r['checkpoint_mb']:.1f} | {r['rss_start_mb']:.0f} | {r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] - r['rss_start_mb']:.0f} |"
        )
    print("\n".join(lines))
    if args.json:
        args.json.write_text(
            json.dumps({"rows": rows, "peak_flops": peak, "spec": {k: v for k, v in spec.items() if k != "prompts"}}, indent=2)
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:])
        sys.exit(0)
    sys.exit(main())
