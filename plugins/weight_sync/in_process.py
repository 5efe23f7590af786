from __future__ import annotations

import attrs

from grpo_core import PluginError, hookimpl
from grpo_core.hookspecs import declared


@attrs.define
class InProcessWeightSync:
    """Hand the trainer's weights to a sampler in the same process (the local backend's default).

    Free when the sampler shares the trainer's weights; a copy when it samples ahead on its own.
    """

    @hookimpl
    def weight_sync(self, trainer, sampler, step: int) -> int:
        load_weights_from = declared(sampler, "sampler object", "load_weights_from")
        if load_weights_from is None:
            raise PluginError(
                f"--weight-sync in_process hands weights to a sampler in this process; "
                f"a {type(sampler).__name__} needs its own (e.g. --weight-sync vllm)"
            )
        load_weights_from(trainer)
        return sampler.version
