"""IGPO against outcome-only GRPO on the guess_number information task, at the same budget.

    python benchmarks/igpo_vs_grpo.py [--seeds 0 1 2] [--steps 40] [--out benchmarks/.cache/igpo_vs_grpo]

Each (advantage, seed) pair is one ``grpo-core run`` through the CLI, from the warmed-up model
(core/assets/guess_number, built by scripts/build_guess_number_model.py) with the same
prompts, group size, steps, learning rate and loss; only ``--advantage`` differs (``grpo``
with ``std=population``, the outcome normalization IGPO uses, against ``igpo``). Runs go one
after the other on one thread each (the machine is shared). The reward is the win rate of
the step's games (``reward/total``); the table shows, per advantage, the mean and the spread
(sample std and min..max over seeds) of the first steps' and the last steps' win rate, and
the best mean over any window of that many steps, the turns per game at the end, and the time
per step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "core" / "assets" / "guess_number"


def run_one(advantage: str, seed: int, args: argparse.Namespace) -> list[dict]:
    run_dir = args.out / f"{advantage}-seed{seed}"
    extra = (
        ["--advantage-opt", "answer_template=It is {answer}.", *(f for opt in args.igpo_opt for f in ("--advantage-opt", opt))]
        if advantage == "igpo"
        else ["--advantage-opt", "std=population"]
    )
    cmd = [
        sys.executable, "-m", "grpo_core.cli", "run",
        "--model", str(MODEL), "--dataset", str(MODEL / "task" / "train.jsonl"),
        "--rollout", "multi_turn", "--rollout-opt", "max_turns=6", "--env", "guess_number", "--advantage", advantage, *extra,
        "--max-steps", str(args.steps), "--prompt-groups-per-step", str(args.groups), "--completions-per-prompt", str(args.group_size),
        "--max-completion-tokens", "12", "--learning-rate", str(args.lr), "--seed", str(seed), "--threads", "1",
        "--checkpoint-every", "0", "--logger", "jsonl", "--run-dir", str(run_dir), "--overwrite", *args.extra,
    ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{advantage} seed {seed} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"  {advantage:5s} seed {seed}: {len(rows)} steps in {time.perf_counter() - started:.0f}s", flush=True)
    return rows


def spread(values: list[float]) -> str:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return f"{mean:.3f} ± {std:.3f} [{min(values):.3f}..{max(values):.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--groups", type=int, default=4, help="prompt groups per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--window", type=int, default=5, help="steps averaged at the start and at the end")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / ".cache" / "igpo_vs_grpo")
    ap.add_argument("--igpo-opt", action="append", default=[], help="an igpo option KEY=VALUE (repeat), e.g. norm=joint")
    ap.add_argument("--only", choices=["grpo", "igpo"], help="run one of the two")
    ap.add_argument("extra", nargs="*", help="more grpo-core run flags, after --")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    results: dict[str, dict[str, list[float]]] = {}
    for seed in args.seeds:
        for advantage in [args.only] if args.only else ["grpo", "igpo"]:
            rows = run_one(advantage, seed, args)
            rewards = [r["reward/total"] for r in rows]
            r = results.setdefault(advantage, {"first": [], "last": [], "best": [], "turns": [], "step_s": [], "igpo_s": []})
            r["first"].append(sum(rewards[: args.window]) / len(rewards[: args.window]))
            r["last"].append(sum(rewards[-args.window :]) / len(rewards[-args.window :]))
            smooth = [sum(rewards[k : k + args.window]) / args.window for k in range(len(rewards) - args.window + 1)]
            r["best"].append(max(smooth))
            r["turns"].append(sum(row["multi_turn/turns_mean"] for row in rows[-args.window :]) / len(rows[-args.window :]))
            r["step_s"].append(sum(row["time/step"] for row in rows) / len(rows))
            r["igpo_s"].append(sum(row.get("time/igpo", 0.0) for row in rows) / len(rows))
    print(
        f"\nguess_number, {args.steps} steps x {args.groups} groups x {args.group_size} games, lr {args.lr}, "
        f"seeds {args.seeds}, igpo options {args.igpo_opt or 'default'}; win rate mean ± std [min..max] over seeds"
    )
    for advantage, r in results.items():
        gain = [b - a for a, b in zip(r["first"], r["last"])]
        print(
            f"{advantage:5s} first {args.window} steps {spread(r['first'])}  last {args.window} steps {spread(r['last'])}  "
            f"gain {spread(gain)}  best {args.window}-step mean {spread(r['best'])}  turns per game at the end {spread(r['turns'])}  "
            f"s/step {sum(r['step_s']) / len(r['step_s']):.2f} (time/igpo {sum(r['igpo_s']) / len(r['igpo_s']):.2f})"
        )


if __name__ == "__main__":
    main()
