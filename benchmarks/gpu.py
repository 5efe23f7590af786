"""grpo-core side by side with TRL's GRPOTrainer on a GPU, at Qwen3 shapes.

    python benchmarks/gpu.py [--shape 0.6b,1.7b,4b,8b|all] [--workload short,long|all] [--out FILE]
    python benchmarks/gpu.py --device cpu --shape tiny    # both contenders on a CPU, under a minute
    python benchmarks/gpu.py --report FILE                # print a saved (or interrupted) run's table again
    python benchmarks/gpu.py --contenders grpo-core --workload short,unforced --profile   # + a kernel table per phase

The default set (Qwen3-0.6B shape, short workload: grpo-core, grpo-core with gradient
checkpointing, TRL, TRL with colocated vLLM where vLLM is importable) finishes in under 8 minutes
on one H100 or H200, model build included. See benchmarks/README.md ("GPU") for what is measured.

Models are Qwen3 shapes with Qwen's 151,936-row vocabulary and random weights, built here from a
config (nothing is downloaded). Their eos token has no logit (bench_common.build_model), so every
completion of every contender runs to the forced length; that is checked on every step. The
``unforced`` workload gives lengths back to the model: about ln 2 / 256 of the vocabulary stops a
completion (the model's generation_config lists them as eos, which every contender honours), so
with a random model's near-uniform draws lengths spread geometrically and about half the rows end
before the 256th token, the long tail that batch buckets serve.

``--profile`` runs torch.profiler over the last timed step of each grpo-core contender, one profile
per phase (sampling: the rollouts and the benchmark's reward; training: ``train_on_groups``), and
prints per phase the kernels' count and device time (on a CPU: operators and their self time), per
decode step where the sampler counts its steps, and the top kernels. One of three timed steps
carries the profiler's overhead; the table's median step is another.
Each contender runs in its own process under its own time limit; --out is rewritten after each,
so an interrupted run keeps what finished.

grpo-core runs as a user runs it: ``grpo-core run --model FOLDER ...`` (the CLI, in a process of its
own), its times read from the run's metrics.jsonl; the benchmark's reward and a logger that
records each step's completion lengths and peak memory are plugins of a throwaway distribution.
The run is ended once its last step is recorded: the end-of-run checkpoint (policy and AdamW
state, ~100 GB at 8B) is not measured and would not fit the GPU machine's disk.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import attrs
from bench_common import CACHE, CONFIGS, matmul_peak, peak_rss_mb
from run import WORKER_ENV, check_lengths, ensure_trl_venv, log, prepare, summarize, thread_env
from run_grpo_core import register_plugins

from grpo_core import hookimpl, option

QWEN3_VOCAB = 151936
MAX_POSITIONS = 4096
"""The built models' context: room for the long workload (32 + 2048 tokens); vLLM sizes its KV cache by it."""
SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3's published configurations (head_dim 128; 0.6B-4B tie the LM head to the embedding).
    "0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8},
    "1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8},
    "4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8},
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
}
# bench_common.build_model builds what CONFIGS names: the GPU shapes join it under gpu-*.
for _shape, _model in SHAPES.items():
    CONFIGS[f"gpu-{_shape}"] = {"model": {**_model, "head_dim": 128, "max_position_embeddings": MAX_POSITIONS}, "vocab_size": QWEN3_VOCAB}
