"""What a finished run says: its summary (``summary.json``, the exit code it ends with), why a run
that trained nothing failed, where its policy is. Read by ``grpo_core.lifecycle``'s finish, and by
a failure's message."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from grpo_core.errors import EXIT_CODES, EXIT_ERROR
from grpo_core.types import RunState


def policy_saved(state: RunState, final: str) -> str:
    return (
        f"the trained policy of step {state.step} is saved in {final} (its weights, without the optimizer state: "
        f"load it as a model, or train on from it with --model {final} and another --run-dir)"
    )


def nothing_trained(r: Any) -> str | None:
    """Why a run that ended without training one token is a failure (None when it trained, was
    interrupted, or is a resumed run whose earlier steps may have trained)."""
    state = r.state
    dropped = state.groups_dropped
    if state.tokens_trained or state.interrupted or state.step == state.start_step:
        return None
    steps = "its one step" if state.step == 1 else f"all {state.step} steps"
    if state.groups_trained:
        if state.start_step:
            return None
        masked, limit = state.samples_masked_truncated, r.config.max_completion_tokens
        why = f"{masked:g} of them were cut at --max-completion-tokens {limit} and --mask-truncated masks them"
        fix = "raise --max-completion-tokens or drop --mask-truncated"
        if masked < state.samples_kept:
            why = f"{why}; the loss masks of {state.samples_kept - masked:g} are all 0" if masked else "their loss masks are all 0"
            fix = "check the rollout's loss masks" + (f", {fix}" if masked else "")
        kept = f"{state.groups_trained:g} groups of {state.samples_kept:g} samples"
        return f"nothing was trained: {steps} kept {kept}, but no token of theirs was trained ({why}); {fix}"
    if dropped.get("failed"):
        fix = "fix the reward and start again"
        if state.reward_failures.last_was_cut:
            fix = f"raise --max-completion-tokens ({r.config.max_completion_tokens}: the budget they ran out of) or allow fewer turns"
        return (
            f"nothing was trained: every group was dropped, {dropped['failed']:g} of them because their "
            f"reward failed (last: {state.reward_failures.last_error or 'a reward returned None/NaN'}); {fix}"
        )
    if state.start_step:
        return None
    said = {"zero_variance": "had equal rewards: no signal", "skipped": "had no samples"}
    reasons = ", ".join(f"{count:g} {said.get(name, f'by the group filter {name!r}')}" for name, count in dropped.items() if count)
    return (
        f"nothing was trained: {steps} dropped every group ({reasons}); make the rewards within a group "
        "differ (more --completions-per-prompt, a higher --temperature, easier prompts, a reward with partial credit)"
    )


def summarize(
    state: RunState, started: float, final: str, checkpoint: Path | None, tracked: str = "reward", failed: bool = False
) -> dict[str, Any]:
    """The run's outcome; a short run compares the ``tracked`` metric of two halves that do not
    overlap (up to 10 steps each). ``exit_code`` is the one the command ends with: 1 for a run that
    ``failed`` (an error the user can fix, raised after the summary is written), else the signal's or 0."""
    history = [r for r in state.history if r is not None and math.isfinite(r)]
    window = min(10, len(history) // 2)
    return {
        "steps": state.step,
        f"{tracked}_first": sum(history[:window]) / window if window else None,
        f"{tracked}_last": sum(history[-window:]) / window if window else None,
        "window": window,
        "seconds": time.perf_counter() - started,
        "run_dir": str(state.run_dir),
        "final_policy": final,
        "checkpoint": str(checkpoint) if checkpoint else None,
        "stop_reason": state.stop_reason,
        "exit_code": EXIT_ERROR if failed else EXIT_CODES.get(state.signal, 0) if state.signal else 0,
        **state.data,
    }
