"""The ``math_verify`` reward plugin: the worker client and the plugin class."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from grpo_core import Prompt, Sample, hookimpl, option

__all__ = ["MathVerifyReward", "answer_region"]

GSM8K_MARKER = "####"


def answer_region(text: str) -> str:
    """What Math-Verify reads: the text after the last GSM8K ``####`` marker (a marker Math-Verify
    does not know, so it would otherwise take the last expression before it), else all of it."""
    return text.rsplit(GSM8K_MARKER, 1)[1] if GSM8K_MARKER in text else text


class BadReference(ValueError):
    """Math-Verify finds no answer in the prompt's reference."""


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass


class _Worker:
    """A ``python -m grpo_reward_math_verify.worker`` child and a thread that reads its replies."""

    def __init__(self, memory_limit_mb: int, startup_timeout_s: float) -> None:
        env = dict(os.environ)
        here = str(Path(__file__).resolve().parents[1])  # works from a source checkout too
        env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grpo_reward_math_verify.worker", str(memory_limit_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            bufsize=1,
            env=env,
        )
        self._finalizer = weakref.finalize(self, _kill, self.proc)
        self.replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc.stdout, self.replies), daemon=True).start()
        self.next_id = 0
        try:
            ready = self.replies.get(timeout=startup_timeout_s)
        except queue.Empty:
            ready = None
        if ready != "ready":
            self.close()
            raise RuntimeError(
                f"the Math-Verify worker ({sys.executable} -m grpo_reward_math_verify.worker) did not start "
                f"within {startup_timeout_s:g} s; its stderr is above"
            )

    @staticmethod
    def _read(stream: Any, replies: queue.Queue[str | None]) -> None:
        try:
            for line in stream:
                replies.put(line.strip())
        except (OSError, ValueError):
            pass
        replies.put(None)

    def check(self, gold: str, pred: str, timeout_s: float) -> dict[str, Any] | None:
        """The worker's reply, or None when it ran past ``timeout_s`` or died."""
        self.next_id += 1
        try:
            self.proc.stdin.write(json.dumps({"id": self.next_id, "gold": gold, "pred": pred}) + "\n")
            self.proc.stdin.flush()
            line = self.replies.get(timeout=timeout_s)
            reply = json.loads(line) if line is not None else None
        except (OSError, ValueError, queue.Empty):
            return None
        return reply if isinstance(reply, dict) and reply.get("id") == self.next_id else None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self._finalizer()


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

    _worker: _Worker | None = attrs.field(init=False, default=None, repr=False, eq=False)
    _lock: Any = attrs.field(init=False, factory=threading.Lock, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        for name in ("timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (a check without a limit could hang the run), got {getattr(self, name)}")
        if self.memory_limit_mb < 0:
            raise ValueError(f"memory_limit_mb must be >= 0 (0 = no limit), got {self.memory_limit_mb}")

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
        with self._lock:
            if self._worker is None or not self._worker.alive():
                self._worker = _Worker(self.memory_limit_mb, self.startup_timeout_s)
            reply = self._worker.check(answer_region(reference), answer_region(completion), self.timeout_s)
            if reply is None:  # over the time limit, or the worker died: replace it
                self._worker.close()
                self._worker = None
                return 0.0
        if not reply.get("gold"):
            raise BadReference(reference)
        return 1.0 if reply.get("ok") else 0.0

    @hookimpl
    def on_run_end(self, summary: dict[str, Any], run_dir: Path) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker process (a later check starts a new one)."""
        with self._lock:
            if self._worker is not None:
                self._worker.close()
                self._worker = None
