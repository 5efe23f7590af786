"""The in-process sampler: batched, KV-cached generation with the trainer's model (``--sampler local``)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any, Literal

import attrs
import torch

from grpo_core import Completion, SamplingParams, hookimpl, option
from grpo_core.config import RunConfig
from grpo_core.engine import sampling
from grpo_core.engine.decoding import (
    CHECK_EVERY,
    KEPT_SESSIONS,
    CudaStepGraph,
    DecodeLoop,
    DecodeSession,
    DrawRule,
    ModelForward,
    StepGraph,
    compile_cache_dir,
    decode_mode,
    forward_path,
    fused_problem,
    model_forward,
    round_capacity,
    stepper_class,
    stepper_for,
    stop_window_text,
)
from grpo_core.engine.fast_decoder import FastDecoder
from grpo_core.engine.logprobs import left_padded_positions, pad_rows
from grpo_core.engine.lora import frozen_copy, load_trained_state_dict, trained_state_dict
from grpo_core.engine.models import resolve_precision
from grpo_core.engine.moe_routing import RoutingTap, routing_problem, tapped
from grpo_core.engine.trainer import LocalTrainer, local_policy
from grpo_core.engine.vision import PlacedImages
from grpo_core.errors import PluginError
from grpo_core.loss import validate_positive
from grpo_core.metrics import record


@attrs.define
class LocalSamplerPlugin:
    """Generate in this process with the local trainer's model (the local backend's sampler).

    All completions of a step are generated in one batched, KV-cached loop, each prompt prefilled
    once for its group, and the logprob of every sampled token is reported. With
    weight_sync_interval=1 it samples from the trainer's own weights, so weight sync is free;
    otherwise from a copy of its own that weight sync refreshes.
    """

    batch_size: int = option(0, help="most sequences generated at once (0 = the whole step)")
    decode: Literal["auto", "eager", "graphs", "compiled"] = option(
        "auto",
        help="the decode step: the fused decoder's whole step (forward, one-pass sampler, stop bookkeeping) torch.compile'd, "
        "kept across generations and, on CUDA, captured in a CUDA graph per batch bucket (compiled); captured in a CUDA graph "
        "(graphs, CUDA only); or run op by op (eager); auto = compiled on CUDA where the fused decoder runs the model and "
        "Triton is installed, else graphs; eager on a CPU",
    )
    check_every: int = option(
        CHECK_EVERY,
        help="decode steps between the host's looks at the batch (stop strings, all rows finished): one device->host copy each",
        validator=validate_positive,
    )

    @hookimpl
    def check_config(self, config: RunConfig) -> None:
        # The model's device is the run's: a decode path it cannot take is refused before it loads.
        decode_mode(self.decode, resolve_precision(config.device, config.dtype)[0])

    @hookimpl
    def make_sampler(self, config: RunConfig, trainer: Any) -> LocalSampler:
        trainer = local_policy(trainer)
        if not isinstance(trainer, LocalTrainer):
            raise PluginError(
                f"the local sampler needs the local trainer's model, not a {type(trainer).__name__}; choose another --sampler"
            )
        decode = decode_mode(self.decode, trainer.device, fused_problem(trainer.model, trainer.fast_forward))
        print(f"sampler forward: {forward_path(trainer.model, trainer.fast_forward)}", file=sys.stderr)
        own_weights = config.sampling_runs_ahead
        sampler = LocalSampler(
            model=frozen_copy(trainer.model) if own_weights else trainer.model,
            tokenizer=trainer.tokenizer,
            device=trainer.device,
            seed=config.seed,
            fast_forward=trainer.fast_forward,
            batch_size=self.batch_size,
            version=trainer.version,
            own_weights=own_weights,
            decode=decode,
            check_every=self.check_every,
        )
        print(f"sampler decode: {sampler.decode_path}", file=sys.stderr)
        return sampler


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
    decode: str = "eager"
    """``eager``, ``graphs`` or ``compiled`` (:func:`decode_mode`)."""
    check_every: int = CHECK_EVERY
    graph_factory: Callable[[], StepGraph] = CudaStepGraph
    graph_problem: str | None = None
    """Why the decode step runs eager although graphs were asked for (a capture failed)."""
    compile_problem: str | None = None
    """Why decode=compiled runs its step uncompiled (a compile failed)."""
    sessions: dict[tuple[Any, ...], DecodeSession] = attrs.field(init=False, factory=dict)
    """The compiled step's kept sessions, least recently used first."""
    compiles_reported: set[tuple[int, int]] = attrs.field(init=False, factory=set)
    decode_steps: int = attrs.field(init=False, default=0)
    decode_seconds: float = attrs.field(init=False, default=0.0)
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
        return {"forward": forward_path(self.model, self.fast_forward), "decode": self.decode_path}

    @property
    def captures(self) -> bool:
        """Whether the decode step is captured in a CUDA graph (graphs; compiled on CUDA), no
        capture having failed."""
        return self.graph_problem is None and (self.decode == "graphs" or (self.decode == "compiled" and self.device.type == "cuda"))

    @property
    def decode_path(self) -> str:
        """How each decoded token runs, in words (for the run's first lines and run_info)."""
        forward = stepper_class(self.forward_fn).description
        looks = f"the host looks every {self.check_every} steps"
        if self.decode == "eager":
            return f"eager ({forward}; {looks})"
        if self.decode == "compiled":
            replay = "replayed as a CUDA graph per batch bucket" if self.captures else "run without a graph"
            problems = [p for p in (self.compile_problem, self.graph_problem) if p is not None]
            why = "".join(f": {p}" for p in problems)
            return (
                f"compiled{why}: the fused step (forward, one-pass sampler, stop bookkeeping) torch.compile'd once per batch bucket "
                f"and {replay}, cache and buffers kept across generations, capacity rounded up to a multiple of "
                f"{round_capacity(1)}, live rows compacted once half have finished ({forward}; {looks}; "
                f"compile cache {compile_cache_dir()})"
            )
        if self.graph_problem is not None:
            return f"eager: {self.graph_problem} ({forward}; {looks})"
        return f"graphs: the decode step replayed as a CUDA graph ({forward}; {looks})"

    @property
    def max_context(self) -> int | None:
        return getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

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

    takes_images = True
    """Image prompts' tensors are placed over their image tokens in the prefill (declared in hookspecs)."""

    def sample(
        self, prompts: Sequence[list[int]], num_samples: int, params: SamplingParams, images: Sequence[Any] | None = None
    ) -> list[list[Completion]]:
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
        # 1: the fused decoder samples, 0: transformers' forward (why: config.json's run_info).
        record("perf/forward_path", float(isinstance(self.forward_fn, FastDecoder)), "max")
        per_call = max(1, self.batch_size // num_samples) if self.batch_size else len(prompts)
        groups: list[list[Completion]] = []
        steps, seconds = self.decode_steps, self.decode_seconds
        for start in range(0, len(prompts), per_call):
            groups.extend(
                self._generate(
                    [list(p) for p in prompts[start : start + per_call]],
                    num_samples,
                    params,
                    None if images is None else images[start : start + per_call],
                )
            )
        steps, seconds = self.decode_steps - steps, self.decode_seconds - seconds
        if steps:
            # perf/sample_tokens_per_s is the core's, for every sampler: the step's tokens over its sampling seconds.
            record("perf/decode_ms_per_step", 1000 * seconds / steps, "mean", weight=steps)
        return groups

    def _stop_token_ids(self, params: SamplingParams) -> set[int]:
        ids = set(params.stop_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        return ids

    def _generate(self, prompts: list[list[int]], G: int, params: SamplingParams, images: Sequence[Any] | None) -> list[list[Completion]]:
        if self.routing_problem is not None:
            return self._generate_tapped(prompts, G, params, None, images)
        with tapped(self.model) as tap:
            return self._generate_tapped(prompts, G, params, tap, images)

    @torch.inference_mode()
    def _generate_tapped(
        self, prompts: list[list[int]], G: int, params: SamplingParams, tap: RoutingTap | None, images: Sequence[Any] | None
    ) -> list[list[Completion]]:
        """Batched sampling over a static KV cache (:mod:`grpo_core.engine.decoding`).

        Each prompt is prefilled once and its cache repeated for its G completions; the batch keeps
        its shape to the end (a finished row is masked). With a ``tap`` (a mixture-of-experts
        model) each forwarded token's experts are recorded.
        """
        input_ids, attention = pad_rows(prompts, left=True, pad=self.tokenizer.pad_token_id or 0)
        U, P = input_ids.shape
        position_ids = left_padded_positions(attention, U, P).to(self.device)
        valid_U_P = None if attention is None else attention.to(self.device)
        stop_ids = torch.tensor(sorted(self._stop_token_ids(params)), dtype=torch.long, device=self.device)
        placed = nullcontext()
        if images is not None and any(i is not None for i in images):
            # Left-padded: a prompt's tokens are its row's last len(prompt) positions.
            offsets = [u * P + P - len(p) for u, p in enumerate(prompts)]
            tensors = [None if i is None else i.tensors for i in images]
            placed = PlacedImages(self.model, prompts, tensors, [len(p) for p in prompts]).placed(offsets)
        session = None
        with placed:
            if self.decode == "compiled":
                session = self._session(U * G, P + params.max_tokens, params, stop_ids)
                stepper = session.stepper
                logits_U_V = stepper.refill(input_ids.to(self.device), position_ids, valid_U_P, G)
            else:
                stepper = stepper_for(self.forward_fn, capacity=P + params.max_tokens)
                logits_U_V = stepper.prefill(input_ids.to(self.device), position_ids, valid_U_P)
                stepper.expand(G)
        if tap is not None:
            # Left-padded: a prompt's tokens are its row's last len(prompt) positions.
            prefill_U_P_L_K = tap.take().view(U, P, *tap.used_shape)
            prompt_routes = [prefill_U_P_L_K[u, P - len(p) :] for u, p in enumerate(prompts)]
        valid_B_C = torch.zeros(U * G, stepper.capacity, dtype=torch.bool, device=self.device)
        valid_B_C[:, :P] = True if valid_U_P is None else valid_U_P.bool().repeat_interleave(G, dim=0)
        loop = DecodeLoop(
            stepper=stepper,
            logits_B_V=logits_U_V.repeat_interleave(G, dim=0),
            position_B_1=position_ids[:, -1:].repeat_interleave(G, dim=0),
            valid_B_C=valid_B_C,
            prompt_width=P,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            stop_ids=stop_ids,
            generator=self.generator,
            stop_text=(lambda tokens: self._hit_stop_string(tokens, params.stop)) if params.stop else None,
            check_every=self.check_every,
            graph_factory=self.graph_factory if self.captures else None,
            # The routes stay on the device until the end (the tap's own take() copies each step off it).
            routes=None if tap is None else lambda: torch.stack([t.to(tap.dtype) for t in tap.used], dim=1),
            session=session,
        )
        decoded = loop.run()
        if loop.graph_problem is not None and self.graph_problem is None:
            self.graph_problem = loop.graph_problem
            print(f"sampler decode: {self.decode_path}", file=sys.stderr)
        if session is not None and session.compile_problem is not None and self.compile_problem is None:
            self.compile_problem = session.compile_problem
            print(f"sampler decode: {self.decode_path}", file=sys.stderr)
        self.decode_steps += decoded.steps
        self.decode_seconds += decoded.seconds
        record("perf/decode_rows_per_step", decoded.rows_per_step, "mean", weight=decoded.steps)
        record("perf/decode_attended_per_step", decoded.width_per_step, "mean", weight=decoded.steps)
        if session is not None:
            for rows, seconds in session.compile_seconds.items():
                if (id(session), rows) not in self.compiles_reported:
                    self.compiles_reported.add((id(session), rows))
                    compiled = f"the step for {rows} rows x {stepper.capacity} slots compiled in {seconds:.1f} s"
                    print(f"sampler decode: {compiled}", file=sys.stderr)
                    record("perf/decode_compile_s", seconds, "sum")
        completions = [
            Completion(
                tokens=decoded.tokens_B_M[i, :n].tolist(),
                logprobs=decoded.logprobs_B_M[i, :n].tolist(),
                finish_reason="stop" if stopped else "length",
                routed_experts=None if tap is None else torch.cat([prompt_routes[i // G], decoded.routes_B_M_L_K[i, : n - 1]]),
            )
            for i, (n, stopped) in enumerate(zip(decoded.lengths_B.tolist(), decoded.stopped_B.tolist()))
        ]
        return [completions[i * G : (i + 1) * G] for i in range(len(prompts))]

    def _session(self, rows: int, slots: int, params: SamplingParams, stop_ids: torch.Tensor) -> DecodeSession:
        """The kept compiled session for this batch, capacity bucket and sampling rules (opened on
        first use; the least recently used one dropped past :data:`KEPT_SESSIONS`)."""
        capacity = round_capacity(slots)
        key = (rows, capacity, params.max_tokens, params.temperature, params.top_k, params.top_p, tuple(stop_ids.tolist()))
        session = self.sessions.pop(key, None)
        if session is None:
            if len(self.sessions) >= KEPT_SESSIONS:
                self.sessions.pop(next(iter(self.sessions)))
            rule = DrawRule(sampling.sample, params.temperature, params.top_k, params.top_p, stop_ids)
            vocab = self.model.get_output_embeddings().weight.shape[0]
            dtype = next(self.model.parameters()).dtype
            session = DecodeSession.open(self.forward_fn, rows, capacity, params.max_tokens, vocab, dtype, rule)
            session.compile_problem = self.compile_problem  # a compile that failed is not tried again
        self.sessions[key] = session
        return session

    def _hit_stop_string(self, completion: Sequence[int], stops: list[str]) -> bool:
        text = stop_window_text(self.tokenizer, completion, stops)
        return any(s in text for s in stops)
