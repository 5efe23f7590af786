"""Benchmark worker: grpo-core's synchronous loop, ``grpo_core.train.run`` in this process.

``python run_grpo_core.py SPEC.json RESULT.json [--transformers-forward] [--dtype D]
[--gradient-checkpointing] [--lora-rank R]`` (run.py writes the spec). A flag whose RunConfig field
this grpo-core does not have writes a result with ``skipped`` (the reason) instead of failing, so
the benchmark runs against grpo-core versions before and after the field. The reward and a
step timer are plugins of a throwaway distribution registered through a dist-info folder on
sys.path, as a pip-installed plugin would be; the loss is grpo-core's default ``grpo`` with
kl_beta=0 (no reference model).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import load_spec, write_result

ENTRY_POINTS = """[grpo_core]
reward.bench_chars = bench_plugins:CharReward
logger.bench_timer = bench_plugins:StepTimer
"""


def register_plugins(site: Path) -> None:
    dist = site / "grpo_core_bench-0.0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: grpo-core-bench\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    sys.path.insert(0, str(site))


def make_config(spec: dict, overrides: dict | None = None):
    from grpo_core.config import RunConfig

    work = Path(spec["work_dir"])
    kwargs = dict(
        model=spec["model_dir"],
        dataset=spec["dataset"],
        prompt_template="{prompt}",
        max_steps=spec["steps"] + 1,
        shuffle=False,
        prompt_groups_per_step=spec["prompts_per_step"],
        completions_per_prompt=spec["group_size"],
        max_completion_tokens=spec["completion_tokens"],
        temperature=1.0,
        reward=["bench_chars"],
        logger=["bench_timer"],
        drop_zero_variance_groups=False,
        learning_rate=spec["learning_rate"],
        device="cpu",
        seed=spec["seed"],
        run_dir=str(work / "grpo_core_run"),
        checkpoint_every=0,  # only the end checkpoint, after the timed steps
        plugin_options={"loss": {"grpo": {"kl_beta": 0.0}}},
    )
    kwargs.update(overrides or {})
    return RunConfig(**kwargs)


def step_records(records: list[dict], started: float, started_cpu: float) -> list[dict]:
    """Per step: wall and CPU seconds since the previous step (the first: since ``started``) and the stage timings."""
    steps = []
    prev, prev_cpu = started, started_cpu
    for rec in records:
        steps.append(
            {
                "period": rec["t"] - prev,
                "cpu": rec["cpu"] - prev_cpu,
                "sample": rec["time/sample"],
                "reward": rec["time/reward"],
                "train": rec["time/train"],
                "completion_lengths": rec["completion_lengths"],
                "peak_rss_mb": rec["peak_rss_mb"],
            }
        )
        prev, prev_cpu = rec["t"], rec["cpu"]
    return steps


def parse_flags(flags: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="run_grpo_core.py SPEC RESULT")
    parser.add_argument("--transformers-forward", action="store_true", help="backend option fast_forward=false")
    parser.add_argument("--dtype", default=None, help="RunConfig.dtype (default: grpo-core's)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="RunConfig.gradient_checkpointing")
    parser.add_argument("--lora-rank", type=int, default=0, help="RunConfig.lora_rank (0 = full fine-tuning)")
    return parser.parse_args(flags)


def run_overrides(args: argparse.Namespace) -> dict:
    """RunConfig fields for the flags; the flags left at their defaults set nothing."""
    options: dict = {"loss": {"grpo": {"kl_beta": 0.0}}}
    if args.transformers_forward:
        options["backend"] = {"local": {"fast_forward": False}}
    overrides: dict = {"plugin_options": options}
    if args.dtype is not None:
        overrides["dtype"] = args.dtype
    if args.gradient_checkpointing:
        overrides["gradient_checkpointing"] = True
    if args.lora_rank:
        overrides["lora_rank"] = args.lora_rank
    return overrides


def main(spec_path: str, result_path: str, *flags: str) -> None:
    spec = load_spec(spec_path)
    register_plugins(Path(spec["work_dir"]) / "grpo_core_site")
    import attrs
    import bench_plugins
    import torch
    import transformers

    import grpo_core
    from grpo_core.config import RunConfig
    from grpo_core.train import run

    overrides = run_overrides(parse_flags(list(flags)))
    unknown = sorted(set(overrides) - set(attrs.fields_dict(RunConfig)))
    if unknown:
        flag_names = ", ".join("--" + field.replace("_", "-") for field in unknown)
        write_result(result_path, {"skipped": f"flag unknown: {flag_names}", "steps": [], "versions": {"grpo_core": grpo_core.__version__}})
        return
    started, started_cpu = time.perf_counter(), time.process_time()
    config = make_config(spec, overrides)
    run(config, overwrite=True)  # each repeat reuses the work folder
    shutil.rmtree(Path(config.run_dir) / "final", ignore_errors=True)  # the saved policy: not needed, tens of MB
    steps = step_records(bench_plugins.STEPS, started, started_cpu)
    write_result(
        result_path,
        {
            "contender": "grpo-core",
            "flags": list(flags),
            "rss_start_mb": bench_plugins.RUN.get("rss_start_mb"),
            "steps": steps,
            "versions": {"grpo_core": grpo_core.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
            "split": {
                "sample": "rollout hook (prompt encode, batched KV-cache sampling, decode)",
                "reward": "rewards + advantages",
                "train": "forward/backward + AdamW + weight sync",
            },
        },
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
