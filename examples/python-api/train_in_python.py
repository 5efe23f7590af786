"""Train from Python (a notebook cell works the same): rows in memory, plugins as instances.

    python examples/python-api/train_in_python.py

Runs offline on CPU with the embedded tiny model in about a minute; the run directory holds what
`grpo-core run` writes (config.json, metrics.jsonl, checkpoints/, final/), and
`grpo_core.run({"max_steps": 60}, resume=RUN_DIR, reward=[LastNumberReward()])` continues it.
"""

from __future__ import annotations

import re

import attrs

import grpo_core
from grpo_core import hookimpl, option


@attrs.define
class LastNumberReward:
    """1 when the last number in the completion is the row's answer, else 0."""

    partial: float = option(0.1, help="score of a completion with a number that is not the answer")

    @hookimpl
    def reward(self, prompt, samples):
        scores = []
        for sample in samples:
            numbers = re.findall(r"-?\d+", sample.text)
            scores.append(0.0 if not numbers else 1.0 if numbers[-1] == prompt.answer else self.partial)
        return scores


@attrs.define
class KeepUnsolved:
    """A group filter: drop the groups every sample of which already solved its prompt."""

    @hookimpl
    def keep_group(self, prompt, samples):
        return not all(s.reward == 1.0 for s in samples)


def main(max_steps: int = 30, run_dir: str | None = None) -> dict:
    rows = [{"question": f"{a} + {b} =", "answer": str(a + b)} for a in range(10) for b in range(10)]
    return grpo_core.run(
        {
            "max_steps": max_steps,
            "prompt_groups_per_step": 4,
            "completions_per_prompt": 8,
            "max_completion_tokens": 8,
            "learning_rate": 1e-4,
            "run_dir": run_dir,
        },
        rows=rows,
        reward=[LastNumberReward(partial=0.2)],
        group_filter=[KeepUnsolved()],
    )


if __name__ == "__main__":
    summary = main()
    print(f"reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f}; run directory: {summary['run_dir']}")
