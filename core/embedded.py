"""The embedded task: its files, and which of its splits a ``--dataset`` names."""

from __future__ import annotations

from pathlib import Path

from grpo_core.errors import DataError

ASSETS = Path(__file__).parent / "assets" / "default"
EMBEDDED = "default"
EMBEDDED_SPLITS = ("train", "test")


def embedded_split(dataset: str) -> str | None:
    """The embedded task's split that ``dataset`` names (``default``, ``default:test``, or its
    file's path), else None."""
    name, sep, split = dataset.partition(":")
    if name == EMBEDDED:
        if not sep:
            return "train"
        if split not in EMBEDDED_SPLITS:
            raise DataError(f"unknown split '{split}' of the embedded task; splits: {', '.join(EMBEDDED_SPLITS)}")
        return split
    path = Path(dataset)
    if path.is_file():
        for split in EMBEDDED_SPLITS:
            if path.resolve() == split_path(split).resolve():
                return split
    return None


def split_path(split: str) -> Path:
    return ASSETS / "task" / f"{split}.jsonl"
