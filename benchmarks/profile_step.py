"""Where a step's time goes: grpo-core's loop or the naive loop, on a benchmark configuration.

    python benchmarks/profile_step.py [--config overhead|compute] [--contender grpo-core|naive]
                                      [--steps N] [--profiler phases|torch|cprofile] [--threads 1]
    python benchmarks/profile_step.py --profiler torch --device cuda   # grpo-core's training phase on a GPU

``phases`` (default) wraps the functions that make up a step (sampler, model forward, draw,
loss, backward, optimizer, ...) with wall-clock accumulators and prints seconds per step,
inclusive, for the timed steps (the first step is a warmup). ``torch`` runs torch.profiler over
grpo-core's training phase only (``train_on_groups``: forward, loss, backward, clipping, the
optimizer step) and prints, per timed step, the operators by self CPU time and (on CUDA) the
kernels by self device time, with the counts of operator calls and kernel launches.
``cprofile`` prints the Python functions by cumulative time. Nothing in grpo-core is changed: the
wrappers are installed on the classes from here.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_common import CACHE

TIMES: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)
ACTIVE = {"on": False}
PHASE = {"name": "train"}  # the naive loop's training forward runs outside any wrapped phase


def wrap(owner: Any, attr: str, label: str, phase: str | None = None) -> None:
    """Accumulate the wall time of ``owner.attr`` under ``label`` (``{phase}`` = current phase)."""
    original = getattr(owner, attr)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        previous = PHASE["name"]
        if phase is not None:
            PHASE["name"] = phase
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if ACTIVE["on"]:
                key = label.format(phase=PHASE["name"])
                TIMES[key] += time.perf_counter() - t
                CALLS[key] += 1
            PHASE["name"] = previous

    setattr(owner, attr, timed)


def wrap_common() -> None:
    import torch
    from transformers.models.qwen3 import modeling_qwen3

    wrap(modeling_qwen3.Qwen3ForCausalLM, "forward", "{phase}: model forward")
    wrap(modeling_qwen3.Qwen3Model, "forward", "{phase}:   decoder layers (Qwen3Model.forward)")
    if hasattr(modeling_qwen3, "create_causal_mask"):
        wrap(modeling_qwen3, "create_causal_mask", "{phase}:   create_causal_mask")
    wrap(torch.autograd, "backward", "train: backward")
    wrap(torch.nn.utils, "clip_grad_norm_", "train: clip_grad_norm_")
    wrap(torch.optim.AdamW, "step", "train: AdamW.step")


def wrap_grpo_core() -> None:
    from grpo_core import loop, produce, stages
    from grpo_core.engine import decoding, trainer
    from grpo_core.engine.fast_decoder import FastDecoder
    from grpo_core.plugins.losses.grpo import GRPOLoss
    from grpo_core.plugins.rollouts.single_turn import SingleTurnRollout
    from grpo_core.plugins.samplers import local as local_sampler

    wrap(SingleTurnRollout, "rollout", "sample: rollout hook (total)", phase="sample")
    wrap(local_sampler.LocalSampler, "_generate", "sample:  LocalSampler._generate")
    wrap(decoding, "draw", "sample:   draw (temperature, softmax, inverse-CDF draw)")
    wrap(FastDecoder, "__call__", "{phase}: model forward (FastDecoder)")
    wrap(produce, "score_groups", "reward: score_groups", phase="reward")
    wrap(produce, "compute_advantages", "reward: compute_advantages", phase="reward")
    wrap(stages, "train_on_groups", "train: train_on_groups (total)", phase="train")
    wrap(trainer, "target_logprobs", "train:  target_logprobs (forward + log_softmax)")
    wrap(trainer.LocalTrainer, "forward_backward_custom", "train:  forward_backward_custom")
    wrap(GRPOLoss, "loss", "train:   loss hook (pad + surrogate)")
    wrap(trainer.LocalTrainer, "optim_step", "train:  optim_step")
    wrap(loop, "learning_rate", "train: learning_rate")


def wrap_naive() -> None:
    from transformers.generation.utils import GenerationMixin

    wrap(GenerationMixin, "generate", "sample: model.generate (total)", phase="sample")
    wrap(GenerationMixin, "_sample", "sample:  GenerationMixin._sample")


class TrainPhaseProfile:
    """torch.profiler around each call of ``stages.train_on_groups`` while ``ACTIVE``: per operator
    (CPU) and kernel (CUDA) name, the calls and the self time summed over the timed steps."""

    def __init__(self, device: str) -> None:
        import torch

        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.cpu_ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        self.kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])

    def install(self) -> None:
        import torch

        from grpo_core import stages

        original = stages.train_on_groups

        @functools.wraps(original)
        def profiled(*args: Any, **kwargs: Any) -> Any:
            if not ACTIVE["on"]:
                return original(*args, **kwargs)
            with torch.profiler.profile(activities=self.activities) as profile:
                result = original(*args, **kwargs)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            self.collect(profile)
            return result

        stages.train_on_groups = profiled

    def collect(self, profile: Any) -> None:
        from torch.autograd import DeviceType

        for event in profile.events():
            if event.device_type == DeviceType.CPU:
                entry = self.cpu_ops[event.name]
                entry[0] += 1
                entry[1] += event.self_cpu_time_total
            else:
                entry = self.kernels[event.name]
                entry[0] += 1
                entry[1] += event.self_device_time_total

    def report(self, steps: int, rows: int) -> None:
        for title, table in (("CPU operators", self.cpu_ops), ("device kernels", self.kernels)):
            if not table:
                continue
            calls = sum(count for count, _ in table.values())
            total = sum(us for _, us in table.values())
            print(f"training phase, {title}: {calls / steps:.0f} per step, {total / steps / 1e6:.3f} s self time per step")
            print(f"{'name':<70} {'self s/step':>11} {'% self':>7} {'calls/step':>10}")
            for name, (count, us) in sorted(table.items(), key=lambda item: -item[1][1])[:rows]:
                print(f"{name[:70]:<70} {us / steps / 1e6:>11.4f} {us / max(total, 1e-9):>7.1%} {count / steps:>10.1f}")


def run(contender: str, spec: dict[str, Any], start: Callable[[], None], stop: Callable[[], None], overrides: dict[str, Any]) -> float:
    """Run warmup + steps (grpo-core's config with ``overrides``); ``start`` after the warmup step,
    ``stop`` at the end; returns timed seconds."""
    marks: dict[str, float] = {}

    def on_step(step: int) -> None:
        if step == 1:
            marks["t0"] = time.perf_counter()
            start()
        if step == spec["steps"] + 1:
            stop()
            marks["t1"] = time.perf_counter()

    if contender == "grpo-core":
        import bench_plugins
        from run_grpo_core import make_config, register_plugins

        register_plugins(Path(spec["work_dir"]) / "grpo_core_site")
        from grpo_core.train import run as grpo_run

        bench_plugins.ON_STEP.append(on_step)
        grpo_run(make_config(spec, overrides), overwrite=True)
    else:
        from run_naive import naive_loop

        naive_loop(spec, on_step)
    return marks["t1"] - marks["t0"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=["overhead", "compute"], default="compute")
    parser.add_argument("--contender", choices=["grpo-core", "naive"], default="grpo-core")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--profiler", choices=["phases", "torch", "cprofile"], default="phases")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="grpo-core's device (the naive loop: CPU only)")
    args = parser.parse_args(argv)
    if args.profiler == "torch" and args.contender != "grpo-core":
        parser.error("--profiler torch profiles grpo-core's training phase: use --contender grpo-core")
    if args.device != "cpu" and args.contender != "grpo-core":
        parser.error("--device cuda runs grpo-core only: use --contender grpo-core")

    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from run import prepare

    spec = prepare(args.config, args.steps, CACHE / "work" / f"profile-{args.config}-{args.contender}")
    profiler: Any = None
    if args.profiler == "phases":
        wrap_common()
        if args.contender == "grpo-core":
            wrap_grpo_core()
        else:
            wrap_naive()

        def start() -> None:
            ACTIVE["on"] = True

        def stop() -> None:
            ACTIVE["on"] = False

    elif args.profiler == "torch":
        profiler = TrainPhaseProfile(args.device)
        profiler.install()

        def start() -> None:
            ACTIVE["on"] = True

        def stop() -> None:
            ACTIVE["on"] = False
    else:
        import cProfile

        profiler = cProfile.Profile()
        start, stop = profiler.enable, profiler.disable

    seconds = run(args.contender, spec, start, stop, {"device": args.device})
    n = args.steps
    print(f"{args.contender} on {args.config}: {n} timed steps, {seconds / n:.3f} s/step, torch threads {torch.get_num_threads()}")
    if args.profiler == "phases":
        print(f"{'function (inclusive wall time)':<62} {'s/step':>8} {'% step':>7} {'calls/step':>10}")
        order = {"sample": 0, "reward": 1, "train": 2}
        for key in sorted(TIMES, key=lambda k: (order.get(k.split(":")[0], 3), -TIMES[k])):
            print(f"{key:<62} {TIMES[key] / n:>8.4f} {TIMES[key] / seconds:>7.1%} {CALLS[key] / n:>10.1f}")
    elif args.profiler == "torch":
        profiler.report(n, args.rows)
    else:
        import pstats

        stats = pstats.Stats(profiler)
        stats.sort_stats("cumulative").print_stats(args.rows)
        stats.sort_stats("tottime").print_stats(args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
