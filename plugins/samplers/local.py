"""The in-process sampler: batched, KV-cached generation with the trainer's model (``--sampler local``)."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from grpo_core import Completion, SamplingParams, hookimpl, option
from grpo_core.config import RunConfig
from grpo_core.engine.logprobs import left_padded_positions, pad_rows
from grpo_core.engine.lora import frozen_copy, load_trained_state_dict, trained_state_dict
from grpo_core.engine.moe_routing import RoutingTap, routing_problem, tapped
from grpo_core.engine.trainer import LocalTrainer
from grpo_core.errors import PluginError
from grpo_core.hookspecs import declared
from grpo_core.metrics import record
from grpo_core.plugins.backends.fast_decoder import FastDecoder
from grpo_core.plugins.backends.local import ModelForward, forward_path, model_forward


@attrs.define
class LocalSamplerPlugin:
    """Generate in this process with the local trainer's model (the local backend's sampler).

    All completions of a step are generated in one batched, KV-cached loop, each prompt prefilled
    once for its group, and the logprob of every sampled token is reported. With
    weight_sync_interval=1 it samples from the trainer's own weights, so weight sync is free;
    otherwise from a copy of its own that weight sync refreshes.
    """

    batch_size: int = option(0, help="most sequences generated at once (0 = the whole step)")

    @hookimpl
    def make_sampler(self, config: RunConfig, trainer: Any) -> LocalSampler:
        trainer = local_policy(trainer)
        if not isinstance(trainer, LocalTrainer):
            raise PluginError(
                f"the local sampler needs the local trainer's model, not a {type(trainer).__name__}; choose another --sampler"
            )
        print(f"sampler forward: {forward_path(trainer.model, trainer.fast_forward)}", file=sys.stderr)
        own_weights = config.sampling_runs_ahead
        return LocalSampler(
            model=frozen_copy(trainer.model) if own_weights else trainer.model,
            tokenizer=trainer.tokenizer,
            device=trainer.device,
            seed=config.seed,
            fast_forward=trainer.fast_forward,
            batch_size=self.batch_size,
            version=trainer.version,
            own_weights=own_weights,
        )


def local_policy(trainer: Any) -> Any:
    """The local trainer whose model the sampler generates with: the trainer itself, or the whole
    copy a trainer that is not local keeps in this process for sampling (``local_policy()``: the
    fsdp trainer's, on rank 0)."""
    policy = declared(trainer, "trainer object", "local_policy")
    return policy() if policy is not None else trainer


@attrs.define(eq=False)
class LocalSampler:
    model: Any
    tokenizer: Any
    device: torch.device
    seed: int
    fast_forward: bool = True
    batch_size: int = 0
    version: int = 0
    own_weights: bool = False
    """Samples from a copy of its own (ahead of training), not from the trainer's weights."""
    generator: torch.Generator = attrs.field(init=False)
    forward_fn: ModelForward = attrs.field(init=False)
    routing_problem: str | None = attrs.field(init=False)
    """Why it does not record a mixture-of-experts model's routing (None: every completion
    carries its ``routed_experts``; declared in hookspecs)."""

    def __attrs_post_init__(self) -> None:
        self.generator = torch.Generator(self.device).manual_seed(self.seed)
        self.forward_fn = model_forward(self.model, self.fast_forward)
        self.routing_problem = routing_problem(self.model)

    @property
    def run_info(self) -> dict[str, str]:
        """How it samples, for config.json (declared in hookspecs)."""
        return {"forward": forward_path(self.model, self.fast_forward)}

    @property
    def max_context(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def load_weights_from(self, trainer: Any) -> None:
        trainer = local_policy(trainer)
        if self.model is not trainer.model:
            # A LoRA copy shares the frozen base weights with the trainer: only the adapters move.
            load_trained_state_dict(self.model, trained_state_dict(trainer.model))
        self.version = trainer.version

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to sample on exactly as before: the RNG, the version, and the
        weights when sampling runs ahead on a copy of its own (weight_sync_interval > 1)."""
        state: dict[str, Any] = {"generator": self.generator.get_state(), "version": self.version}
        if self.own_weights:
            # A copy: a checkpoint taken at a step boundary must not follow later syncs.
            state["model"] = {k: v.detach().clone() for k, v in trained_state_dict(self.model).items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.version = state["version"]
        if "model" in state:
            load_trained_state_dict(self.model, state["model"])

    def sample(self, prompts: Sequence[list[int]], num_samples: int, params: SamplingParams) -> list[list[Completion]]:
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
        # 1: the fused decoder samples, 0: transformers' forward (why: config.json's run_info).
        record("perf/forward_path", float(isinstance(self.forward_fn, FastDecoder)), "max")
        per_call = max(1, self.batch_size // num_samples) if self.batch_size else len(prompts)
        groups: list[list[Completion]] = []
        for start in range(0, len(prompts), per_call):
            groups.extend(
                self._generate(
                    [list(p) for p in prompts[start : start + per_call]],
                    num_samples,
                    params,
                )
            )
        return groups

    def _stop_token_ids(self, params: SamplingParams) -> set[int]:
        ids = set(params.stop_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        return ids

    def _generate(self, prompts: list[list[int]], G: int, params: SamplingParams) -> list[list[Completion]]:
        if self.routing_problem is not None:
            return self._generate_tapped(prompts, G, params, None)
        with tapped(self.model) as tap:
            return self._generate_tapped(prompts, G, params, tap)

    @torch.inference_mode()
    def _generate_tapped(self, prompts: list[list[int]], G: int, params: SamplingParams, tap: RoutingTap | None) -> list[list[Completion]]:
        """Batched sampling with a KV cache.

        Each prompt is prefilled once and its cache repeated for its G completions; finished
        sequences leave the batch, so they stop costing compute. With a ``tap`` (a mixture-of-experts
        model) each forwarded token's experts are recorded.
        """
        input_ids, attention = pad_rows(prompts, left=True, pad=self.tokenizer.pad_token_id or 0)
        U, P = input_ids.shape
        position_ids = left_padded_positions(attention, U, P).to(self.device)
        attention = None if attention is None else attention.to(self.device)
        # Fused once per call: in-process weight sync means the weights may have changed since.
        weights = self.forward_fn.layer_weights()
        cache = self.forward_fn.new_cache(capacity=P + params.max_tokens)
        logits = self.forward_fn(
            input_ids=input_ids.to(self.device), position_ids=position_ids, attention_mask=attention,
            past_key_values=cache, logits_to_keep=1, weights=weights,
        )[:, -1, :].float()  # fmt: skip
        if tap is not None:
            # Left-padded: a prompt's tokens are its row's last len(prompt) positions.
            prefill_U_P_L_K = tap.take().view(U, P, *tap.used_shape)
            prompt_routes = [prefill_U_P_L_K[u, P - len(p) :] for u, p in enumerate(prompts)]
            drawn_routes_B_M_L_K = torch.zeros(len(prompts) * G, params.max_tokens, *tap.used_shape, dtype=tap.dtype)
        cache.batch_repeat_interleave(G)
        attention = None if attention is None else attention.repeat_interleave(G, dim=0)
        position_ids = position_ids[:, -1:].repeat_interleave(G, dim=0)
        logits = logits.repeat_interleave(G, dim=0)

        B = len(prompts) * G
        stop_ids = torch.tensor(sorted(self._stop_token_ids(params)), device=self.device)
        tokens_B_L = torch.zeros(B, params.max_tokens, dtype=torch.long)
        logprobs_B_L = torch.zeros(B, params.max_tokens)
        lengths_B = torch.full((B,), params.max_tokens, dtype=torch.long)
        stopped_B = torch.zeros(B, dtype=torch.bool)
        active = torch.arange(B)
        for step in range(params.max_tokens):
            token_A, logprob_A = self._draw(logits, params)
            token_cpu, logprob_cpu = token_A.cpu(), logprob_A.cpu()
            tokens_B_L[active, step] = token_cpu
            logprobs_B_L[active, step] = logprob_cpu
            done_A = torch.isin(token_A, stop_ids).cpu()
            if params.stop:
                for j, row in enumerate(active.tolist()):
                    if not done_A[j] and self._hit_stop_string(tokens_B_L[row, : step + 1].tolist(), params.stop):
                        done_A[j] = True
            lengths_B[active[done_A]] = step + 1
            stopped_B[active[done_A]] = True
            if bool(done_A.all()) or step == params.max_tokens - 1:
                break
            if bool(done_A.any()):
                keep = torch.nonzero(~done_A).squeeze(-1)
                cache.batch_select_indices(keep.to(self.device))
                keep_dev = keep.to(self.device)
                position_ids, token_A = position_ids[keep_dev], token_A[keep_dev]
                attention = None if attention is None else attention[keep_dev]
                active = active[keep]
            if attention is not None:
                attention = torch.cat([attention, attention.new_ones(len(active), 1)], dim=1)
            position_ids = position_ids + 1
            logits = self.forward_fn(
                input_ids=token_A.unsqueeze(-1), position_ids=position_ids, attention_mask=attention,
                past_key_values=cache, logits_to_keep=1, weights=weights,
            )[:, -1, :].float()  # fmt: skip
            if tap is not None:
                drawn_routes_B_M_L_K[active, step] = tap.take()
        completions = [
            Completion(
                tokens=tokens_B_L[i, :n].tolist(),
                logprobs=logprobs_B_L[i, :n].tolist(),
                finish_reason="stop" if stopped else "length",
                routed_experts=None if tap is None else torch.cat([prompt_routes[i // G], drawn_routes_B_M_L_K[i, : n - 1]]),
            )
            for i, (n, stopped) in enumerate(zip(lengths_B.tolist(), stopped_B.tolist()))
        ]
        return [completions[i * G : (i + 1) * G] for i in range(len(prompts))]

    def _draw(self, logits_A_V: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per row; its logprob is under the distribution actually sampled from."""
        if params.temperature == 0:
            # Greedy: a point mass on the argmax, so every chosen token has logprob 0.
            token_A = logits_A_V.argmax(-1)
            return token_A, torch.zeros_like(token_A, dtype=logits_A_V.dtype)
        logits_A_V = logits_A_V / params.temperature
        if params.top_k > 0 and params.top_k < logits_A_V.shape[-1]:
            kth = torch.topk(logits_A_V, params.top_k, dim=-1).values[:, -1:]
            logits_A_V = logits_A_V.masked_fill(logits_A_V < kth, -math.inf)
        if params.top_p < 1.0:
            sorted_logits, order = torch.sort(logits_A_V, descending=True, dim=-1)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            # Drop a token once the mass before it already reaches top_p (the top token always stays).
            drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            logits_A_V = logits_A_V.masked_fill(drop, -math.inf)
        logprobs_A_V = logits_A_V.log_softmax(-1)
        # Inverse-CDF draw: one uniform per row, where multinomial draws one per vocabulary entry.
        cdf_A_V = logprobs_A_V.exp().cumsum(-1)
        u_A = torch.rand(cdf_A_V.shape[0], 1, generator=self.generator, device=cdf_A_V.device).clamp_(min=1e-12)
        token_A = torch.searchsorted(cdf_A_V, u_A * cdf_A_V[:, -1:]).squeeze(-1).clamp_(max=cdf_A_V.shape[-1] - 1)
        return token_A, logprobs_A_V.gather(-1, token_A.unsqueeze(-1)).squeeze(-1)

    def _hit_stop_string(self, completion: list[int], stops: list[str]) -> bool:
        # Only the tail can complete a stop string: decode a window, not the whole completion.
        window = max(len(s) for s in stops) + 8
        text = self.tokenizer.decode(completion[-window:], skip_special_tokens=False)
        return any(s in text for s in stops)
