"""grpo-core against TRL, a hand-written PyTorch loop and this machine's matmul peak.

    python benchmarks/run.py [--config overhead|compute|all|real] [--steps N]

See benchmarks/README.md for what is measured and how. Each contender runs in its own
subprocess (so its peak RSS is its own) on the same locally built model, prompts, group size,
forced completion length and number of steps; the first step of each is a warmup and is not
timed. TRL is installed on first use into benchmarks/.venv-trl (git-ignored).

``--config real`` is the Qwen3-0.6B shape with its 151,936-row vocabulary: ~8-12 GB per
contender, so on a shared machine run it with ``--lock FILE`` (workers take turns with other
jobs that lock the same file) and ``--nice``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_common import (
    CACHE,
    CONFIGS,
    LEARNING_RATE,
    SEED,
    build_model,
    make_prompts,
    matmul_peak,
    model_flops,
    param_counts_of,
    write_dataset,
)

TRL_VERSION = "1.16.0"
TRL_VENV = HERE / ".venv-trl"
WORKERS = {
    "grpo-core": "run_grpo_core.py",
    "grpo-core-hf": "run_grpo_core.py",
    "grpo-core-bf16": "run_grpo_core.py",
    "grpo-core-bf16-gc": "run_grpo_core.py",
    "grpo-core-lora-bf16": "run_grpo_core.py",
    "TRL": "run_trl.py",
    "TRL-bf16": "run_trl.py",
    "TRL-bf16-gc": "run_trl.py",
    "naive": "run_naive.py",
    "naive-bf16": "run_naive.py",
}
WORKER_ARGS = {
    "grpo-core-hf": ["--transformers-forward"],
    "grpo-core-bf16": ["--dtype", "bfloat16"],
    "grpo-core-bf16-gc": ["--dtype", "bfloat16", "--gradient-checkpointing"],
    "grpo-core-lora-bf16": ["--dtype", "bfloat16", "--lora-rank", "8"],
    "TRL-bf16": ["--bf16"],
    "TRL-bf16-gc": ["--bf16", "--gradient-checkpointing"],
    "naive-bf16": ["--bf16"],
}
COUNTERPART = {
    "grpo-core": "TRL",
    "grpo-core-hf": "TRL",
    "grpo-core-bf16": "TRL-bf16",
    "grpo-core-bf16-gc": "TRL-bf16-gc",
    "grpo-core-lora-bf16": "TRL-bf16",
    "naive": "TRL",
    "naive-bf16": "TRL-bf16",
}
"""The TRL run each contender is compared with: the same precision and checkpointing settings
(TRL has no LoRA here, so the LoRA row stands beside TRL's full bf16 fine-tune)."""
DEFAULT_CONTENDERS = {
    "real": "grpo-core,grpo-core-bf16,grpo-core-bf16-gc,grpo-core-lora-bf16,TRL,TRL-bf16,TRL-bf16-gc,naive,naive-bf16",
}
WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_trl_venv() -> Path:
    """benchmarks/.venv-trl with trl==1.16.0 over this interpreter's packages.

    The venv sees this interpreter's site-packages (a .pth file) and installs only what TRL adds:
    TRL runs on the very torch and transformers grpo-core does, and no second torch is downloaded
    (an unpinned one would pull the CUDA build and its GBs of packages). Built under a lock: two
    test workers may ask at once.
    """
    import sysconfig

    import torch
    import transformers

    python = TRL_VENV / "bin" / "python"
    probe = "import trl, torch, transformers; print(trl.__version__, torch.__version__, transformers.__version__)"
    want = f"{TRL_VERSION} {torch.__version__} {transformers.__version__}"

    def built() -> bool:
        out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=False) if python.exists() else None
        return out is not None and out.returncode == 0 and out.stdout.strip() == want

    TRL_VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(TRL_VENV.with_name(TRL_VENV.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if built():
            return python
        log(f"setting up {TRL_VENV} (trl=={TRL_VERSION} over this interpreter's torch {torch.__version__}); once, a minute or two")
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(TRL_VENV)], check=True)
        purelib = subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True)
        base = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
        (Path(purelib.strip()) / "zz-benchmarked-interpreter.pth").write_text("".join(f"{path}\n" for path in base))
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, f"trl=={TRL_VERSION}"], check=True)
        if not built():
            out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=False)
            raise RuntimeError(f"{TRL_VENV} has {out.stdout.strip() or out.stderr.strip()[-500:]}, wanted {want}")
    return python


