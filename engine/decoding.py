"""The local sampler's decode loop, shaped for a GPU: everything a decoded token needs stays on the
device, in buffers of fixed shape written in place, so the step can be captured in a CUDA graph.

- The KV cache is preallocated for prompt + completion and written in place at one slot per step
  (transformers' ``StaticCache``, or the fused decoder's :class:`KVCache` with its ``slot_1``).
- The batch is fixed: a finished row stays in it, masked, and its tokens past the end are cut.
- Sampling (temperature, top-k, top-p), the logprob of the distribution sampled from and the stop
  tokens are decided on the device. Stop strings need the text: they are checked on the host every
  ``check_every`` steps, together with whether every row has finished (the one device→host copy per
  ``check_every`` steps), and at the end.
- The uniforms the draws use are drawn before the loop, in the order the sampler always used (one
  per live row per step, rows in order): the captured step holds no random number generator, so a
  run repeats from the seed whether graphed or not, and on the CPU the tokens equal the
  one-step-at-a-time loop's. A row found past a stop string only at a check drew in the steps
  between, so later rows' uniforms shift from there on: each still gets a fresh uniform of its own,
  so the distribution sampled from is the same (tests/engine/test_decoding.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import torch

from grpo_core.engine.fast_decoder import FastDecoder, unsupported_reason
from grpo_core.engine.forward import TransformersForward
from grpo_core.errors import PluginError

DECODE_MODES = ("auto", "eager", "graphs")
CHECK_EVERY = 16
"""Steps between the host's looks at the batch (stop strings, whether all rows finished)."""
GRAPH_WARMUP_STEPS = 2
"""Eager steps before the capture: the first calls pick kernels and allocate workspaces a graph
must not record."""


def decode_mode(mode: str, device: torch.device) -> str:
    """``eager`` or ``graphs``: what the sampler option ``decode=mode`` runs on ``device``."""
    if mode not in DECODE_MODES:
        raise PluginError(f"decode={mode!r} is not a decode path: choose one of {', '.join(DECODE_MODES)}")
    if mode == "graphs" and device.type != "cuda":
        raise PluginError(
            f"decode=graphs captures the decode step in a CUDA graph, and the model is on {device.type}: "
            "use decode=eager (or auto, which picks graphs on CUDA)"
        )
    return "graphs" if device.type == "cuda" and mode != "eager" else "eager"


