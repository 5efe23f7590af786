from __future__ import annotations

from collections.abc import Sequence

import attrs

from grpo_core import hookimpl
from grpo_core.types import Prompt, Sample


@attrs.define
class ZeroVarianceFilter:
    """Drop a group whose advantages are all 0: it carries no learning signal (for an outcome-only
    advantage, its rewards are all equal). On by default (--drop-zero-variance-groups); its drops are
    counted in groups/dropped_zero_variance."""

    @hookimpl
    def keep_group(self, prompt: Prompt, samples: Sequence[Sample]) -> bool:
        return any(a != 0 for s in samples for a in (s.advantages or ()))
