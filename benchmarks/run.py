"""grpo-core against TRL, a hand-written PyTorch loop and this machine's matmul peak.

    python benchmarks/run.py [--config overhead|compute|all] [--steps N]

See benchmarks/README.md for what is measured and how. Each contender runs in its own
subprocess (so its peak RSS is its own) on the same locally built model, prompts, group size,
forced completion length and number of steps; the first step of each is a warmup and is not
timed. TRL is installed on first use into benchmarks/.venv-trl (git-ignored).
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

from bench_common import CACHE, CONFIGS, LEARNING_RATE, SEED, build_model, make_prompts, matmul_peak, model_flops, param_counts, write_dataset  # noqa: E402

TRL_VERSION = "1.16.0"
TRL_VENV = HERE / ".venv-trl"
WORKERS = {"grpo-core": "run_grpo_core.py", "TRL": "run_trl.py", "naive": "run_naive.py"}
WORKER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_trl_venv() -> Path:
    """benchmarks/.venv-trl with trl==1.16.0 and this interpreter's torch and transformers versions.

    torch is installed first and pinned, so that trl's own torch requirement installs nothing
    more (an unpinned torch would pull the CUDA build and its GBs of packages).
    """
    import torch
    import transformers

    python = TRL_VENV / "bin" / "python"
    torch_version = torch.__version__.split("+")[0]
    probe = "import trl, torch, transformers; print(trl.__version__, torch.__version__.split('+')[0], transformers.__version__)"
    want = f"{TRL_VERSION} {torch_version} {transformers.__version__}"
    if python.exists():
        out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip() == want:
            return python
    log(f"setting up {TRL_VENV} (trl=={TRL_VERSION}, torch=={torch_version}, transformers=={transformers.__version__}); once, a few minutes")
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, f"torch=={torch_version}"], check=True)
    subprocess.run([*pip, f"trl=={TRL_VERSION}", f"transformers=={transformers.__version__}", f"torch=={torch_version}"], check=True)
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True)
    if out.stdout.strip() != want:
        raise RuntimeError(f"{TRL_VENV} has {out.stdout.strip()}, wanted {want}")
    return python


def prepare(name: str, steps: int, work: Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build the configuration's model, prompts and dataset; return the spec the workers read."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = {**CONFIGS[name], **(overrides or {})}
    model_dir = build_model(CACHE / "models" / name, name)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    counts = param_counts(AutoModelForCausalLM.from_pretrained(model_dir))
    prompts = make_prompts(tokenizer, cfg["prompt_tokens"], (steps + 1) * cfg["prompts_per_step"])
    work.mkdir(parents=True, exist_ok=True)
    spec = {
        "config": name,
        "model_dir": str(model_dir),
        "dataset": str(write_dataset(work / "prompts.jsonl", prompts)),
        "prompts": prompts,
        "prompt_tokens": cfg["prompt_tokens"],
        "completion_tokens": cfg["completion_tokens"],
        "prompts_per_step": cfg["prompts_per_step"],
        "group_size": cfg["group_size"],
        "steps": steps,
        "learning_rate": LEARNING_RATE,
        "seed": SEED,
        "work_dir": str(work),
        "params": counts,
    }
    (work / "spec.json").write_text(json.dumps(spec, indent=2))
    return spec


def run_worker(contender: str, spec: dict[str, Any], python: str) -> dict[str, Any]:
    work = Path(spec["work_dir"])
    result_path = work / f"result-{contender}.json"
    log_path = work / f"log-{contender}.txt"
    result_path.unlink(missing_ok=True)
    cmd = [python, str(HERE / WORKERS[contender]), str(work / "spec.json"), str(result_path)]
    with log_path.open("w") as logf:
        proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env={**os.environ, **WORKER_ENV}, cwd=work)
    if proc.returncode != 0 or not result_path.exists():
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise RuntimeError(f"{contender} failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    return json.loads(result_path.read_text())


def summarize(result: dict[str, Any], spec: dict[str, Any], peak: float) -> dict[str, Any]:
    """Throughput, MFU and the time split over the timed steps (all but the first)."""
    B = spec["prompts_per_step"] * spec["group_size"]
    L, P = spec["completion_tokens"], spec["prompt_tokens"]
    timed = result["steps"][1:]
    if len(timed) != spec["steps"]:
        raise RuntimeError(f"{result['contender']}: {len(timed)} timed steps, expected {spec['steps']}")
    lengths = [n for s in result["steps"] for n in s["completion_lengths"]]
    if len(lengths) != B * (spec["steps"] + 1) or set(lengths) != {L}:
        raise RuntimeError(f"{result['contender']}: completion lengths {sorted(set(lengths))} (count {len(lengths)}), expected all {L}")
    seconds = sum(s["period"] for s in timed)
    n = spec["params"]["all"]
    flops = model_flops(n, B, P, L)
    per = {k: sum(s[k] for s in timed) / seconds for k in ("sample", "reward", "train")}
    return {
        "contender": result["contender"],
        "completions_per_s": B * len(timed) / seconds,
        "tokens_per_s": sum(sum(s["completion_lengths"]) for s in timed) / seconds,
        "step_s": seconds / len(timed),
        "mfu": (flops["sample"] + flops["train"]) * len(timed) / seconds / peak,
        "mfu_all": (flops["sample_all"] + flops["train_all"]) * len(timed) / seconds / peak,
        "sample_mfu": flops["sample_all"] * len(timed) / sum(s["sample"] for s in timed) / peak,
        "train_mfu": flops["train_all"] * len(timed) / sum(s["train"] for s in timed) / peak,
        "sample_frac": per["sample"],
        "reward_frac": per["reward"],
        "train_frac": per["train"],
        "other_frac": 1.0 - sum(per.values()),
        "peak_rss_mb": result["peak_rss_mb"],
        "lengths_ok": True,
        "versions": result["versions"],
    }


def format_table(name: str, spec: dict[str, Any], rows: list[dict[str, Any]], peak: float) -> str:
    B = spec["prompts_per_step"] * spec["group_size"]
    n = spec["params"]
    head = (
        f"== {name}: Qwen3 {n['all'] / 1e6:.2f}M params ({n['non_embedding'] / 1e6:.2f}M non-embedding), "
        f"{spec['prompts_per_step']} prompts x G={spec['group_size']} = {B} completions/step, "
        f"prompt {spec['prompt_tokens']} + forced {spec['completion_tokens']} completion tokens, "
        f"{spec['steps']} timed steps after 1 warmup; peak {peak / 1e9:.1f} GFLOP/s fp32"
    )
    cols = f"{'contender':<10} {'compl/s':>8} {'tok/s':>8} {'step s':>7} {'MFU':>6} {'MFU all':>7} {'sample':>7} {'reward':>7} {'train':>6} {'other':>6} {'smpl MFU':>8} {'trn MFU':>7} {'peak RSS':>9}"
    lines = [head, cols]
    for r in rows:
        lines.append(
            f"{r['contender']:<10} {r['completions_per_s']:>8.1f} {r['tokens_per_s']:>8.0f} {r['step_s']:>7.3f} "
            f"{r['mfu']:>6.1%} {r['mfu_all']:>7.1%} {r['sample_frac']:>7.0%} {r['reward_frac']:>7.0%} {r['train_frac']:>6.0%} "
            f"{r['other_frac']:>6.0%} {r['sample_mfu']:>8.1%} {r['train_mfu']:>7.1%} {r['peak_rss_mb']:>7.0f}MB"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=["overhead", "compute", "all"], default="all")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per contender (after one warmup step)")
    parser.add_argument("--contenders", default="grpo-core,TRL,naive", help="comma-separated subset of grpo-core,TRL,naive")
    parser.add_argument("--json", type=Path, default=None, help="also write every number to this file")
    args = parser.parse_args(argv)
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = set(contenders) - set(WORKERS)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)}; choose from {list(WORKERS)}")
    names = ["overhead", "compute"] if args.config == "all" else [args.config]

    pythons = {c: sys.executable for c in contenders}
    if "TRL" in contenders:
        pythons["TRL"] = str(ensure_trl_venv())

    log("matmul probe ...")
    probes = [matmul_peak()]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    raw: dict[str, Any] = {}
    for name in names:
        spec = prepare(name, args.steps, CACHE / "work" / stamp / name)
        raw[name] = {"spec": {k: v for k, v in spec.items() if k != "prompts"}, "results": {}}
        for contender in contenders:
            log(f"{name}: {contender} ...")
            t = time.perf_counter()
            raw[name]["results"][contender] = run_worker(contender, spec, pythons[contender])
            log(f"{name}: {contender} done in {time.perf_counter() - t:.0f}s")
    probes.append(matmul_peak())
    peak = max(p["peak_flops"] for p in probes)

    tables, ratios, summary = [], [], {}
    for name in names:
        spec = raw[name]["spec"]
        rows = [summarize(raw[name]["results"][c], spec, peak) for c in contenders]
        summary[name] = rows
        tables.append(format_table(name, spec, rows, peak))
        by = {r["contender"]: r for r in rows}
        if "grpo-core" in by:
            for other in ("TRL", "naive"):
                if other in by:
                    ratios.append(f"{name}: grpo-core/{other} completions/s = {by['grpo-core']['completions_per_s'] / by[other]['completions_per_s']:.2f}x")

    print(f"machine: {os.cpu_count()} CPUs, torch {probes[0]['threads']} threads; fp32 matmul peak {peak / 1e9:.1f} GFLOP/s (2048^3, best of 10, probed before and after: "
          + ", ".join(f"{p['peak_flops'] / 1e9:.1f}" for p in probes) + ")")
    print("MFU: 2N FLOPs per generated + 6N per trained (completion) token, N = all params (tied embedding once) / step time / peak;")
    print("MFU all: also the prompt positions (prefill, training forward/backward over prompt+completion); smpl/trn MFU: 'all' FLOPs of that phase / its time.")
    print("All contenders generated exactly the forced number of tokens for every completion (checked).")
    for table in tables:
        print()
        print(table)
    print()
    for line in ratios:
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"peak_flops": peak, "probes": probes, "summary": summary, "raw": raw}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
