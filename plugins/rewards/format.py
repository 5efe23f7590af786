from __future__ import annotations

import re
from collections.abc import Sequence

import attrs

from grpo_core import Prompt, Sample, hookimpl, option


def _compiles(instance: object, attribute: attrs.Attribute, value: str) -> None:
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"pattern {value!r} is not a regular expression: {exc}") from None


@attrs.define
class FormatReward:
    """Format shaping: 1.0 when the completion matches `pattern`, else 0.0.

    The default pattern asks for a GSM8K-style final line "#### N". Weigh it lightly beside a
    correctness reward, e.g. `--reward gsm8k --reward format:0.1`.

    ``needs_answer = False``: it reads the completion only, so dataset rows need no answer.
    """

    needs_answer = False

    pattern: str = option(r"(?m)^####\s*-?[\d,]*\.?\d+\s*$", help="regular expression searched in the completion", validator=_compiles)

    @hookimpl
    def reward(self, prompt: Prompt, samples: Sequence[Sample]) -> list[float]:
        regex = re.compile(self.pattern)
        return [1.0 if regex.search(s.text) else 0.0 for s in samples]