# tiny: the CPU benchmark's overhead model (0.85M parameters, 512-row vocabulary), for a CPU smoke run.
CONFIGS["gpu-tiny"] = {"model": CONFIGS["overhead"]["model"]}
WORKLOADS: dict[str, dict[str, int]] = {
    "short": {"prompts_per_step": 8, "group_size": 8, "prompt_tokens": 32, "completion_tokens": 256},
    "long": {"prompts_per_step": 4, "group_size": 8, "prompt_tokens": 32, "completion_tokens": 2048},
    "tiny": {"prompts_per_step": 2, "group_size": 4, "prompt_tokens": 16, "completion_tokens": 16},
    "unforced": {"prompts_per_step": 8, "group_size": 8, "prompt_tokens": 32, "completion_tokens": 256},
    "tiny-unforced": {"prompts_per_step": 2, "group_size": 4, "prompt_tokens": 16, "completion_tokens": 16},
}
UNFORCED = {"unforced", "tiny-unforced"}
"""Workloads whose completions end where the model draws one of its stop tokens."""
CONTENDERS: dict[str, tuple[str, list[str]]] = {
    "grpo-core": ("grpo-core", []),  # its defaults: bf16 on CUDA
    "grpo-core-gc": ("grpo-core", ["--gradient-checkpointing"]),
    "grpo-core-no-gc": ("grpo-core", ["--no-gradient-checkpointing"]),
    # The stochastic-rounding AdamW's eager kernel (buffers and a noise table) against its compiled default on CUDA.
    "grpo-core-eager-optimizer": ("grpo-core", ["--backend-opt", "optimizer_kernel=eager"]),
    # Each decoder layer compiled (off by default: not measured on a GPU yet).
    "grpo-core-compile": ("grpo-core", ["--backend-opt", "compile=true"]),
    # TRL's defaults: fp32 weights and AdamW state under bf16 autocast, gradient checkpointing, generate
    "TRL": ("trl", ["--bf16", "--gradient-checkpointing"]),
    "TRL-vllm": ("trl", ["--bf16", "--gradient-checkpointing", "--vllm-colocate"]),
    # A vLLM engine in grpo-core's process, weights loaded from memory, asleep while training.
    "grpo-core+vllm": ("grpo-core", ["--sampler", "vllm"]),
}
DEFAULT_CONTENDERS = {"cuda": "grpo-core,TRL,grpo-core-gc,TRL-vllm,grpo-core+vllm", "cpu": "grpo-core,TRL"}
"""On a CPU, where the tiny run is a smoke test of both contenders, the GPU variants are left out."""
BASELINE = "TRL"
"""The row every ratio is taken against."""
PLUGIN_ENTRY_POINTS = """[grpo_core]
logger.bench_gpu_probe = gpu:StepProbe
logger.bench_gpu_profile = gpu:StepProfile
"""
PROFILE_TOP = 12
"""Kernels listed per phase in a profile's table."""