_BUILT: dict[str, Path] = {}


def prepare(name: str, steps: int, work: Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build the configuration's model (once per process), prompts and dataset; return the spec the workers read."""
    from transformers import AutoTokenizer

    cfg = {**CONFIGS[name], **(overrides or {})}
    if name not in _BUILT:
        _BUILT[name] = build_model(CACHE / "models" / name, name)
    model_dir = _BUILT[name]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    counts = param_counts_of(model_dir)
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


def thread_env(threads: int) -> dict[str, str]:
    """Environment pinning torch's intra-op threads in a worker (0 = torch's default)."""
    if threads <= 0:
        return {}
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


@contextlib.contextmanager
def exclusive(lock: Path | None):
    """Hold an flock(2) on ``lock`` (None: nothing), the lock flock(1) takes, so big runs never overlap."""
    if lock is None:
        yield
        return
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_worker(
    contender: str, spec: dict[str, Any], python: str, threads: int = 0, lock: Path | None = None, nice: int = 0
) -> dict[str, Any]:
    """Run one contender's worker; its result, with ``skipped`` (a reason) when it cannot run that variant."""
    work = Path(spec["work_dir"])
    result_path = work / f"result-{contender}.json"
    log_path = work / f"log-{contender}.txt"
    result_path.unlink(missing_ok=True)
    cmd = [python, str(HERE / WORKERS[contender]), str(work / "spec.json"), str(result_path), *WORKER_ARGS.get(contender, [])]
    with log_path.open("w") as logf, exclusive(lock):
        proc = subprocess.run(
            cmd,
            stdout=logf,
            stderr=subprocess.STDOUT,
            check=False,
            env={**os.environ, **WORKER_ENV, **thread_env(threads)},
            cwd=work,
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )
    if proc.returncode != 0 or not result_path.exists():
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise RuntimeError(f"{contender} failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    result = json.loads(result_path.read_text())
    result["contender"] = contender
    result["timed_steps"] = spec["steps"]
    return result


def median(values: list[float]) -> float:
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else 0.5 * (v[mid - 1] + v[mid])


def check_lengths(result: dict[str, Any], spec: dict[str, Any]) -> None:
    """Every completion of every step (warmup included) has exactly the forced length."""
    B = spec["prompts_per_step"] * spec["group_size"]
    L = spec["completion_tokens"]
    expected = result.get("timed_steps", spec["steps"]) + 1
    if len(result["steps"]) != expected:
        raise RuntimeError(f"{result['contender']}: {len(result['steps'])} steps, expected {expected}")
    for i, step in enumerate(result["steps"], start=1):
        lengths = step["completion_lengths"]
        if len(lengths) != B or set(lengths) != {L}:
            raise RuntimeError(
                f"{result['contender']} step {i}: {len(lengths)} completions of lengths {sorted(set(lengths))}, expected {B} of {L}"
            )


def summarize(results: list[dict[str, Any]], spec: dict[str, Any], peak: float) -> dict[str, Any]:
    """Throughput, MFU and the time split of the median timed step (warmup steps dropped).

    The timed steps of all repeats are pooled; the median step is robust to the other jobs of
    a shared machine, which slow some steps down a lot. ``*_cpu_*``: from the process's CPU
    time per step instead (the median), which does not count time the process waited for a core.
    """
    B = spec["prompts_per_step"] * spec["group_size"]
    L, P = spec["completion_tokens"], spec["prompt_tokens"]
    for result in results:
        check_lengths(result, spec)
    timed = sorted((s for result in results for s in result["steps"][1:]), key=lambda s: s["period"])
    mid = timed[(len(timed) - 1) // 2]  # the median step (the lower one of an even count), split as it ran
    step = mid["period"]
    cpu = median([s["cpu"] for s in timed])
    flops = model_flops(spec["params"]["all"], B, P, L)
    return {
        "contender": results[0]["contender"],
        "completions_per_s": B / step,
        "completions_per_cpu_s": B / cpu,
        "completions_per_s_best": B / timed[0]["period"],
        "tokens_per_s": B * L / step,
        "step_s": step,
        "step_cpu_s": cpu,
        "step_s_min": timed[0]["period"],
        "step_s_max": timed[-1]["period"],
        "timed_steps": len(timed),
        "mfu": (flops["sample"] + flops["train"]) / step / peak,
        "mfu_all": (flops["sample_all"] + flops["train_all"]) / step / peak,
        "sample_mfu": flops["sample_all"] / mid["sample"] / peak,
        "train_mfu": flops["train_all"] / mid["train"] / peak,
        "sample_s": mid["sample"],
        "reward_s": mid["reward"],
        "train_s": mid["train"],
        "other_s": step - mid["sample"] - mid["reward"] - mid["train"],
        "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
        "steps_peak_rss_mb": max(r["steps"][-1].get("peak_rss_mb") or 0.0 for r in results),
        "rss_start_mb": max(r.get("rss_start_mb") or 0.0 for r in results),
        "versions": results[0]["versions"],
    }


def format_table(name: str, spec: dict[str, Any], rows: list[dict[str, Any]], peak: float, runs: str) -> str:
    B = spec["prompts_per_step"] * spec["group_size"]
    n = spec["params"]
    head = (
        f"== {name}: Qwen3 {n['all'] / 1e6:.2f}M params ({n['non_embedding'] / 1e6:.2f}M non-embedding), "
        f"{spec['prompts_per_step']} prompts x G={spec['group_size']} = {B} completions/step, "
        f"prompt {spec['prompt_tokens']} + forced {spec['completion_tokens']} completion tokens; "
        f"{runs} run(s) x timed steps after 1 warmup step each"
    )
    cols = (
        f"{'contender':<20} {'compl/s':>8} {'(best)':>6} {'tok/s':>7} {'step s':>7} {'min-max':>11} {'MFU':>6} {'MFU all':>7} "
        f"{'sample s':>8} {'reward s':>8} {'train s':>7} {'other s':>7} {'smpl MFU':>8} {'trn MFU':>7} {'peak RSS':>9}"
    )
    lines = [head, cols]
    for r in rows:
        lines.append(
            f"{r['contender']:<20} {r['completions_per_s']:>8.3g} {r['completions_per_s_best']:>6.3g} "
            f"{r['tokens_per_s']:>7.0f} {r['step_s']:>7.3f} "
            f"{r['step_s_min']:>5.2f}-{r['step_s_max']:<5.2f} {r['mfu']:>6.1%} {r['mfu_all']:>7.1%} "
            f"{r['sample_s']:>8.3f} {r['reward_s']:>8.3f} {r['train_s']:>7.3f} {r['other_s']:>7.3f} "
            f"{r['sample_mfu']:>8.1%} {r['train_mfu']:>7.1%} {r['peak_rss_mb']:>7.0f}MB"
        )
    return "\n".join(lines)


def format_side_by_side(name: str, results: dict[str, list[dict[str, Any]]], rows: list[dict[str, Any]]) -> str:
    """Every contender beside the TRL run with its precision and checkpointing (``COUNTERPART``)."""
    by = {r["contender"]: r for r in rows}
    lines = [
        f"== {name}, side by side: step s = the median timed step; peak RSS = the worker's maximum resident memory "
        "(steps: at the end of its last step, before any final save); cpu s = the median step's process CPU time "
        "(what a loaded machine disturbs least); x TRL = this row / the TRL row named",
        f"{'contender':<20} {'step s':>7} {'min-max':>11} {'cpu s':>6} {'sample s':>8} {'train s':>7} {'peak RSS':>9} {'(steps)':>8}"
        f"   {'beside':<12} {'step x TRL':>10} {'speed x TRL':>11} {'cpu x TRL':>9} {'RSS x TRL':>9}",
    ]
    for contender, runs in results.items():
        skipped = next((r["skipped"] for r in runs if r.get("skipped")), None)
        if skipped:
            lines.append(f"{contender:<20} not available in this grpo-core ({skipped})")
            continue
        r = by[contender]
        line = (
            f"{contender:<20} {r['step_s']:>7.2f} {r['step_s_min']:>5.1f}-{r['step_s_max']:<5.1f} {r['step_cpu_s']:>6.2f} "
            f"{r['sample_s']:>8.2f} "
            f"{r['train_s']:>7.2f} {r['peak_rss_mb'] / 1024:>6.2f}GiB {r['steps_peak_rss_mb'] / 1024:>5.2f}GiB"
        )
        trl = by.get(COUNTERPART.get(contender, ""))
        if trl is not None:
            line += (
                f"   {trl['contender']:<12} {r['step_s'] / trl['step_s']:>9.2f}x {trl['step_s'] / r['step_s']:>10.2f}x "
                f"{r['step_cpu_s'] / trl['step_cpu_s']:>8.2f}x {r['peak_rss_mb'] / trl['peak_rss_mb']:>8.2f}x"
            )
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config",
        choices=["overhead", "compute", "all", "real"],
        default="all",
        help="all = overhead + compute; real = the Qwen3-0.6B shape, 151,936-row vocabulary (~8-12 GB per contender)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per run, after one warmup step (default: the configuration's, 20 overhead / 5 compute / 3 real)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs per contender, interleaved (grpo-core, TRL, naive, grpo-core, ...); default 3, real 1",
    )
    parser.add_argument(
        "--contenders",
        default=None,
        help=f"comma-separated subset of {','.join(WORKERS)} (grpo-core-hf: grpo-core on transformers' own forward); "
        f"default grpo-core,TRL,naive, on real {DEFAULT_CONTENDERS['real']}",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for every contender and the matmul probe (default 1: the machine is shared; 0 = torch's default, all cores)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write every number to this file")
    parser.add_argument(
        "--lock",
        type=Path,
        default=None,
        help="hold an exclusive flock on this file while a model is built and while each worker runs "
        "(the lock flock(1) takes: big jobs sharing a machine take turns)",
    )
    parser.add_argument("--nice", type=int, default=0, help="run every worker under this niceness increment")
    parser.add_argument(
        "--report",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="run nothing: print the tables of runs saved with --json again (several: their contenders merged)",
    )
    args = parser.parse_args(argv)
    if args.report:
        return merged_report(args.report)
    chosen = args.contenders or DEFAULT_CONTENDERS.get(args.config, "grpo-core,TRL,naive")
    contenders = [c.strip() for c in chosen.split(",") if c.strip()]
    unknown = set(contenders) - set(WORKERS)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)}; choose from {list(WORKERS)}")
    names = ["overhead", "compute"] if args.config == "all" else [args.config]

    pythons = {c: sys.executable for c in contenders}
    if any(WORKERS[c] == "run_trl.py" for c in contenders):
        trl_python = str(ensure_trl_venv())
        pythons.update({c: trl_python for c in contenders if WORKERS[c] == "run_trl.py"})

    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    log("matmul probe ...")
    probes = [matmul_peak()]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    raw: dict[str, Any] = {}
    for name in names:
        with exclusive(args.lock):
            spec = prepare(name, args.steps or CONFIGS[name]["timed_steps"], CACHE / "work" / stamp / name)
        raw[name] = {"spec": {k: v for k, v in spec.items() if k != "prompts"}, "results": {c: [] for c in contenders}}
        repeats = args.repeats or CONFIGS[name].get("repeats", 3)
        for repeat in range(repeats):
            for contender in contenders:
                if any(r.get("skipped") for r in raw[name]["results"][contender]):
                    continue
                log(f"{name}: {contender} run {repeat + 1}/{repeats} ...")
                t = time.perf_counter()
                result = run_worker(contender, spec, pythons[contender], args.threads, args.lock, args.nice)
                raw[name]["results"][contender].append(result)
                if args.json:  # so far: an interrupted run can still be reported (--report)
                    args.json.write_text(json.dumps({"probes": probes, "raw": raw, "complete": False}, indent=2))
                if result.get("skipped"):
                    log(f"{name}: {contender} skipped: not available in this grpo-core ({result['skipped']})")
                    continue
                check_lengths(result, spec)
                log(f"{name}: {contender} run {repeat + 1}/{repeats} done in {time.perf_counter() - t:.0f}s")
        probes.append(matmul_peak())
    summary = report(raw, probes)
    if args.json:
        peak = max(p["peak_flops"] for p in probes)
        saved = {"peak_flops": peak, "probes": probes, "summary": summary, "raw": raw, "complete": True}
        args.json.write_text(json.dumps(saved, indent=2))
    return 0


def merged_report(paths: list[Path]) -> int:
    """Print the tables of runs saved with ``--json`` again, their contenders merged per configuration.

    A ratio compares two contenders of the same run only where one file holds both. An
    interrupted run's file holds the contenders that finished.
    """
    raw: dict[str, Any] = {}
    probes: list[dict[str, float]] = []
    for path in paths:
        saved = json.loads(path.read_text())
        if not saved["complete"]:
            log(f"{path}: an interrupted run (the runs that finished)")
        probes += saved["probes"]
        for name, part in saved["raw"].items():
            into = raw.setdefault(name, {"spec": part["spec"], "results": {}})
            for contender, runs in part["results"].items():
                for result in runs:
                    result.setdefault("timed_steps", part["spec"]["steps"])
                if runs:
                    into["results"][contender] = runs
    report(raw, probes)
    return 0


def report(raw: dict[str, Any], probes: list[dict[str, float]]) -> dict[str, Any]:
    """Print the tables and ratios of ``raw`` (per configuration: the spec and each contender's results); return the rows."""
    peak = max(p["peak_flops"] for p in probes)
    tables, ratios, summary = [], [], {}
    for name in raw:
        spec = raw[name]["spec"]
        results = raw[name]["results"]
        contenders = list(results)
        rows = [summarize(results[c], spec, peak) for c in contenders if not any(r.get("skipped") for r in results[c])]
        summary[name] = rows
        shapes = sorted({f"{len(runs)} x {runs[0].get('timed_steps', spec['steps'])}" for runs in results.values()})
        tables.append(format_table(name, spec, rows, peak, " or ".join(shapes)))
        if any(c in COUNTERPART for c in contenders) and any(c.startswith("TRL") for c in contenders):
            tables.append(format_side_by_side(name, results, rows))
        by = {r["contender"]: r for r in rows}
        if "grpo-core" in by:
            for other in ("TRL", "naive", "grpo-core-hf"):
                if other in by:
                    wall = by["grpo-core"]["completions_per_s"] / by[other]["completions_per_s"]
                    best = by["grpo-core"]["completions_per_s_best"] / by[other]["completions_per_s_best"]
                    ratios.append(f"{name}: grpo-core/{other} completions/s = {wall:.2f}x  (best steps: {best:.2f}x)")

    print(
        f"machine: {os.cpu_count()} CPUs, torch {probes[0]['threads']} thread(s); fp32 matmul peak {peak / 1e9:.1f} GFLOP/s "
        f"(2048^3, best of 10, probed {len(probes)} times: " + ", ".join(f"{p['peak_flops'] / 1e9:.1f}" for p in probes) + ")"
    )
    print("Per contender: the median timed step of all runs (min-max of all timed steps beside it), split into phases as that step ran;")
    print(
        "compl/s and tok/s = one step's completions and generated tokens / the median step; (best): completions / the fastest timed step."
    )
    print("MFU: (2N per generated token + 6N per trained completion token) / median step / peak, N = all parameters (tied embedding once).")
    print("MFU all: counting every position the model runs on (prompt prefill, forward/backward over prompt + completion);")
    print(
        "smpl MFU / trn MFU: the same 'all' FLOPs of that phase / the phase's median time. "
        "Every completion of every step had exactly the forced length (checked)."
    )
    for table in tables:
        print()
        print(table)
    print()
    for line in ratios:
        print(line)
    return summary


if __name__ == "__main__":
    sys.exit(main())