def draw(
    logits_B_V: torch.Tensor, temperature: float, top_k: int, top_p: float, u_B_1: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from the rules' distribution, by inverse CDF at the uniform ``u_B_1``,
    and its logprob under the distribution actually sampled from (greedy: 0, no uniform used)."""
    if temperature == 0:
        # Greedy: a point mass on the argmax, so every chosen token has logprob 0.
        token_B = logits_B_V.argmax(-1)
        return token_B, torch.zeros_like(token_B, dtype=logits_B_V.dtype)
    logits_B_V = logits_B_V / temperature
    if 0 < top_k < logits_B_V.shape[-1]:
        kth = torch.topk(logits_B_V, top_k, dim=-1).values[:, -1:]
        logits_B_V = logits_B_V.masked_fill(logits_B_V < kth, -math.inf)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits_B_V, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p (the top token always stays).
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits_B_V = logits_B_V.masked_fill(drop, -math.inf)
    logprobs_B_V = logits_B_V.log_softmax(-1)
    cdf_B_V = logprobs_B_V.exp().cumsum(-1)
    u_B_1 = u_B_1.clamp(min=1e-12)
    token_B = torch.searchsorted(cdf_B_V, u_B_1 * cdf_B_V[:, -1:]).squeeze(-1).clamp_(max=cdf_B_V.shape[-1] - 1)
    return token_B, logprobs_B_V.gather(-1, token_B.unsqueeze(-1)).squeeze(-1)


def stop_window_text(tokenizer: Any, completion: Sequence[int], stops: Sequence[str]) -> str:
    """The text of the completion's tail that can complete a stop string (a window, not the whole)."""
    window = max(len(s) for s in stops) + 8
    return tokenizer.decode(list(completion[-window:]), skip_special_tokens=False)


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """The decode loop's one way off the device (a numpy array, so that no host-side use of it reads
    the device again)."""
    return tensor.cpu().numpy()


class Stepper(Protocol):
    """A forward over a static cache: the prompts once, then one token per row per step."""

    description: str

    def prefill(self, input_ids_U_P: torch.Tensor, position_ids_U_P: torch.Tensor, valid_U_P: torch.Tensor | None) -> torch.Tensor: ...
    def expand(self, repeats: int) -> None: ...
    def step(self, token_B_1: torch.Tensor, position_B_1: torch.Tensor, valid_B_C: torch.Tensor, slot_1: torch.Tensor) -> torch.Tensor: ...


def _prompt_mask(valid_U_P: torch.Tensor | None, U: int, P: int, C: int, device: torch.device) -> torch.Tensor:
    """[U, 1, P, C] keys each prompt position may see: earlier real tokens of its row, and itself
    (so a padding position never attends to nothing, and never makes a NaN its row could read)."""
    slot_C = torch.arange(C, device=device)
    query_P_1 = torch.arange(P, device=device).unsqueeze(-1)
    causal_P_C = slot_C <= query_P_1
    valid_U_C = torch.zeros(U, C, dtype=torch.bool, device=device)
    valid_U_C[:, :P] = True if valid_U_P is None else valid_U_P.bool()
    return (causal_P_C & valid_U_C[:, None, None, :]) | (slot_C == query_P_1)


class FusedStepper:
    """grpo-core's fused decoder over its :class:`KVCache`, written at the decode slot."""

    description = "fused decoder (fp32 Llama/Qwen) over a static KV cache"

    def __init__(self, decoder: Any, capacity: int) -> None:
        self.decoder = decoder
        self.capacity = capacity
        # Fused once per generation: in-process weight sync means the weights may have changed since.
        self.weights = decoder.layer_weights()
        self.cache = decoder.new_cache(capacity=capacity)

    def prefill(self, input_ids_U_P: torch.Tensor, position_ids_U_P: torch.Tensor, valid_U_P: torch.Tensor | None) -> torch.Tensor:
        return self.decoder(
            input_ids=input_ids_U_P, position_ids=position_ids_U_P, attention_mask=valid_U_P, past_key_values=self.cache,
            logits_to_keep=1, weights=self.weights, max_position=self.capacity - 1,
        )[:, -1, :].float()  # fmt: skip

    def expand(self, repeats: int) -> None:
        self.cache.batch_repeat_interleave(repeats)

    def step(self, token_B_1: torch.Tensor, position_B_1: torch.Tensor, valid_B_C: torch.Tensor, slot_1: torch.Tensor) -> torch.Tensor:
        self.cache.slot_1 = slot_1
        return self.decoder(
            input_ids=token_B_1, position_ids=position_B_1, attention_mask=valid_B_C[:, None, None, :], past_key_values=self.cache,
            logits_to_keep=1, weights=self.weights, max_position=self.capacity - 1,
        )[:, -1, :].float()  # fmt: skip


class TransformersStepper:
    """transformers' own forward over its ``StaticCache``, given ready 4-D masks (additive, in the
    model's dtype, which its sdpa and eager attentions both take)."""

    description = "transformers' forward over a StaticCache"

    def __init__(self, forward: Any, capacity: int) -> None:
        from transformers.cache_utils import Cache, StaticLayer

        self.forward = forward
        self.capacity = capacity
        config = forward.model.config.get_text_config()
        self.kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if not self.kinds <= {"full_attention", "sliding_attention"}:
            raise PluginError(f"the local sampler's static cache decodes full and sliding-window attention, not {sorted(self.kinds)}")
        self.window = getattr(config, "sliding_window", None)
        self.dtype = next(forward.model.parameters()).dtype
        # Every layer holds all slots (transformers' own sliding layers would roll theirs): the masks
        # say which each layer sees.
        self.cache = Cache(layers=[StaticLayer(max_cache_len=capacity) for _ in range(config.num_hidden_layers)])

    def _masks(self, allowed_B_1_S_C: torch.Tensor, query_S_1: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """One 4-D mask (every model passes it through as it is), or one per kind of layer where
        some layers slide (the models that have such layers take the dict)."""

        def additive(allowed: torch.Tensor) -> torch.Tensor:
            return torch.zeros((), dtype=self.dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(self.dtype).min)

        if "sliding_attention" not in self.kinds:
            return additive(allowed_B_1_S_C)
        # Slots are contiguous per row, so a window over slots is the window over positions.
        near_S_C = query_S_1 - torch.arange(allowed_B_1_S_C.shape[-1], device=query_S_1.device) < self.window
        return {"full_attention": additive(allowed_B_1_S_C), "sliding_attention": additive(allowed_B_1_S_C & near_S_C)}

    def prefill(self, input_ids_U_P: torch.Tensor, position_ids_U_P: torch.Tensor, valid_U_P: torch.Tensor | None) -> torch.Tensor:
        U, P = input_ids_U_P.shape
        device = input_ids_U_P.device
        allowed = _prompt_mask(valid_U_P, U, P, self.capacity, device)
        masks = self._masks(allowed, torch.arange(P, device=device).unsqueeze(-1))
        return self.forward(
            input_ids=input_ids_U_P, position_ids=position_ids_U_P, attention_mask=masks, past_key_values=self.cache, logits_to_keep=1
        )[:, -1, :].float()

    def expand(self, repeats: int) -> None:
        for layer in self.cache.layers:
            layer.keys = layer.keys.repeat_interleave(repeats, dim=0)
            layer.values = layer.values.repeat_interleave(repeats, dim=0)
            layer.batch_size = layer.keys.shape[0]

    def step(self, token_B_1: torch.Tensor, position_B_1: torch.Tensor, valid_B_C: torch.Tensor, slot_1: torch.Tensor) -> torch.Tensor:
        # The StaticCache writes at its own count of positions, which the loop keeps equal to slot_1.
        masks = self._masks(valid_B_C[:, None, None, :], slot_1.view(1, 1))
        return self.forward(
            input_ids=token_B_1, position_ids=position_B_1, attention_mask=masks, past_key_values=self.cache, logits_to_keep=1
        )[:, -1, :].float()


def stepper_class(forward: Any) -> type[FusedStepper] | type[TransformersStepper]:
    """The static-cache stepper of the sampler's forward (the fused decoder's or transformers')."""
    return FusedStepper if isinstance(forward, FastDecoder) else TransformersStepper


def stepper_for(forward: Any, capacity: int) -> Stepper:
    return stepper_class(forward)(forward, capacity)


class StepGraph(Protocol):
    """A decode step recorded once and replayed (a CUDA graph; tests use a fake)."""

    def capture(self, step: Callable[[], None]) -> None: ...
    def replay(self) -> None: ...


class CudaStepGraph:
    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, step: Callable[[], None]) -> None:
        # Capture records the kernels without running them: the step it stands for runs at the first replay.
        with torch.cuda.graph(self.graph):
            step()

    def replay(self) -> None:
        self.graph.replay()


@attrs.define(eq=False)
class Decoded:
    """A batch's completions on the host, row-major."""

    tokens_B_M: np.ndarray
    logprobs_B_M: np.ndarray
    lengths_B: np.ndarray
    stopped_B: np.ndarray
    routes_B_M_L_K: torch.Tensor | None
    steps: int
    """Decode steps run (each a forward of the whole batch)."""
    seconds: float
    """Wall time of the loop, prefill excluded."""


@attrs.define(eq=False, slots=False)  # the buffers of a run are set in run()
class DecodeLoop:
    """Decode ``B`` rows from their first logits, ``max_tokens`` at most, in fixed-shape steps.

    ``graph`` (None: eager) records the step after :data:`GRAPH_WARMUP_STEPS` eager ones; a capture
    that raises leaves the loop eager, and ``graph_problem`` says why.
    """

    stepper: Stepper
    logits_B_V: torch.Tensor
    position_B_1: torch.Tensor
    valid_B_C: torch.Tensor
    prompt_width: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop_ids: torch.Tensor
    generator: torch.Generator
    stop_text: Callable[[Sequence[int]], bool] | None = None
    """Whether a completion's tokens so far end past a stop string (None: no stop strings)."""
    check_every: int = CHECK_EVERY
    graph: StepGraph | None = None
    routes: Callable[[], torch.Tensor] | None = None
    """The last forward's experts per row, ``[B, layers, top_k]`` on the device (a MoE tap)."""
    graph_problem: str | None = None

    def run(self) -> Decoded:
        B, M, device = self.logits_B_V.shape[0], self.max_tokens, self.logits_B_V.device
        self.tokens_B_M = torch.zeros(B, M, dtype=torch.long, device=device)
        self.logprobs_B_M = torch.zeros(B, M, device=device)
        self.lengths_B = torch.full((B,), M, dtype=torch.long, device=device)
        self.stopped_B = torch.zeros(B, dtype=torch.bool, device=device)
        self.finished_B = torch.zeros(B, dtype=torch.bool, device=device)
        self.step_1 = torch.zeros(1, dtype=torch.long, device=device)
        self.slot_1 = torch.full((1,), self.prompt_width, dtype=torch.long, device=device)
        self.drawn = torch.zeros((), dtype=torch.long, device=device)
        self.routes_B_M_L_K = None
        start_state = self.generator.get_state()
        # Every uniform the loop may need, in the stream's order; the generator is set back after
        # the loop to where drawing only the used ones leaves it.
        self.uniforms_N = None if self.temperature == 0 else torch.rand(B * M, generator=self.generator, device=device)
        began = time.perf_counter()
        step, checked = 0, 0
        stopped_host_B = np.zeros(B, dtype=bool)
        tokens_host_B_M = np.zeros((B, M), dtype=np.int64)
        while step < M:
            for _ in range(min(self.check_every, M - step)):
                self._advance(step, last=step == M - 1)
                step += 1
            # The one copy off the device per check: the new tokens (for stop strings) and the rows' ends.
            ends_B_3 = torch.stack([self.lengths_B, self.stopped_B.long(), self.finished_B.long()], dim=1)
            packed = to_host(torch.cat([self.tokens_B_M[:, checked:step], ends_B_3], dim=1) if self.stop_text else ends_B_3)
            lengths_B, finished_B = packed[:, -3], packed[:, -1].astype(bool)
            if self.stop_text is not None:
                tokens_host_B_M[:, checked:step] = packed[:, : step - checked]
                hits = self._stop_string_hits(tokens_host_B_M, lengths_B, packed[:, -2].astype(bool), stopped_host_B, checked, step)
                for row, length in hits.items():
                    lengths_B[row], finished_B[row] = length, True
                if hits:
                    rows = torch.tensor(list(hits), device=device)
                    self.lengths_B[rows] = torch.tensor(list(hits.values()), device=device)
                    self.stopped_B[rows] = True
                    self.finished_B[rows] = True
                stopped_host_B |= finished_B
            checked = step
            if finished_B.all():
                break
        out = to_host(
            torch.cat(
                [self.tokens_B_M.double(), self.logprobs_B_M.double(), self.lengths_B[:, None].double(), self.stopped_B[:, None].double(),
                 self.drawn.double().expand(B, 1)], dim=1,
            )
        )  # fmt: skip
        seconds = time.perf_counter() - began
        if self.uniforms_N is not None:
            self.generator.set_state(start_state)
            torch.rand(int(out[0, -1]), generator=self.generator, device=device)
        return Decoded(
            tokens_B_M=out[:, :M].astype(np.int64),
            logprobs_B_M=out[:, M : 2 * M].astype(np.float32),
            lengths_B=out[:, 2 * M].astype(np.int64),
            stopped_B=out[:, 2 * M + 1].astype(bool),
            routes_B_M_L_K=None if self.routes_B_M_L_K is None else self.routes_B_M_L_K.cpu(),
            steps=step,
            seconds=seconds,
        )

    def _stop_string_hits(
        self, tokens_B_M: np.ndarray, lengths_B: np.ndarray, stopped_B: np.ndarray, ended_before_B: np.ndarray, start: int, end: int
    ) -> dict[int, int]:
        """Rows whose text passes a stop string at a step in ``[start, end)``: row -> its length.

        Steps are looked at in order, as if checked as each was decoded: from a row's stop token on
        (which ends it first) there is nothing to check."""
        hits = {}
        for row in np.flatnonzero(~ended_before_B):
            last = min(end, int(lengths_B[row]) - 1 if stopped_B[row] else end)
            for t in range(start, last):
                if self.stop_text(tokens_B_M[row, : t + 1]):
                    hits[int(row)] = t + 1
                    break
        return hits

    def _advance(self, step: int, last: bool) -> None:
        """One decode step: eager, captured, or replayed. The last step draws without a forward
        (a graphed one runs its forward anyway, into slots never read)."""
        if self.graph is None or step < GRAPH_WARMUP_STEPS:
            self._step(forward=not last)
            return
        if step == GRAPH_WARMUP_STEPS:
            try:
                self.graph.capture(self._step)
            except Exception as error:  # noqa: BLE001 - any failed capture leaves the loop eager, and says why
                self.graph, self.graph_problem = None, f"the decode step could not be captured ({type(error).__name__}: {error})"
                self._step(forward=not last)
                return
        self.graph.replay()

    def _step(self, forward: bool = True) -> None:
        """Draw for every row, note the ends, forward the drawn tokens: in place, reading nothing
        on the host (the step index and the cache slot are device tensors)."""
        live_B = ~self.finished_B
        u_B_1 = None
        if self.uniforms_N is not None:
            # The live rows' uniforms, in row order, follow those the earlier steps used.
            index_B = (self.drawn + live_B.long().cumsum(0) - 1).clamp_(0, self.uniforms_N.shape[0] - 1)
            u_B_1 = self.uniforms_N[index_B].unsqueeze(-1)
            self.drawn.add_(live_B.sum())
        token_B, logprob_B = draw(self.logits_B_V, self.temperature, self.top_k, self.top_p, u_B_1)
        # A finished row's later draws are written too, and cut at its length.
        self.tokens_B_M.index_copy_(1, self.step_1, token_B.unsqueeze(1))
        self.logprobs_B_M.index_copy_(1, self.step_1, logprob_B.float().unsqueeze(1))
        hit_B = live_B & torch.isin(token_B, self.stop_ids)
        self.lengths_B.copy_(torch.where(hit_B, self.step_1 + 1, self.lengths_B))
        self.stopped_B.logical_or_(hit_B)
        self.finished_B.logical_or_(hit_B)
        if forward:
            self.position_B_1.add_(1)
            self.valid_B_C.index_fill_(1, self.slot_1, True)
            self.logits_B_V.copy_(self.stepper.step(token_B.unsqueeze(-1), self.position_B_1, self.valid_B_C, self.slot_1))
            if self.routes is not None:
                routes_B_L_K = self.routes()
                if self.routes_B_M_L_K is None:
                    self.routes_B_M_L_K = routes_B_L_K.new_zeros(routes_B_L_K.shape[0], self.max_tokens, *routes_B_L_K.shape[1:])
                self.routes_B_M_L_K.index_copy_(1, self.step_1, routes_B_L_K.unsqueeze(1))
        self.step_1.add_(1)
        self.slot_1.add_(1)


ModelForward = FastDecoder | TransformersForward


def model_forward(model: Any, fast: bool) -> ModelForward:
    if fast and unsupported_reason(model) is None:
        return FastDecoder(model)
    return TransformersForward(model)


def forward_path(model: Any, fast: bool) -> str:
    """Which forward :func:`model_forward` gives ``model``, and why (for the run's first lines)."""
    if not fast:
        return "transformers (--backend-opt fast_forward=false)"
    reason = unsupported_reason(model)
    if reason is None:
        return "fused decoder (fp32 Llama/Qwen: faster than transformers', docs/performance.md)"
    return f"transformers (the fused decoder does not run {reason})"