@attrs.define
class StepProbe:
    """grpo-core logger plugin: appends one JSON line per step to ``path``, with what metrics.jsonl
    does not hold: the completion lengths, the process's CPU time and its peak host memory so far.

    The GPU peak is the run's own ``perf/peak_memory_gib`` (engine/perf.py: max_memory_allocated
    over the step, then reset), not ``max_memory_allocated`` read here: by the time a logger runs
    the engine has reset it, so that read would be the memory resident since, not the peak. The max
    over steps is the peak since the process began, what run_trl.py reads (it never resets)."""

    path: str = option(help="JSONL file to append to")

    @hookimpl
    def on_step(self, step: int, metrics: dict[str, float], state: Any, groups: Any) -> None:
        if step == 0:  # the initial evaluation's record (--eval-every): no training step
            return
        import torch
        import transformers

        import grpo_core

        record = {
            "step": step,
            "cpu": time.process_time(),
            "completion_lengths": [s.num_completion_tokens for group in groups for s in group],
            "peak_rss_mb": peak_rss_mb(),
            "peak_gpu_gib": metrics.get("perf/peak_memory_gib") if torch.cuda.is_initialized() else None,
            "versions": {"grpo_core": grpo_core.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def kernel_table(profile: Any) -> dict[str, Any]:
    """A torch.profiler run as one phase's table: CUDA kernels where any ran (else CPU operators),
    their count and self time, and the top :data:`PROFILE_TOP` by time."""
    from torch.autograd import DeviceType

    events = list(profile.events())
    on_device = [e for e in events if e.device_type == DeviceType.CUDA]
    kind = "CUDA kernels" if on_device else "CPU operators"
    table: dict[str, list[float]] = {}
    for event in on_device or [e for e in events if e.device_type == DeviceType.CPU]:
        entry = table.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += event.self_device_time_total if on_device else event.self_cpu_time_total
    top = sorted(table.items(), key=lambda item: -item[1][1])[:PROFILE_TOP]
    return {
        "kind": kind,
        "count": int(sum(count for count, _ in table.values())),
        "ms": sum(us for _, us in table.values()) / 1000.0,
        "top": [{"name": name, "count": int(count), "ms": us / 1000.0} for name, (count, us) in top],
    }


@attrs.define
class StepProfile:
    """grpo-core logger plugin: torch.profiler over each phase of step ``step`` (sampling: the
    rollouts and rewards; training: ``train_on_groups``), one kernel table per phase written to
    ``path`` as JSON, with the sampler's decode steps in that phase where it counts them."""

    path: str = option(help="JSON file to write")
    step: int = option(2, help="the optimizer step to profile (1 = the first)")

    @hookimpl
    def on_run_start(self, config: Any, run_dir: Any, total_steps: Any, start_step: int) -> None:
        from grpo_core import loop, stages

        tables: dict[str, Any] = {"step": self.step}
        loop.roll_and_score = self._profiled(loop.roll_and_score, "sampling", tables, sampler_at=3)
        stages.train_on_groups = self._profiled(stages.train_on_groups, "training", tables)

    def _profiled(self, phase: Any, name: str, tables: dict[str, Any], sampler_at: int | None = None) -> Any:
        calls = {"n": 0}

        def run(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] != self.step:
                return phase(*args, **kwargs)
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            sampler = args[sampler_at] if sampler_at is not None else None
            before = getattr(sampler, "decode_steps", None)
            with torch.profiler.profile(activities=activities) as profile:
                result = phase(*args, **kwargs)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            tables[name] = kernel_table(profile)
            if before is not None:
                tables[name]["decode_steps"] = sampler.decode_steps - before
            Path(self.path).write_text(json.dumps(tables, indent=2))
            return result

        return run


def format_profile(contender: str, profile: dict[str, Any]) -> list[str]:
    lines = [f"profile of {contender}, step {profile['step']}:"]
    for phase in ("sampling", "training"):
        table = profile.get(phase)
        if table is None:
            lines.append(f"  {phase}: not profiled")
            continue
        per_step = ""
        if table.get("decode_steps"):
            n = table["decode_steps"]
            per_step = f"; per decode step {table['count'] / n:.0f} {table['kind']}, {table['ms'] / n:.3f} ms ({n} decode steps)"
        lines.append(f"  {phase}: {table['count']} {table['kind']}, {table['ms']:.1f} ms{per_step}")
        lines += [f"    {row['ms']:>9.2f} ms {row['count']:>7}x  {row['name'][:90]}" for row in table["top"]]
    return lines


def jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete records of a JSONL file another process may be writing (a half-written last line is left out)."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def matmul_probe(device: str) -> dict[str, Any]:
    """The rate every MFU is measured against: bf16 8192^3 matmuls on CUDA (best of 10), fp32 1024^3 on a
    CPU (a smoke run's: 2048^3 would take seconds of it on a loaded CPU)."""
    if device == "cpu":
        return {"flops": matmul_peak(n=1024)["peak_flops"], "what": "fp32 1024^3 torch.mm, best of 10"}
    import torch

    n = 8192
    a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    for _ in range(3):
        torch.mm(a, b, out=c)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b, out=c)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    del a, b, c
    torch.cuda.empty_cache()
    return {"flops": 2.0 * n**3 / min(times), "what": "bf16 8192^3 torch.mm, best of 10"}


def build(shape: str, workload: str, steps: int, device: str, work: Path) -> dict[str, Any]:
    """The spec the contenders read (``run.prepare``); on CUDA the random model is made on the GPU in
    bf16 (seconds, where an 8B fp32 init on the CPU takes minutes and twice the disk)."""
    if device == "cpu":
        spec = prepare(f"gpu-{shape}", steps, work, WORKLOADS[workload])
    else:
        import torch

        dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                spec = prepare(f"gpu-{shape}", steps, work, WORKLOADS[workload])
        finally:
            torch.set_default_dtype(dtype)
            torch.cuda.empty_cache()
    if workload in UNFORCED:
        spec["model_dir"] = str(unforced_model(Path(spec["model_dir"]), work / "model-unforced", spec["completion_tokens"]))
        spec["unforced"] = True
        (work / "spec.json").write_text(json.dumps(spec, indent=2))
    return spec


def unforced_model(model_dir: Path, out: Path, length: int) -> Path:
    """The model of ``model_dir`` (its files linked, not copied) with about ln 2 / ``length`` of its
    vocabulary as eos in its generation_config: on near-uniform draws about half the completions
    end before ``length`` tokens, at geometric lengths."""
    import math

    out.mkdir(parents=True, exist_ok=True)
    for source in model_dir.iterdir():
        target = out / source.name
        if source.name != "generation_config.json" and not target.exists():
            target.symlink_to(source.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    stops = max(1, round(vocab * math.log(2) / length))
    generation = json.loads((model_dir / "generation_config.json").read_text()) if (model_dir / "generation_config.json").exists() else {}
    eos = generation.get("eos_token_id", config.get("eos_token_id"))
    eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
    generation["eos_token_id"] = eos + list(range(7, vocab, vocab // stops))[:stops]
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out


def check_unforced_lengths(result: dict[str, Any], spec: dict[str, Any]) -> None:
    """Every step has its B completions, each of 1 to the workload's length tokens."""
    B, L = spec["prompts_per_step"] * spec["group_size"], spec["completion_tokens"]
    for i, step in enumerate(result["steps"], start=1):
        lengths = step["completion_lengths"]
        if len(lengths) != B or not all(1 <= n <= L for n in lengths):
            raise RuntimeError(f"{result['contender']} step {i}: {len(lengths)} completions of lengths {sorted(set(lengths))}")


def launch(cmd: list[str], env: dict[str, str], cwd: Path, log_path: Path, limit: float, done: Any = None) -> tuple[str, int | None]:
    """Run ``cmd`` in a process group of its own, its output to ``log_path``, for at most ``limit`` seconds.

    ``done()`` (optional) is asked twice a second; once true the group is killed and the run counts
    as finished. Returns ("finished" | "exited" | "timed out", the exit code or None).
    """
    deadline = time.monotonic() + limit
    with log_path.open("w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                return "exited", rc
            except subprocess.TimeoutExpired:
                pass
            finished = done is not None and done()
            if finished or time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return ("finished" if finished else "timed out"), None


def log_tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def grpo_core_command(
    spec: dict[str, Any], flags: list[str], device: str, threads: int, run_dir: Path, probe: Path, profile: Path | None = None
) -> list[str]:
    """``grpo-core run`` with the spec's model, prompts and step shape (the console script's own entry point)."""
    cmd = [sys.executable, "-c", "from grpo_core.cli import main; main()", "run"]
    cmd += ["--model", spec["model_dir"], "--dataset", spec["dataset"], "--prompt-template", "{prompt}", "--no-shuffle"]
    cmd += ["--max-steps", str(spec["steps"] + 1), "--prompt-groups-per-step", str(spec["prompts_per_step"])]
    cmd += ["--completions-per-prompt", str(spec["group_size"]), "--max-completion-tokens", str(spec["completion_tokens"])]
    cmd += ["--temperature", "1.0", "--learning-rate", str(spec["learning_rate"]), "--no-drop-zero-variance-groups"]
    cmd += ["--loss-opt", "grpo.kl_beta=0", "--reward", "bench_chars"]
    cmd += ["--logger", "console", "--logger", "jsonl", "--logger", "bench_gpu_probe", "--logger-opt", f"bench_gpu_probe.path={probe}"]
    cmd += ["--device", device, "--seed", str(spec["seed"]), "--checkpoint-every", "0", "--run-dir", str(run_dir), "--overwrite"]
    if threads > 0:
        cmd += ["--threads", str(threads)]
    if profile is not None:  # the last timed step
        cmd += ["--logger", "bench_gpu_profile", "--logger-opt", f"bench_gpu_profile.path={profile}"]
        cmd += ["--logger-opt", f"bench_gpu_profile.step={spec['steps'] + 1}"]
    return cmd + flags


def run_grpo_core(
    spec: dict[str, Any], name: str, flags: list[str], device: str, threads: int, limit: float, profile: bool = False
) -> dict[str, Any]:
    work = Path(spec["work_dir"])
    site = work / "plugins"
    register_plugins(site)  # reward.bench_chars (and the CPU benchmark's timer)
    dist = site / "grpo_core_gpu_bench-0.0.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: grpo-core-gpu-bench\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(PLUGIN_ENTRY_POINTS)
    run_dir, probe, log_path = work / f"run-{name}", work / f"probe-{name}.jsonl", work / f"log-{name}.txt"
    probe.unlink(missing_ok=True)
    profile_path = work / f"profile-{name}.json" if profile else None
    if profile_path is not None:
        profile_path.unlink(missing_ok=True)
    total = spec["steps"] + 1
    env = {**os.environ, **WORKER_ENV, **thread_env(threads)}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])

    def done() -> bool:
        return len(jsonl(probe)) >= total and len([m for m in jsonl(run_dir / "metrics.jsonl") if m["step"] >= 1]) >= total

    command = grpo_core_command(spec, flags, device, threads, run_dir, probe, profile_path)
    how, rc = launch(command, env, work, log_path, limit, done)
    metrics = [m for m in jsonl(run_dir / "metrics.jsonl") if m["step"] >= 1]
    records = jsonl(probe)
    shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints of a big model fill the disk
    if how != "finished" and not (how == "exited" and rc == 0 and len(records) >= total):
        return failure(how, rc, limit, log_path)
    steps, prev_cpu = [], 0.0
    for m, r in zip(metrics, records):
        steps.append(
            {
                "period": m["time/step"],
                "cpu": r["cpu"] - prev_cpu,
                "sample": m["time/sample"],
                "reward": m["time/reward"],
                "train": m["time/train"],
                "completion_lengths": r["completion_lengths"],
                "peak_rss_mb": r["peak_rss_mb"],
                "peak_gpu_gib": r["peak_gpu_gib"],
                "metrics": m,
            }
        )
        prev_cpu = r["cpu"]
    result = {"steps": steps, "peak_rss_mb": max(r["peak_rss_mb"] for r in records), "versions": records[-1]["versions"]}
    if profile_path is not None and profile_path.exists():
        result["profile"] = json.loads(profile_path.read_text())
    return result


def run_trl(spec: dict[str, Any], name: str, flags: list[str], device: str, threads: int, limit: float, python: str) -> dict[str, Any]:
    work = Path(spec["work_dir"])
    result_path, log_path = work / f"result-{name}.json", work / f"log-{name}.txt"
    result_path.unlink(missing_ok=True)
    cmd = [python, str(HERE / "run_trl.py"), str(work / "spec.json"), str(result_path), *flags, "--device", device]
    how, rc = launch(cmd, {**os.environ, **WORKER_ENV, **thread_env(threads)}, work, log_path, limit)
    if how != "exited" or rc != 0 or not result_path.exists():
        return failure(how, rc, limit, log_path)
    return json.loads(result_path.read_text())


def failure(how: str, rc: int | None, limit: float, log_path: Path) -> dict[str, Any]:
    if how == "timed out":
        return {"status": "timed out", "reason": f"over its limit of {limit:.0f} s (log {log_path})", "log_tail": log_tail(log_path)}
    tail = log_tail(log_path)
    oom = "out of memory" in tail.lower()
    reason = "out of GPU memory" if oom else f"exit {rc}"
    return {"status": "failed", "reason": f"{reason} (log {log_path})", "log_tail": tail}


def trl_interpreter(device: str) -> tuple[str | None, str | None]:
    """The Python that runs TRL, or None and why not: this one where trl imports; on a CPU
    benchmarks/.venv-trl (run.py's, set up on first use); on CUDA nothing is installed."""
    if importlib.util.find_spec("trl") is not None:
        return sys.executable, None
    if device == "cuda":
        return None, f"trl is not importable by {sys.executable} (pip install trl)"
    try:
        return str(ensure_trl_venv()), None
    except (OSError, subprocess.CalledProcessError, RuntimeError) as exc:
        return None, f"trl is not importable here and {HERE / '.venv-trl'} could not be set up ({exc})"


def vllm_missing(python: str, device: str) -> str | None:
    if device != "cuda":
        return "vLLM colocate needs --device cuda"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    if subprocess.run([python, "-c", probe], check=False).returncode != 0:
        return f"vllm is not importable by {python}"
    return None


def row_of(spec: dict[str, Any], contender: str, result: dict[str, Any], flops: float, device: str) -> dict[str, Any]:
    """One table row: ``run.summarize``'s median timed step, plus the GPU columns."""
    result = {**result, "contender": contender, "timed_steps": spec["steps"]}
    timed = result["steps"][1:]
    decode_steps = spec["completion_tokens"]
    if spec.get("unforced"):
        # The batch decodes until its longest completion ends; MFU counts the mean completion, as
        # summarize (which checks forced lengths: these were checked by check_unforced_lengths) reads it.
        decode_steps = sum(max(s["completion_lengths"]) for s in timed) / len(timed)
        mean = sum(sum(s["completion_lengths"]) / len(s["completion_lengths"]) for s in timed) / len(timed)
        spec = {**spec, "completion_tokens": mean}
        result["steps"] = [{**s, "completion_lengths": [mean] * len(s["completion_lengths"])} for s in result["steps"]]
    s = summarize([result], spec, flops)
    gpu_peaks = [step["peak_gpu_gib"] for step in result["steps"] if step.get("peak_gpu_gib") is not None]
    # grpo-core's local sampler says how many cache slots its decode attention read per step.
    widths = [m["perf/decode_attended_per_step"] for step in timed if "perf/decode_attended_per_step" in (m := step.get("metrics", {}))]
    return {
        "step_s": s["step_s"],
        "sample_s": s["sample_s"],
        "decode_ms_per_step": 1000.0 * s["sample_s"] / decode_steps,
        "train_s": s["train_s"],
        "train_mfu": s["train_mfu"],
        "peak_gib": max(gpu_peaks) if device == "cuda" else s["peak_rss_mb"] / 1024.0,
        "step_s_min": s["step_s_min"],
        "step_s_max": s["step_s_max"],
        "tokens_per_s": s["tokens_per_s"],
        "versions": s["versions"],
        "attended_per_step": statistics.median(widths) if widths else None,
    }


def describe(spec: dict[str, Any]) -> str:
    n = spec["params"]
    return (
        f"{spec['shape']} shape ({n['all'] / 1e6:.1f}M params), {spec['workload']}: {spec['prompts_per_step']} prompts x "
        f"G={spec['group_size']}, prompt {spec['prompt_tokens']} + "
        f"{'at most' if spec.get('unforced') else 'forced'} {spec['completion_tokens']} tokens; "
        f"median of {spec['steps']} timed steps after 1 warmup"
    )


def format_report(saved: dict[str, Any]) -> str:
    memory = (
        "GPU: the largest step peak, perf/peak_memory_gib (TRL: max_memory_allocated, never reset)"
        if saved["device"] == "cuda"
        else "CPU: the process's peak RSS"
    )
    lines = [
        f"device: {saved['device_name']}; {saved['date']}; "
        f"matmul probe {saved['probe']['flops'] / 1e12:.4g} TFLOP/s ({saved['probe']['what']})",
        "step/sampling/training s: the median timed step's and its phases; ms/decode = sampling s / completion tokens "
        "(unforced: the longest completion's; prefill included); train MFU = 6*N*(prompt+completion-1) tokens / training s / the probe; "
        f"peak GiB ({memory}); x TRL = this row / the TRL row (< 1: faster, less memory)",
    ]
    cols = (
        f"{'contender':<16} {'step s':>7} {'sampling s':>10} {'ms/decode':>9} {'training s':>10} {'train MFU':>9} {'peak GiB':>8}"
        f" {'step x':>7} {'sampl x':>7} {'train x':>7} {'mem x':>6}"
    )
    versions: dict[str, str] = {}
    for r in saved["runs"]:
        versions.update(r.get("row", {}).get("versions", {}))
    if versions:
        lines.insert(1, "versions: " + ", ".join(f"{name} {version}" for name, version in sorted(versions.items())))
    for key, spec in saved["specs"].items():
        runs = [r for r in saved["runs"] if r["key"] == key]
        base = next((r["row"] for r in runs if r["contender"] == BASELINE and r["status"] == "ok"), None)
        lines += ["", f"== {describe(spec)}", cols]
        for r in runs:
            if r["status"] != "ok":
                lines.append(f"{r['contender']:<16} {r['status']}: {r['reason']}")
                continue
            row = r["row"]
            line = (
                f"{r['contender']:<16} {row['step_s']:>7.2f} {row['sample_s']:>10.2f} {row['decode_ms_per_step']:>9.1f} "
                f"{row['train_s']:>10.2f} {row['train_mfu']:>9.1%} {row['peak_gib']:>8.2f}"
            )
            if base is not None:
                line += (
                    f" {row['step_s'] / base['step_s']:>6.2f}x {row['sample_s'] / base['sample_s']:>6.2f}x "
                    f"{row['train_s'] / base['train_s']:>6.2f}x {row['peak_gib'] / base['peak_gib']:>5.2f}x"
                )
            lines.append(line)
        for r in runs:
            if r["status"] == "ok" and r["row"].get("attended_per_step") is not None:
                lines.append(
                    f"{r['contender']}: decode attention read {r['row']['attended_per_step']:.0f} cache slots per step (median step's mean)"
                )
        for r in runs:
            if r["status"] == "ok" and "profile" in r.get("result", {}):
                lines += format_profile(r["contender"], r["result"]["profile"])
    if not saved["complete"]:
        lines += ["", "(an interrupted run: the contenders that finished)"]
    return "\n".join(lines)


def choose(value: str, known: dict[str, Any], every: list[str], what: str, parser: argparse.ArgumentParser) -> list[str]:
    names = every if value == "all" else [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        parser.error(f"--{what} {value!r}: unknown {unknown}; choose from {', '.join(known)} (comma-separated) or all")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda", help="cuda (default) or cpu (the tiny shape is the one for a CPU)"
    )
    parser.add_argument(
        "--shape", default="0.6b", help="Qwen3 shapes, comma-separated: 0.6b, 1.7b, 4b, 8b, all (those four), tiny (a CPU smoke run)"
    )
    parser.add_argument(
        "--workload",
        default=None,
        help="short (8x8x256), long (4x8x2048), unforced (8x8, at most 256, lengths the model's), all (those three), "
        "tiny (2x4x16), tiny-unforced; default short, tiny for --shape tiny",
    )
    parser.add_argument(
        "--contenders",
        default=None,
        help=f"comma-separated, of {', '.join(CONTENDERS)} (default {DEFAULT_CONTENDERS['cuda']}; on a CPU {DEFAULT_CONTENDERS['cpu']})",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contender, after one warmup step (default 3)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds each contender may run, model load included (default 300)")
    parser.add_argument(
        "--budget",
        type=float,
        default=480.0,
        help="seconds for the whole benchmark (default 480, a short GPU lease); "
        "contenders that would start later are not run. 0 = no limit",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads per contender (default 0: torch's own choice)")
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON file, rewritten after each contender (default benchmarks/.cache/gpu/TIME.json)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="torch.profiler over each grpo-core contender's last timed step: a kernel table per phase"
    )
    parser.add_argument("--report", type=Path, default=None, metavar="JSON", help="run nothing: print the table of a saved run again")
    args = parser.parse_args(argv)
    if args.report:
        print(format_report(json.loads(args.report.read_text())))
        return 0
    shapes = choose(args.shape, {**SHAPES, "tiny": None}, list(SHAPES), "shape", parser)
    workloads = choose(
        args.workload or ("tiny" if shapes == ["tiny"] else "short"), WORKLOADS, ["short", "long", "unforced"], "workload", parser
    )
    contenders = choose(args.contenders or DEFAULT_CONTENDERS[args.device], CONTENDERS, list(CONTENDERS), "contenders", parser)
    if args.steps < 1 or args.timeout <= 0 or args.budget < 0:
        parser.error("--steps and --timeout must be positive, --budget at least 0")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA device; on a CPU run --device cpu --shape tiny")
    started = time.monotonic()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or CACHE / "gpu" / f"{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    work_root = CACHE / "gpu-work" / stamp

    trl_python, trl_missing = (None, None)
    if any(CONTENDERS[c][0] == "trl" for c in contenders):
        trl_python, trl_missing = trl_interpreter(args.device)
    vllm_reason = vllm_missing(trl_python, args.device) if trl_python and "TRL-vllm" in contenders else None
    engine_reason = None
    if "grpo-core+vllm" in contenders and importlib.util.find_spec("vllm") is None:
        engine_reason = f'vllm is not importable by {sys.executable} (pip install "grpo-core[vllm]")'

    log("matmul probe ...")
    probe = matmul_probe(args.device)
    device_name = (
        torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    )
    saved: dict[str, Any] = {
        "device": args.device,
        "device_name": device_name,
        "date": time.strftime("%Y-%m-%d"),
        "probe": probe,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "specs": {},
        "runs": [],
        "complete": False,
    }

    def save() -> None:
        out.write_text(json.dumps(saved, indent=2))

    for shape in shapes:
        for workload in workloads:
            key = f"{shape}/{workload}"
            t = time.monotonic()
            log(f"{key}: building the model and prompts ...")
            spec = build(shape, workload, args.steps, args.device, work_root / shape / workload)
            spec_saved = {k: v for k, v in spec.items() if k != "prompts"}
            saved["specs"][key] = {**spec_saved, "shape": f"Qwen3-{shape}" if shape != "tiny" else "tiny Qwen3", "workload": workload}
            saved["specs"][key]["build_s"] = time.monotonic() - t
            for contender in contenders:
                kind, flags = CONTENDERS[contender]
                entry: dict[str, Any] = {"key": key, "contender": contender}
                left = args.budget - (time.monotonic() - started) if args.budget else float("inf")
                skip = trl_missing if kind == "trl" else None
                skip = skip or (vllm_reason if contender == "TRL-vllm" else None)
                skip = skip or (engine_reason if contender == "grpo-core+vllm" else None)
                if skip:
                    entry.update(status="skipped", reason=skip)
                elif left < 30:
                    entry.update(status="not run", reason=f"the --budget of {args.budget:.0f} s was spent")
                else:
                    limit = min(args.timeout, left)
                    log(f"{key}: {contender} (limit {limit:.0f} s) ...")
                    t = time.monotonic()
                    if kind == "grpo-core":
                        result = run_grpo_core(spec, contender, flags, args.device, args.threads, limit, args.profile)
                    else:
                        result = run_trl(spec, contender, flags, args.device, args.threads, limit, trl_python)
                    entry["wall_s"] = time.monotonic() - t
                    if "status" in result:
                        entry.update(result)
                        log(f"{key}: {contender} {result['status']}: {result['reason']}\n{result['log_tail']}")
                    else:
                        try:
                            check = check_unforced_lengths if spec.get("unforced") else check_lengths
                            check({**result, "contender": contender, "timed_steps": args.steps}, spec)
                        except RuntimeError as exc:
                            entry.update(status="failed", reason=str(exc), result=result)
                        else:
                            entry.update(status="ok", row=row_of(spec, contender, result, probe["flops"], args.device), result=result)
                        log(f"{key}: {contender} {entry['status']} in {entry['wall_s']:.0f} s")
                if entry["status"] in ("skipped", "not run"):
                    log(f"{key}: {contender} {entry['status']}: {entry['reason']}")
                saved["runs"].append(entry)
                save()
    saved["complete"] = True
    saved["total_s"] = time.monotonic() - started
    save()
    print(format_report(saved))
    print(f"\n{len(saved['runs'])} contender runs in {saved['total_s']:.0f} s; JSON: {out}")
    return 0 if all(r["status"] in ("ok", "skipped", "not run") for r in saved["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
