from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import attrs

from grpo_core import hookimpl, option
from grpo_core.metrics import record
from grpo_core.types import Prompt, Sample


def _at_least_one(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


@attrs.define
class Curriculum:
    """An online curriculum: pass over the prompts the policy always or never solves.

    Each step's groups update their prompt's pass rate (the share of its samples whose total reward
    reaches threshold), kept over the prompt's last `window` groups. A prompt whose rate over a
    full window is 1 (always solved) or 0 (never solved) rests: the next `rest` times the run's
    order comes to it, it is passed over and the next prompt rolled out in its place (outside a
    mixture, once per epoch: --epochs 3 with rest=1 skips it in the next epoch, then measures it
    again). Such a group teaches nothing under a group-relative advantage; skipping it before the
    rollout saves its sampling. Counts per step: sampling/passed_over, curriculum/passed_over_solved,
    curriculum/passed_over_unsolved, curriculum/resting (prompts resting when the step took its
    prompts). Its state is in every checkpoint: a resumed run skips as the uninterrupted one.
    """

    threshold: float = option(1.0, help="a sample solves its prompt when its total reward reaches this")
    window: int = option(1, help="a prompt's last groups its pass rate is measured over", validator=_at_least_one)
    rest: int = option(1, help="times the order passes over a prompt that was always or never solved", validator=_at_least_one)
    _rates: dict[str, list[float]] = attrs.field(factory=dict, init=False)
    """Prompt id -> its last pass rates (up to ``window``)."""
    _resting: dict[str, list[Any]] = attrs.field(factory=dict, init=False)
    """Prompt id -> [passes left, "solved" or "unsolved"]."""
    # The async loop's workers take prompts while its main thread observes steps and checkpoints.
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"rates": {k: list(v) for k, v in self._rates.items()}, "resting": {k: list(v) for k, v in self._resting.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._rates = {k: list(v) for k, v in state["rates"].items()}
            self._resting = {k: list(v) for k, v in state["resting"].items()}

    @hookimpl
    def keep_prompt(self, prompt: Prompt) -> bool:
        with self._lock:
            record("curriculum/resting", len(self._resting), "max")
            if prompt.id not in self._resting:
                return True
            left, why = self._resting[prompt.id]
            record(f"curriculum/passed_over_{why}", 1, "sum")
            if left > 1:
                self._resting[prompt.id] = [left - 1, why]
            else:
                del self._resting[prompt.id]  # measured afresh when it comes back
            return False

    @hookimpl
    def on_step(self, step: int, metrics: dict[str, float], state: Any, groups: Sequence[Sequence[Sample]]) -> None:
        with self._lock:
            for group in groups:
                scores = [s.reward for s in group if s.reward is not None]
                if not scores:
                    continue  # no sample scored: nothing learned of the prompt
                prompt_id = group[0].prompt.id
                passed = sum(score >= self.threshold for score in scores) / len(scores)
                recent = self._rates[prompt_id] = [*self._rates.get(prompt_id, []), passed][-self.window :]
                if len(recent) == self.window and (all(r == 1.0 for r in recent) or all(r == 0.0 for r in recent)):
                    self._resting[prompt_id] = [self.rest, "solved" if recent[0] == 1.0 else "unsolved"]
                    del self._rates[prompt_id]
