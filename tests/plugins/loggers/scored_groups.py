"""Scored prompt groups as ``on_step`` hands them to loggers, built by hand."""

from __future__ import annotations

from grpo_core.types import Prompt, Sample


def sample(prompt: Prompt, text: str, rewards: dict[str, float | None], advantage: float | None, completion_tokens: int = 2) -> Sample:
    """A sample of a 3-token prompt: its completion trained on, with ``advantage`` on every token."""
    n = 3 + completion_tokens
    known = [v for v in rewards.values() if v is not None]
    return Sample(
        prompt=prompt,
        tokens=list(range(n)),
        sampling_logprobs=[0.0] * n,
        loss_mask=[0.0] * 3 + [1.0] * completion_tokens,
        text=text,
        finish_reason="stop",
        policy_version=0,
        reward=sum(known) if len(known) == len(rewards) else None,
        rewards=rewards,
        advantages=None if advantage is None else [advantage] * n,
    )


def two_groups() -> list[list[Sample]]:
    """Group 0: a plain prompt with two samples; group 1: a chat whose second sample failed its gsm8k score."""
    plain = Prompt(id="d.jsonl:1", text="Q: 2+2?\nA:", answer="4")
    chat = Prompt(id="d.jsonl:2", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}], answer="2")
    return [
        [
            sample(plain, " 4\n#### 4", {"gsm8k": 1.0, "format": 0.5}, 0.75),
            sample(plain, " five `x`", {"gsm8k": 0.0, "format": 0.0}, -0.75),
        ],
        [sample(chat, "2", {"gsm8k": 1.0, "format": 0.0}, None), sample(chat, "?", {"gsm8k": None, "format": 0.0}, None, 3)],
    ]


EXPECTED_ROWS = [
    {"group": 0, "sample": 0, "prompt": "Q: 2+2?\nA:", "completion": " 4\n#### 4", "reward/total": 1.5, "reward/gsm8k": 1.0,
     "reward/format": 0.5, "advantage": 0.75, "tokens": 2, "finish_reason": "stop"},
    {"group": 0, "sample": 1, "prompt": "Q: 2+2?\nA:", "completion": " five `x`", "reward/total": 0.0, "reward/gsm8k": 0.0,
     "reward/format": 0.0, "advantage": -0.75, "tokens": 2, "finish_reason": "stop"},
    {"group": 1, "sample": 0, "prompt": "system: be brief\nuser: 1+1?", "completion": "2", "reward/total": 1.0, "reward/gsm8k": 1.0,
     "reward/format": 0.0, "advantage": None, "tokens": 2, "finish_reason": "stop"},
    {"group": 1, "sample": 1, "prompt": "system: be brief\nuser: 1+1?", "completion": "?", "reward/total": None, "reward/gsm8k": None,
     "reward/format": 0.0, "advantage": None, "tokens": 3, "finish_reason": "stop"},
]  # fmt: skip
"""What every logger's sample table holds for ``two_groups()`` (beside the step)."""
