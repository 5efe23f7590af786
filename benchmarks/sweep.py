"""How grpo-core's step time and peak memory grow with G, prompts per step and completion length.

    python benchmarks/sweep.py [--steps 2] [--threads 1] [--no-write]

Runs grpo-core alone on the "compute" model (Qwen3, ~9.6M parameters, 16-token prompts,
forced completion lengths; see benchmarks/README.md), one subprocess per point so that each
peak RSS is that point's own, varying one of G, prompts per step and completion length around
the base point (8 prompts x G=8, 32 tokens). Prints the table and writes it into
docs/performance.md between its sweep markers.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_common import CACHE, matmul_peak
from run import check_lengths, log, prepare, run_worker, summarize

DOC = HERE.parent / "docs" / "performance.md"
START, END = "<!-- sweep-table:start -->", "<!-- sweep-table:end -->"
BASE = {"prompts_per_step": 8, "group_size": 8, "completion_tokens": 32}
POINTS = [
    ("base", {}),
    ("G", {"group_size": 4}),
    ("G", {"group_size": 16}),
    ("prompts/step", {"prompts_per_step": 4}),
    ("prompts/step", {"prompts_per_step": 16}),
    ("completion length", {"completion_tokens": 16}),
    ("completion length", {"completion_tokens": 64}),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per point (after one warmup step)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    parser.add_argument("--no-write", action="store_true", help="print the table only; leave docs/performance.md alone")
    args = parser.parse_args(argv)
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)

    stamp = time.strftime("%Y%m%d-%H%M%S")
    probes = [matmul_peak()]
    rows = []
    for i, (varied, change) in enumerate(POINTS):
        point = {**BASE, **change}
        spec = prepare("compute", args.steps, CACHE / "work" / f"sweep-{stamp}" / f"point{i}", point)
        log(f"sweep: prompts/step={point['prompts_per_step']} G={point['group_size']} L={point['completion_tokens']} ...")
        result = run_worker("grpo-core", spec, sys.executable, args.threads)
        check_lengths(result, spec)
        rows.append((varied, point, summarize([result], spec, 1.0)))
    probes.append(matmul_peak())
    peak = max(p["peak_flops"] for p in probes)

    base_step = rows[0][2]["step_s"]
    base_mem = rows[0][2]["peak_rss_mb"] - rows[0][2]["rss_start_mb"]
    lines = [
        (
            "| varied | prompts/step | G | completion tokens | completions/step | step s | sample s | train s | vs base | "
            "completions/s | MFU | peak RSS MB | RSS at start MB | growth in the run MB |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for varied, point, r in rows:
        B = point["prompts_per_step"] * point["group_size"]
        growth = r["peak_rss_mb"] - r["rss_start_mb"]
        lines.append(
            f"| {varied} | {point['prompts_per_step']} | {point['group_size']} | {point['completion_tokens']} | {B} | "
            f"{r['step_s']:.2f} | {r['sample_s']:.2f} | {r['train_s']:.2f} | {r['step_s'] / base_step:.2f}x | "
            f"{r['completions_per_s']:.1f} | {r['mfu'] / peak:.0%} | {r['peak_rss_mb']:.0f} | {r['rss_start_mb']:.0f} | {growth:.0f} |"
        )
    table = "\n".join(lines)
    info = (
        f"grpo-core {rows[0][2]['versions'].get('grpo_core', '?')}, torch {rows[0][2]['versions']['torch']}, "
        f"{args.threads or 'default'} torch thread(s), fp32 matmul peak {peak / 1e9:.0f} GFLOP/s; "
        f"median of {args.steps} timed steps per point after 1 warmup step; base step memory growth {base_mem:.0f} MB; "
        f"{time.strftime('%Y-%m-%d')}"
    )
    print(info)
    print(table)
    if not args.no_write:
        text = DOC.read_text() if DOC.exists() else f"# Performance\n\n{START}\n{END}\n"
        if START not in text or END not in text:
            text = text.rstrip("\n") + f"\n\n{START}\n{END}\n"
        head, rest = text.split(START, 1)
        _, tail = rest.split(END, 1)
        DOC.write_text(f"{head}{START}\n{info}\n\n{table}\n{END}{tail}")
        log(f"wrote the table into {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
