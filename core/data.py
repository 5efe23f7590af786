"""Datasets: JSONL rows -> Prompts, in a seeded order, epoch after epoch."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterator

from grpo_core.plugins_manager import PluginError
from grpo_core.types import Prompt

ASSETS = Path(__file__).parent / "assets" / "default"
DEFAULT_TASK_TEMPLATE = "Question: {prompt}\nAnswer:"


class DataError(PluginError):
    """Bad dataset input; the message names the file and line."""


def dataset_path(dataset: str) -> Path:
    return ASSETS / "task" / "train.jsonl" if dataset == "default" else Path(dataset)


def load_prompts(
    path: Path,
    prompt_field: str = "question",
    answer_field: str = "answer",
    template: str = "{prompt}",
    max_rows: int | None = None,
    skipped: list[str] | None = None,
) -> list[Prompt]:
    """Read a JSONL file of prompts; a row may hold text in ``prompt_field`` or a ``messages`` list.

    A bad row raises DataError naming file and line, unless ``skipped`` is a list: then the
    row's error is appended to it and the row left out.
    """
    if not path.is_file():
        raise DataError(f"dataset file not found: {path}")
    if "{prompt}" not in template:
        raise DataError(f"prompt template {template!r} has no {{prompt}} placeholder")
    prompts: list[Prompt] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                prompts.append(_parse_row(line, path, lineno, prompt_field, answer_field, template))
            except DataError as exc:
                if skipped is None:
                    raise
                skipped.append(str(exc))
                continue
            if max_rows is not None and len(prompts) >= max_rows:
                break
    if not prompts:
        raise DataError(f"{path}: no rows")
    return prompts


def _parse_row(line: str, path: Path, lineno: int, prompt_field: str, answer_field: str, template: str) -> Prompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{lineno}: malformed JSON: {exc.msg}") from None
    if not isinstance(row, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
    answer = row.get(answer_field)
    if answer is not None and not isinstance(answer, str):
        answer = str(answer)
    messages = row.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise DataError(f"{path}:{lineno}: 'messages' must be a list of {{role, content}} objects")
        return Prompt(id=f"{path.name}:{lineno}", messages=messages, answer=answer, metadata=row)
    if prompt_field not in row:
        raise DataError(
            f"{path}:{lineno}: missing field '{prompt_field}' (fields: {', '.join(row) or 'none'}); "
            "set --prompt-field"
        )
    text = row[prompt_field]
    if not isinstance(text, str):
        raise DataError(f"{path}:{lineno}: field '{prompt_field}' must be a string")
    return Prompt(id=f"{path.name}:{lineno}", text=template.replace("{prompt}", text), answer=answer, metadata=row)


def prompt_batches(prompts: list[Prompt], batch_size: int, epochs: int, seed: int, shuffle: bool) -> Iterator[list[Prompt]]:
    """Full batches of prompts, reshuffled each epoch; a last partial batch is dropped."""
    rng = random.Random(seed)
    for _ in range(epochs):
        order = list(range(len(prompts)))
        if shuffle:
            rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield [prompts[i] for i in order[start : start + batch_size]]


def steps_available(num_prompts: int, batch_size: int, epochs: int) -> int:
    return (num_prompts // batch_size) * epochs
