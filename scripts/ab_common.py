"""What the interleaved A/B scripts share: their arguments, their prompts and the timed rounds."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def parse_arguments(doc: str) -> argparse.Namespace:
    """MODEL [--rounds 5] [--prompts 2] [--group 4] [--tokens 32] [--dtype float32]."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    return parser.parse_args()


def prompt_ids(tokenizer: Any, count: int) -> list[list[int]]:
    """``count`` short word problems, tokenized."""
    return [tokenizer(f"Question: Tom has {i + 3} apples and buys {i + 5} more. How many?\nAnswer:")["input_ids"] for i in range(count)]


def interleaved_times(rounds: int, comparisons: Sequence[Mapping[str, Callable[[], object]]]) -> dict[str, list[float]]:
    """Seconds of each contender's call, per round: every round runs each comparison's contenders
    once, in alternating order, so machine noise hits them alike."""
    times: dict[str, list[float]] = {}
    for round_index in range(rounds):
        for contenders in comparisons:
            order = list(contenders.items())
            for name, run in order if round_index % 2 == 0 else order[::-1]:
                started = time.perf_counter()
                run()
                times.setdefault(name, []).append(time.perf_counter() - started)
    return times
