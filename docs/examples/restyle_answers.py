"""Write the embedded task's train split with a new answer style, for the SFT -> RL recipe of docs/sft.md.

Each answer keeps its working but ends in ``Answer: N`` instead of ``#### N`` (the gsm8k reward
reads both): ``python docs/examples/restyle_answers.py restyled.jsonl``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grpo_core.embedded import split_path


def restyle(answer: str) -> str:
    working, _, final = answer.rpartition("\n#### ")
    return f"{working}\nAnswer: {final}"


def main(out: str) -> None:
    rows = [json.loads(line) for line in split_path("train").read_text().splitlines() if line.strip()]
    Path(out).write_text("".join(json.dumps({"question": r["question"], "answer": restyle(r["answer"])}) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {out}, answers ending in 'Answer: N'")


if __name__ == "__main__":
    main(sys.argv[1])
