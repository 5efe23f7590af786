"""The ``sympy`` reward plugin: final-answer extraction and the plugin class."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from grpo_core import Prompt, Sample, hookimpl, option
from grpo_core.plugins.rewards import gsm8k
from grpo_core.subprocess_worker import ReplacedWorker, WorkerProcess
from grpo_reward_sympy.parse import NotMath, plain_number, to_sympy_text

__all__ = ["SympyReward", "extract_final_answer", "last_boxed", "reference_answer"]

# --------------------------------------------------------------------------------------------
# Final answers
# --------------------------------------------------------------------------------------------

# A line marker (as in gsm8k) and the rest of its line.
_LINE_RE = re.compile(
    r"(?:####|(?i:\banswer\s+is\b)|(?i:\banswer\b[ \t]*(?:\*\*|__)?[ \t]*:)|(?m:^)[ \t]*A[ \t]*:)"
    r"[ \t*_:]*(?P<rest>[^\n]*)"
)
_TAG_RE = re.compile(r"<answer>(.*?)(?:</answer>|\Z)", re.IGNORECASE | re.DOTALL)
_MATH_RE = re.compile(r"\$\$?(.+?)\$\$?|\\\((.+?)\\\)|\\\[(.+?)\\\]")
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)|[,;](?:\s|$)|\*\*")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces matched."""
    spans = sorted(gsm8k.boxed_spans(text))
    return spans[-1][1] if spans else None


def _line_answer(rest: str) -> str:
    """The answer part of a marker's line: its first math span, else up to the sentence end."""
    m = _MATH_RE.search(rest)
    if m is not None and not rest[: m.start()].strip(" \t*_:"):
        return next(g for g in m.groups() if g is not None)
    end = _SENTENCE_END_RE.search(rest)
    return rest[: end.start()] if end else rest


def _as_answer(candidate: str, context: str) -> str | None:
    """``candidate`` if it is an expression, else the number gsm8k reads in ``context``."""
    try:
        to_sympy_text(candidate)
        return candidate.strip()
    except NotMath:
        return gsm8k.extract_answer(context, strict=True)


def extract_final_answer(completion: str, strict: bool = False) -> str | None:
    """The completion's final answer as text (plain or LaTeX), or None.

    The last explicit marker wins: ``\\boxed{...}`` (nested braces), ``<answer>...</answer>``,
    or a line marker (``#### ...``, ``The answer is ...``, ``Answer: ...``, ``A: ...``) whose
    answer is the math after it. A marker followed by prose ("The answer is 18 dollars") gives
    the number gsm8k reads there. Without a marker: gsm8k's last-number fallback, unless strict.
    """
    candidates: list[tuple[int, str, str]] = [(start, content, content) for start, content in sorted(gsm8k.boxed_spans(completion))]
    for m in _LINE_RE.finditer(completion):
        candidates.append((m.start(), _line_answer(m.group("rest")), m.group()))
    if "<" in completion:
        for m in _TAG_RE.finditer(completion):
            candidates.append((m.start(), m.group(1).strip(), m.group()))
    for _, candidate, context in sorted(candidates, key=lambda c: c[0], reverse=True):
        if candidate.strip().startswith(gsm8k.BOX_HEADS):
            continue  # "The answer is \boxed{...}": the box itself is a candidate
        answer = _as_answer(candidate, context)
        if answer is not None:
            return answer
    return None if strict else gsm8k.extract_answer(completion, strict=False)


def reference_answer(reference: str) -> str:
    """The answer text of a reference: after the last "####", the last \\boxed{}, or all of it."""
    if "####" in reference:
        return reference.rsplit("####", 1)[1].strip()
    boxed = last_boxed(reference)
    return (boxed if boxed is not None else reference).strip()


# --------------------------------------------------------------------------------------------
# Plugin
# --------------------------------------------------------------------------------------------


