"""Weight sync for ``--sampler vllm``: the trainer's tensors into the engine in this process, without a file."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Literal

import attrs

from grpo_core import PluginError, hookimpl, option
from grpo_core.hookspecs import declared
from grpo_core.metrics import record
from grpo_core.plugins.weight_sync.vllm import VLLMWeightSync, WeightSyncMismatch, probe_difference

CHUNK_MIB = 512


@attrs.define
class VLLMEngineWeightSync:
    """Load the trainer's weights into the in-process vLLM engine from memory, then check them
    (the default of --sampler vllm).

    Each sync streams the policy's tensors, under their checkpoint names, into the engine's
    in-place reload (collective_rpc reload_weights with a weights iterator: vLLM's layerwise
    reload, which processes each layer once all its weights are in); tensors on another device
    than the engine's are copied over at most chunk_mib at a time. A full fine-tune sends every
    weight, a tied output layer as lm_head.weight of its own (vLLM rebuilds a tied output layer only
    from it); LoRA sends the merged weights of each module holding an adapted layer (the attention
    or MLP block, whole: vLLM fuses q/k/v and gate/up), the rest of the engine keeps the base model.
    Then the prefix cache is reset and a probe sequence is scored on the engine and by the trainer;
    beyond the tolerance the weights are loaded once more (on_mismatch=repair) and the run stops if
    that does not help. No file is written. Metrics: sync/bytes, sync/seconds (wake and load),
    sync/logprob_max_abs_diff, sync/repairs, time/weight_sync (all of it, the check included).
    """

    chunk_mib: int = option(CHUNK_MIB, help="most MiB of tensors copied to the engine's device at once (when on another device)")
    tolerance: float = option(1e-3, help="largest |engine - trainer| logprob on the probe accepted after a sync (fp32; larger for bf16)")
    on_mismatch: Literal["repair", "stop"] = option("repair", help="beyond the tolerance: repair (load again, stop if still off) or stop")
    probe_tokens: int = option(64, help="tokens in the probe sequence scored on both sides")

    def __attrs_post_init__(self) -> None:
        if self.chunk_mib < 1:
            raise ValueError(f"chunk_mib must be >= 1, got {self.chunk_mib}")
        if not self.tolerance > 0:
            raise ValueError(f"tolerance must be > 0, got {self.tolerance}")
        if self.probe_tokens < 2:
            raise ValueError(f"probe_tokens must be >= 2, got {self.probe_tokens}")

    @hookimpl
    def check_config(self, config: Any, plugins: dict[str, list[Any]]) -> None:
        sampler = plugins["sampler"][0]
        if declared(sampler, "sampler", "default_weight_sync") != "vllm_engine":
            raise PluginError(
                f"weight sync 'vllm_engine' loads weights into an in-process vLLM engine (--sampler vllm), not a {type(sampler).__name__}"
            )

    @hookimpl
    def weight_sync(self, trainer: Any, sampler: Any, step: int) -> int:
        load_weights = declared(sampler, "sampler object", "load_weights")
        prompt_logprobs = declared(sampler, "sampler object", "prompt_logprobs")
        if load_weights is None or prompt_logprobs is None:
            raise PluginError(
                f"weight sync 'vllm_engine' loads weights into an in-process vLLM engine (--sampler vllm), not a {type(sampler).__name__}"
            )
        started = time.perf_counter()
        version = trainer.version

        def weights() -> Iterator[tuple[str, Any]]:
            # Also called when an engine that slept at level 2 samples again before the next sync
            # (another round of the step, an eval): the trainer must still hold this version.
            if trainer.version != version:
                raise PluginError(
                    f"the vllm engine freed its weights of version {version} (sleep level 2), and the trainer now holds "
                    f"version {trainer.version}: they cannot be loaded again (--sampler-opt sleep_mode=off)"
                )
            return policy_weights(trainer)

        sent, seconds, repairs = 0, 0.0, 0
        while True:
            load_started = time.perf_counter()
            sent += load_weights(weights, self.chunk_mib * 2**20)
            seconds += time.perf_counter() - load_started
            diff = self.verify(trainer, sampler)
            if diff <= self.tolerance or self.on_mismatch == "stop" or repairs:
                break
            repairs += 1
        if diff > self.tolerance:
            raise WeightSyncMismatch(
                f"after loading policy version {trainer.version} into the vllm engine, its logprobs differ from the trainer's "
                f"by up to {diff:.3g} (tolerance {self.tolerance:g}) on a {self.probe_tokens}-token probe"
                + (", also after loading the weights again" if repairs else "")
                + ". Check that the engine runs the trainer's model in its dtype (bf16: raise --weight-sync-opt tolerance)"
            )
        sampler.version = trainer.version
        record("sync/bytes", sent, "sum")
        record("sync/seconds", seconds, "sum")
        record("sync/logprob_max_abs_diff", diff, "max")
        record("sync/repairs", repairs, "sum")
        record("time/weight_sync", time.perf_counter() - started, "sum")
        return sampler.version

    def verify(self, trainer: Any, sampler: Any) -> float:
        """The largest |engine - trainer| logprob over the probe's tokens."""
        tokens = VLLMWeightSync(probe_tokens=self.probe_tokens).probe(trainer.tokenizer, sampler.max_context)
        return probe_difference(trainer, tokens, declared(sampler, "sampler object", "prompt_logprobs")(tokens)[1:])


def policy_weights(trainer: Any) -> Iterator[tuple[str, Any]]:
    """The policy's tensors under their checkpoint names, without copies where none is needed: a
    full model's every weight (a tied output layer also as ``lm_head.weight``); a LoRA model's
    merged adapted weights and the rest of each module that holds one."""
    from grpo_core.engine.lora import as_saved, base_state_dict, has_adapters, merged_weights
    from grpo_core.engine.trainer import local_policy

    policy = local_policy(trainer)
    if not hasattr(policy, "model"):
        raise PluginError(
            f"weight sync 'vllm_engine' needs a trainer in this process (--backend local or fsdp), not {type(trainer).__name__}"
        )
    model = policy.model
    if not has_adapters(model):
        # A tied output layer is in it under its own name too (lm_head.weight), which vLLM's
        # reload needs to rebuild that layer (else it keeps its old weights).
        state = model.state_dict()
        for key, tensor in state.items():
            yield from as_saved(model, key, tensor).items()
        return
    base = base_state_dict(model)
    groups = {}
    for key in base:
        groups.setdefault(module_group(key), []).append(key)
    current, merged_keys = None, set()

    def rest_of(group: str | None) -> Iterator[tuple[str, Any]]:
        for key in groups.get(group, []) if group is not None else []:
            if key not in merged_keys:
                yield from as_saved(model, key, base[key]).items()

    # merged_weights walks the modules in order: one group's adapted weights come together.
    for key, merged in merged_weights(model, base):
        if module_group(key) != current:
            yield from rest_of(current)
            current = module_group(key)
        merged_keys.add(key)
        yield from as_saved(model, key, merged).items()
    yield from rest_of(current)


def module_group(key: str) -> str:
    """The module a weight's layer belongs to (``model.layers.0.self_attn`` for its q_proj.weight):
    what vLLM loads as one (fused q/k/v, gate/up) lies within it."""
    return key.rsplit(".", 2)[0]
