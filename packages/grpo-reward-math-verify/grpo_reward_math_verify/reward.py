"""The ``math_verify`` reward plugin: the plugin class."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from grpo_core import Prompt, Sample, hookimpl, option
from grpo_core.subprocess_worker import ReplacedWorker, WorkerProcess

__all__ = ["MathVerifyReward", "answer_region"]

GSM8K_MARKER = "####"


def answer_region(text: str) -> str:
    """What Math-Verify reads: the text after the last GSM8K ``####`` marker (a marker Math-Verify
    does not know, so it would otherwise take the last expression before it), else all of it."""
    return text.rsplit(GSM8K_MARKER, 1)[1] if GSM8K_MARKER in text else text


class BadReference(ValueError):
    """Math-Verify finds no answer in the prompt's reference."""


@attrs.define
class MathVerifyReward:
    """Math-Verify reward: 1.0 if the completion's final answer equals the reference, checked with
    the math-verify library (LaTeX and plain expressions, boxed answers, sets, intervals,
    equations, units and percentages as it reads them).

    The reference is the prompt's answer; for a GSM8K answer ("... #### 18") and a completion
    with a "#### N" line, the text after the last "####" is read. Each check runs in a worker
    process with Math-Verify's own (SIGALRM) time limits off, so it works from any thread; a check
    that takes longer than timeout_s scores 0 and the worker is replaced. Model output never makes
    it raise: what cannot be parsed scores 0. A reference in which Math-Verify finds no answer is
    an error naming the prompt. Every dataset row needs an answer.
    """

    # Read by grpo-core's data loader: rows without a reference answer are refused up front.
    needs_answer = True

    timeout_s: float = option(5.0, help="time limit of one check (seconds); a check over it scores 0 and the worker is replaced")
    memory_limit_mb: int = option(2048, help="address-space limit of the worker process (Linux); 0 = none")
    startup_timeout_s: float = option(120.0, help="how long the worker may take to start (import math-verify)")

    _worker: ReplacedWorker = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        for name in ("timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (a check without a limit could hang the run), got {getattr(self, name)}")
        if self.memory_limit_mb < 0:
            raise ValueError(f"memory_limit_mb must be >= 0 (0 = no limit), got {self.memory_limit_mb}")
        self._worker = ReplacedWorker(self._start_worker)

    def _start_worker(self) -> WorkerProcess:
        return WorkerProcess(
            "grpo_reward_math_verify.worker",
            [str(self.memory_limit_mb)],
            name="Math-Verify",
            startup_timeout_s=self.startup_timeout_s,
            pythonpath=str(Path(__file__).resolve().parents[1]),  # works from a source checkout too
        )

    @hookimpl
    def reward(self, prompt: Prompt, samples: Sequence[Sample]) -> list[float | None]:
        if prompt.answer is None or not str(prompt.answer).strip():
            raise ValueError(
                f"math_verify reward: prompt {prompt.id!r} has no reference answer; give every dataset "
                "row an 'answer' (an expression, a \\boxed{} solution or a GSM8K '#### N' answer)"
            )
        reference = answer_region(str(prompt.answer))
        try:
            return [self.score(s.text, reference) for s in samples]
        except BadReference:
            raise ValueError(f"math_verify reward: prompt {prompt.id!r}: no answer in the reference {reference[-80:]!r}") from None

    def score(self, completion: str, reference: str) -> float:
        """1.0 if Math-Verify finds the completion's final answer equal to the reference's, else 0.0."""
        reply = self._worker.request({"gold": answer_region(reference), "pred": answer_region(completion)}, self.timeout_s)
        if reply is None:  # over the time limit, or the worker died: it is replaced
            return 0.0
        if not reply.get("gold"):
            raise BadReference(reference)
        return 1.0 if reply.get("ok") else 0.0

    @hookimpl
    def on_run_end(self, summary: dict[str, Any], run_dir: Path) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker process (a later check starts a new one)."""
        self._worker.close()