@attrs.define
class SympyReward:
    """Symbolic-equivalence reward: 1.0 if the final answer equals the reference, checked with sympy.

    Compares numbers, fractions and expressions by value: 0.5 == 1/2 == \\frac{1}{2},
    \\sqrt{8} == 2\\sqrt{2}, 2\\pi, 2*x+1 == 1+2x, "x = 5" == 5. The final answer is the last
    \\boxed{...} (nested braces), <answer>...</answer>, or line marker ("#### ...", "The answer
    is ...", "Answer: ...", "A: ..."), else the last number (strict=true: 0 instead). The
    reference is the prompt's answer: a GSM8K answer ("#### N"), a \\boxed{} solution or a bare
    expression. Each check runs in a worker process and scores 0 when it takes longer than
    timeout_s (the worker is then replaced); plain numbers are compared without sympy.
    Every dataset row needs an answer.
    """

    # Read by grpo-core's data loader: rows without a reference answer are refused up front.
    needs_answer = True

    timeout_s: float = option(2.0, help="time limit of one sympy check (seconds); a check over it scores 0; 0 = no limit, in-process")
    strict: bool = option(False, help="require an explicit answer marker; no last-number fallback")
    memory_limit_mb: int = option(2048, help="address-space limit of the sympy worker (Linux); 0 = none")
    startup_timeout_s: float = option(120.0, help="how long the worker may take to start (import sympy)")

    _worker: ReplacedWorker = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        self._worker = ReplacedWorker(self._start_worker)

    def _start_worker(self) -> WorkerProcess:
        return WorkerProcess(
            "grpo_reward_sympy.worker",
            [str(self.memory_limit_mb)],
            name="sympy",
            startup_timeout_s=self.startup_timeout_s,
            pythonpath=str(Path(__file__).resolve().parents[1]),  # works from a source checkout too
        )

    def score(self, completion: str, reference: str) -> float:
        """1.0 if the completion's final answer equals the reference's, else 0.0."""
        return self._score_answer(extract_final_answer(completion, self.strict), _reference_text(reference))

    @hookimpl
    def reward(self, prompt: Prompt, samples: Sequence[Sample]) -> list[float | None]:
        if prompt.answer is None or not str(prompt.answer).strip():
            raise ValueError(
                f"sympy reward: prompt {prompt.id!r} has no reference answer; give every dataset "
                "row an 'answer' (an expression, a \\boxed{} solution or a GSM8K '#### N' answer)"
            )
        try:
            reference = _reference_text(str(prompt.answer))
        except ValueError as exc:
            raise ValueError(f"sympy reward: prompt {prompt.id!r}: {exc}") from None
        return [self._score_answer(extract_final_answer(s.text, self.strict), reference) for s in samples]

    @hookimpl
    def on_run_end(self, summary: dict[str, Any], run_dir: Path) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker process (a later check starts a new one)."""
        self._worker.close()

    def _score_answer(self, answer: str | None, reference: str) -> float:
        if answer is None:
            return 0.0
        if "".join(answer.split()) == "".join(reference.split()):
            return 1.0
        try:
            pred = to_sympy_text(answer)
        except NotMath:
            return 0.0
        ref_value, pred_value = plain_number(reference), plain_number(pred)
        if ref_value is not None and pred_value is not None:
            return 1.0 if ref_value == pred_value else 0.0
        return 1.0 if self._check(pred, reference) else 0.0

    def _check(self, pred: str, ref: str) -> bool:
        if self.timeout_s <= 0:
            from grpo_reward_sympy.equivalence import equivalent_text

            try:
                return equivalent_text(pred, ref)
            except Exception:
                return False
        reply = self._worker.request({"pred": pred, "ref": ref}, self.timeout_s)
        return reply is not None and bool(reply.get("ok"))  # None: over the time limit, or the worker died


def _reference_text(reference: str) -> str:
    """The reference as sympy text (GSM8K numbers normalized by gsm8k); ValueError if unusable."""
    answer = reference_answer(reference)
    try:
        return to_sympy_text(answer)
    except NotMath:
        pass
    try:
        return gsm8k.parse_reference(answer)
    except ValueError:
        raise ValueError(f"reference answer is not an expression or a number: {reference[-80:]!r}") from None
