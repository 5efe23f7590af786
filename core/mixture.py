"""Mixtures: several datasets in one run, each drawn by its weight (``--mix NAME[:WEIGHT]=DATASET``).

A source is any dataset ``--dataset`` takes (a file, a folder, a hub name, a URL, generated rows).
The run's order interleaves the sources by weight: every prefix of it holds each source's share
of the prompts to within one prompt, so 3:1 is three prompts of one source for each of the
other's, at every step. Each source's rows come in their own order, reshuffled from the seed
whenever that source is used up (a small source recurs within an epoch of a large one). An
epoch is as many prompts as all the sources hold together. The order is a function of the seed
and the rows alone: a resumed run takes it up where it stopped.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterator, Mapping, Sequence

import attrs

from grpo_core.errors import PluginError
from grpo_core.types import Prompt

NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
"""A source's name goes into metric names (``data/NAME/share``)."""


@attrs.frozen
class MixSource:
    name: str
    weight: float
    dataset: str


def parse_mix(specs: Sequence[str]) -> list[MixSource]:
    """``["math:3=math.jsonl", "code=https://host/code.jsonl"]`` -> the sources; a bare name weighs 1.

    The name and weight come before the first ``=``, so the dataset itself may hold ``:`` and ``=``
    (``FOLDER:SPLIT``, a URL's query).
    """
    sources: list[MixSource] = []
    for spec in specs:
        head, sep, dataset = spec.partition("=")
        name, colon, weight_text = head.partition(":")
        if not sep or not dataset or not NAME.match(name):
            raise PluginError(
                f"--mix '{spec}': expected NAME[:WEIGHT]=DATASET, NAME of letters, digits, '_', '.', '-' (e.g. math:3=math.jsonl)"
            )
        try:
            weight = float(weight_text) if colon else 1.0
        except ValueError:
            weight = math.nan
        if not (0 < weight < math.inf):
            raise PluginError(f"--mix '{spec}': the weight '{weight_text}' is not a positive number")
        if any(s.name == name for s in sources):
            raise PluginError(f"--mix: the source name '{name}' is given twice; each source needs its own name")
        sources.append(MixSource(name, weight, dataset))
    return sources


def mixture_batches(
    prompts: Sequence[Prompt], weights: Mapping[str, float], batch_size: int, epochs: int, seed: int, shuffle: bool
) -> Iterator[list[Prompt]]:
    """Full batches of the mixture's ``prompts`` (each with its ``source``), ``epochs`` times as
    many prompts as there are, the sources interleaved by ``weights``."""
    by_source = {name: [p for p in prompts if p.source == name] for name in weights}
    total_weight = sum(weights.values())
    orders = {name: _source_order(rows, random.Random(f"mix:{seed}:{name}"), shuffle) for name, rows in by_source.items()}
    taken = dict.fromkeys(weights, 0)
    batch: list[Prompt] = []
    for n in range(1, (len(prompts) // batch_size) * batch_size * epochs + 1):
        # The source furthest behind its share of the first n prompts (the first named on a tie).
        name = max(weights, key=lambda s: weights[s] * n / total_weight - taken[s])
        taken[name] += 1
        batch.append(next(orders[name]))
        if len(batch) == batch_size:
            yield batch
            batch = []


def _source_order(rows: list[Prompt], rng: random.Random, shuffle: bool) -> Iterator[Prompt]:
    if not rows:
        raise ValueError("a mixture's source has no prompts (the data checks refuse one)")
    while True:
        order = list(rows)
        if shuffle:
            rng.shuffle(order)
        yield from order


def shares(names: Sequence[str], metrics: Mapping[str, float], drawn: str) -> dict[str, float]:
    """``data/NAME/share`` of each source: its part of what the step drew (``data/NAME/DRAWN``: its
    prompts, an sft step's examples), 0 when it had none."""
    counts = {name: metrics.get(f"data/{name}/{drawn}", 0.0) for name in names}
    total = sum(counts.values())
    return {f"data/{name}/share": (count / total if total else 0.0) for name, count in counts.items()}
