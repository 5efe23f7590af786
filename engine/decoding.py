"""The local sampler's decode loop, shaped for a GPU: everything a decoded token needs stays on the
device, in buffers of fixed shape written in place, so the step can be captured in a CUDA graph.

- The KV cache is preallocated for prompt + completion and written in place at one slot per step
  (transformers' ``StaticCache``, or the fused decoder's :class:`KVCache` with its ``slot_1``).
- The batch is fixed: a finished row stays in it, masked, and its tokens past the end are cut;
  the compiled step (``decode=compiled``: :class:`DecodeSession`) instead moves the live rows to the
  front once half have finished and steps on with a smaller batch bucket, and keeps its cache,
  buffers, compiled step and graphs from one generation to the next.
- Attention reads only the cache's live prefix: each step of the fused decoder attends to the
  first slots up to its own, rounded up to :data:`ATTEND_BLOCK` (the host knows the step, so
  choosing the width reads nothing off the device); a captured step has one graph per (batch
  bucket, width) reached, all from one compiled step per bucket (the width is a dynamic dimension).
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
import types
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import torch

from grpo_core.engine.fast_decoder import FastDecoder, KVCache, LayerWeights, unsupported_reason
from grpo_core.engine.forward import TransformersForward
from grpo_core.errors import PluginError

DECODE_MODES = ("auto", "eager", "graphs", "compiled")
CHECK_EVERY = 16
"""Steps between the host's looks at the batch (stop strings, whether all rows finished)."""
GRAPH_WARMUP_STEPS = 2
"""Eager steps before the capture: the first calls pick kernels and allocate workspaces a graph
must not record (and, compiled, compile the step)."""
CAPACITY_MULTIPLE = 128
"""A compiled step's cache capacity is prompt + completion rounded up to this, so the next steps'
prompts of other lengths reuse its compiled code, graph and cache."""
ATTEND_BLOCK = 256
"""The fused decoder's attention at a step reads the cache's first slots up to the step's own,
rounded up to this (at most the capacity): early steps of a long generation read about their
length, and a captured step needs one graph per block reached, not one per step."""
MIN_BUCKET = 8
"""The smallest batch a compiled step compacts its live rows into: below it a step reads the
weights whatever the rows, and each bucket is one more compile."""
KEPT_SESSIONS = 2
"""Compiled decode sessions (cache, buffers, graphs) a sampler keeps, the most recently used."""
COMPILE_BACKEND = "inductor"
"""torch.compile's backend for the compiled step; the CPU tests swap in ``eager``, which traces
the same graph (fullgraph: no break allowed) without generating code."""


def decode_mode(mode: str, device: torch.device, fused: str | None = None) -> str:
    """``eager``, ``graphs`` or ``compiled``: what the sampler option ``decode=mode`` runs on
    ``device``. ``fused``: why the fused decoder cannot run the model (None: it can, or not known
    yet: the config alone is being checked)."""
    if mode not in DECODE_MODES:
        raise PluginError(f"decode={mode!r} is not a decode path: choose one of {', '.join(DECODE_MODES)}")
    if mode == "graphs" and device.type != "cuda":
        raise PluginError(
            f"decode=graphs captures the decode step in a CUDA graph, and the model is on {device.type}: "
            "use decode=eager (or auto, which picks graphs on CUDA)"
        )
    if mode == "compiled":
        from grpo_core.engine.compile import compile_problem

        problem = compile_problem(device)
        if problem is not None:
            raise PluginError(f"decode=compiled: {problem}; or decode=eager")
        if fused is not None:
            raise PluginError(f"decode=compiled compiles the fused decoder's step, which does not run {fused}: use decode=auto")
        return "compiled"
    if device.type != "cuda" or mode == "eager":
        return "eager"
    if mode == "auto" and fused is None:
        from grpo_core.engine.compile import compile_problem

        return "compiled" if compile_problem(device) is None else "graphs"
    return "graphs"


def compile_cache_dir() -> str:
    """Where inductor keeps compiled code between processes (its FX graph cache, on by default:
    a later run's compile of the same step is a cache hit)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def batch_buckets(rows: int) -> tuple[int, ...]:
    """The batch sizes a compiled step of ``rows`` rows compacts its live rows into, largest first."""
    sizes = {rows}
    size = MIN_BUCKET
    while size < rows:
        sizes.add(size)
        size *= 2
    return tuple(sorted(sizes, reverse=True))


def round_capacity(slots: int) -> int:
    return -(-slots // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE


def attended_width(slot: int, capacity: int) -> int:
    """The cache slots a step writing at ``slot`` attends to: its own and all before it, rounded
    up to :data:`ATTEND_BLOCK`, at most ``capacity``."""
    return min(capacity, -(-(slot + 1) // ATTEND_BLOCK) * ATTEND_BLOCK)


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
    attends_prefix: bool
    """Whether a step's attention reads only as many cache slots as its mask is wide (else the
    mask is the whole capacity)."""

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
    """grpo-core's fused decoder over its :class:`KVCache`, written at the decode slot.

    ``keep_dtype``: logits in the model's dtype (the compiled step's sampler reads them as fp32
    itself), else fp32 copies."""

    description = "fused decoder (Llama/Qwen) over a static KV cache"
    attends_prefix = True

    def __init__(self, decoder: Any, capacity: int, keep_dtype: bool = False) -> None:
        self.decoder = decoder
        self.capacity = capacity
        self.keep_dtype = keep_dtype
        # Fused once per generation: in-process weight sync means the weights may have changed since.
        self.weights = decoder.layer_weights()
        self.cache = decoder.new_cache(capacity=capacity)

    def _logits(self, logits_B_S_V: torch.Tensor) -> torch.Tensor:
        return logits_B_S_V[:, -1, :] if self.keep_dtype else logits_B_S_V[:, -1, :].float()

    def prefill(self, input_ids_U_P: torch.Tensor, position_ids_U_P: torch.Tensor, valid_U_P: torch.Tensor | None) -> torch.Tensor:
        return self._prefill_into(self.cache, input_ids_U_P, position_ids_U_P, valid_U_P)

    def _prefill_into(
        self, cache: KVCache, input_ids_U_P: torch.Tensor, position_ids_U_P: torch.Tensor, valid_U_P: torch.Tensor | None
    ) -> torch.Tensor:
        return self._logits(self.decoder(
            input_ids=input_ids_U_P, position_ids=position_ids_U_P, attention_mask=valid_U_P, past_key_values=cache,
            logits_to_keep=1, weights=self.weights, max_position=self.capacity - 1,
        ))  # fmt: skip

    def refill(
        self, input_ids_U_P: torch.Tensor, position_ids_U_P: torch.Tensor, valid_U_P: torch.Tensor | None, repeats: int
    ) -> torch.Tensor:
        """A new generation over the kept cache and weights (their addresses are a captured
        graph's): the weights brought up to date in place, the prompts prefilled and written into
        the cache's first slots, each ``repeats`` times; the prompts' last logits."""
        for kept, current in zip(self.weights, self.decoder.layer_weights()):
            for field in attrs.fields(LayerWeights):
                mine, theirs = getattr(kept, field.name), getattr(current, field.name)
                if mine is not None and mine is not theirs:
                    mine.copy_(theirs)
        prompts = self.decoder.new_cache(capacity=input_ids_U_P.shape[1])
        logits_U_V = self._prefill_into(prompts, input_ids_U_P, position_ids_U_P, valid_U_P)
        self.cache.fill_from(prompts, repeats)
        # A captured step reads the rotary tables it was captured with: held here, they outlive
        # the decoder's growing them for a larger capacity.
        self.rope_tables = self.decoder.rope_tables
        return logits_U_V

    def expand(self, repeats: int) -> None:
        self.cache.batch_repeat_interleave(repeats)

    def take_rows(self, order: torch.Tensor) -> None:
        self.cache.take_rows(order)

    def step(self, token_B_1: torch.Tensor, position_B_1: torch.Tensor, valid_B_C: torch.Tensor, slot_1: torch.Tensor) -> torch.Tensor:
        self.cache.slot_1 = slot_1
        return self._logits(self.decoder(
            input_ids=token_B_1, position_ids=position_B_1, attention_mask=valid_B_C[:, None, None, :], past_key_values=self.cache,
            logits_to_keep=1, weights=self.weights, max_position=self.capacity - 1,
        ))  # fmt: skip


class TransformersStepper:
    """transformers' own forward over its ``StaticCache``, given ready 4-D masks (additive, in the
    model's dtype, which its sdpa and eager attentions both take)."""

    description = "transformers' forward over a StaticCache"
    # Its StaticCache hands attention the whole capacity.
    attends_prefix = False

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
    pool: Any = None
    """One memory pool for every decode graph (as vLLM's captures share theirs): a step leaves
    nothing in it (its results are written into the state's buffers) and steps never run at
    once, so each graph's temporaries may reuse another's, and a graph per (batch bucket, attended
    width) costs one step's temporaries, not one each."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        if CudaStepGraph.pool is None:
            CudaStepGraph.pool = torch.cuda.graph_pool_handle()

    def capture(self, step: Callable[[], None]) -> None:
        # Capture records the kernels without running them: the step it stands for runs at the first replay.
        with torch.cuda.graph(self.graph, pool=CudaStepGraph.pool):
            step()

    def replay(self) -> None:
        self.graph.replay()


STEP_INPUTS = ("logits_B_V", "position_B_1", "valid_B_C")
"""A row's state that only its next forward reads."""
PER_ROW = (*STEP_INPUTS, "tokens_B_M", "logprobs_B_M", "lengths_B", "stopped_B", "finished_B", "routes_B_M_L_K")


@attrs.define(eq=False)
class DecodeState:
    """What a decode step reads and writes, in buffers of fixed shape and address (a captured
    graph's), row-major over the batch's positions."""

    logits_B_V: torch.Tensor
    position_B_1: torch.Tensor
    valid_B_C: torch.Tensor
    tokens_B_M: torch.Tensor
    logprobs_B_M: torch.Tensor
    lengths_B: torch.Tensor
    stopped_B: torch.Tensor
    finished_B: torch.Tensor
    step_1: torch.Tensor
    slot_1: torch.Tensor
    drawn: torch.Tensor
    """Uniforms drawn so far (the live rows' draws, all steps)."""
    uniforms_N: torch.Tensor | None
    """Every uniform the loop may use, in the generator's order (None: greedy)."""
    routes_B_M_L_K: torch.Tensor | None = None

    @classmethod
    def around(
        cls, logits_B_V: torch.Tensor, position_B_1: torch.Tensor, valid_B_C: torch.Tensor, max_tokens: int, sampled: bool
    ) -> DecodeState:
        """The buffers of a batch whose first logits, positions and mask are these tensors."""
        B, device = logits_B_V.shape[0], logits_B_V.device
        return cls(
            logits_B_V=logits_B_V, position_B_1=position_B_1, valid_B_C=valid_B_C,
            tokens_B_M=torch.zeros(B, max_tokens, dtype=torch.long, device=device),
            logprobs_B_M=torch.zeros(B, max_tokens, device=device),
            lengths_B=torch.zeros(B, dtype=torch.long, device=device),
            stopped_B=torch.zeros(B, dtype=torch.bool, device=device),
            finished_B=torch.zeros(B, dtype=torch.bool, device=device),
            step_1=torch.zeros(1, dtype=torch.long, device=device),
            slot_1=torch.zeros(1, dtype=torch.long, device=device),
            drawn=torch.zeros((), dtype=torch.long, device=device),
            uniforms_N=torch.empty(B * max_tokens, device=device) if sampled else None,
        )  # fmt: skip

    def start(
        self, logits_B_V: torch.Tensor, position_B_1: torch.Tensor, valid_B_C: torch.Tensor, prompt_width: int, generator: torch.Generator
    ) -> None:
        """A new generation, in place: these first logits, positions and mask, no token yet, and
        the uniforms drawn from ``generator``."""
        for mine, given in ((self.logits_B_V, logits_B_V), (self.position_B_1, position_B_1), (self.valid_B_C, valid_B_C)):
            if mine is not given:
                mine.copy_(given)
        self.tokens_B_M.zero_()
        self.logprobs_B_M.zero_()
        self.lengths_B.fill_(self.tokens_B_M.shape[1])
        self.stopped_B.zero_()
        self.finished_B.zero_()
        self.step_1.zero_()
        self.slot_1.fill_(prompt_width)
        self.drawn.zero_()
        self.routes_B_M_L_K = None
        if self.uniforms_N is not None:
            torch.rand(self.uniforms_N.shape[0], generator=generator, device=self.uniforms_N.device, out=self.uniforms_N)

    def head(self, rows: int, width: int) -> DecodeState:
        """The first ``rows`` rows, and the first ``width`` slots of their mask: views at the same
        addresses (a smaller batch's step, attending to fewer slots)."""
        per_row = {name: getattr(self, name)[:rows] for name in PER_ROW if getattr(self, name) is not None}
        per_row["valid_B_C"] = per_row["valid_B_C"][:, :width]
        return attrs.evolve(self, **per_row)

    def take_rows(self, order: torch.Tensor, rows: int) -> None:
        """Positions ``order`` (a permutation of the first ``len(order)``) moved to the front, in
        place; only the first ``rows`` of them step on, so only they carry their logits, positions
        and mask."""
        for name in PER_ROW:
            tensor = getattr(self, name)
            if tensor is not None:
                moving = order[:rows] if name in STEP_INPUTS else order
                tensor[: moving.shape[0]] = tensor[moving]


@attrs.define(eq=False, frozen=True)
class DrawRule:
    """How a step turns logits into a token: the sampler function and the run's settings."""

    sample: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    temperature: float
    top_k: int
    top_p: float
    stop_ids: torch.Tensor


def decode_step(
    state: DecodeState, rule: DrawRule, stepper: Stepper, forward: bool, routes: Callable[[], torch.Tensor] | None = None
) -> None:
    """Draw for every row, note the ends, forward the drawn tokens: in place, reading nothing on
    the host (the step index and the cache slot are device tensors)."""
    live_B = ~state.finished_B
    u_B_1 = None
    if state.uniforms_N is not None:
        # The live rows' uniforms, in row order, follow those the earlier steps used.
        index_B = (state.drawn + live_B.long().cumsum(0) - 1).clamp_(0, state.uniforms_N.shape[0] - 1)
        u_B_1 = state.uniforms_N[index_B].unsqueeze(-1)
        state.drawn.add_(live_B.sum())
    token_B, logprob_B = rule.sample(state.logits_B_V, rule.temperature, rule.top_k, rule.top_p, u_B_1)
    # A finished row's later draws are written too, and cut at its length.
    state.tokens_B_M.index_copy_(1, state.step_1, token_B.unsqueeze(1))
    state.logprobs_B_M.index_copy_(1, state.step_1, logprob_B.float().unsqueeze(1))
    hit_B = live_B & torch.isin(token_B, rule.stop_ids)
    state.lengths_B.copy_(torch.where(hit_B, state.step_1 + 1, state.lengths_B))
    state.stopped_B.logical_or_(hit_B)
    state.finished_B.logical_or_(hit_B)
    if forward:
        state.position_B_1.add_(1)
        state.valid_B_C.index_fill_(1, state.slot_1, True)
        state.logits_B_V.copy_(stepper.step(token_B.unsqueeze(-1), state.position_B_1, state.valid_B_C, state.slot_1))
        if routes is not None:
            routes_B_L_K = routes()
            if state.routes_B_M_L_K is None:
                state.routes_B_M_L_K = routes_B_L_K.new_zeros(routes_B_L_K.shape[0], state.tokens_B_M.shape[1], *routes_B_L_K.shape[1:])
            state.routes_B_M_L_K.index_copy_(1, state.step_1, routes_B_L_K.unsqueeze(1))
    state.step_1.add_(1)
    state.slot_1.add_(1)


def _cause(error: BaseException) -> str:
    """An error in one line, with its root cause (dynamo wraps a backend's error in its own, as
    ``inner_exception``)."""
    root = error
    while (inner := root.__cause__ or getattr(root, "inner_exception", None)) is not None:
        root = inner
    text = str(root).strip().splitlines()[0][:300] if str(root).strip() else ""
    inner = f"{type(root).__name__}: {text}" if root is not error or text else type(error).__name__
    return f"{type(error).__name__}: {inner}" if root is not error else inner


@attrs.define(eq=False)
class DecodeSession:
    """A compiled decode step's kept parts for one (batch, capacity, settings): the fused stepper
    with its cache and weights, the buffers, the compiled step (one per batch bucket) and one
    captured graph per (batch bucket, attended width), reused generation after generation
    (prefill writes into the kept cache)."""

    stepper: FusedStepper
    state: DecodeState
    rule: DrawRule
    buckets: tuple[int, ...]
    graphs: dict[tuple[int, int], StepGraph] = attrs.field(factory=dict)
    """Per (rows, attended width), the captured step."""
    warm: dict[tuple[int, int], int] = attrs.field(factory=dict)
    """Eager (compiling) steps run per (rows, attended width) before its capture."""
    compile_seconds: dict[int, float] = attrs.field(factory=dict)
    """Per bucket, the first compiled call's wall time (the compile)."""
    compile_problem: str | None = None
    """Why the step runs uncompiled (a compile failed), or None."""
    step: Callable[..., None] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        # dynamo keeps its compiled variants on the code object, under one recompile limit (8): a
        # copy of the code per session gives each its own (one variant per batch bucket).
        own = types.FunctionType(decode_step.__code__.replace(), decode_step.__globals__, decode_step.__name__, decode_step.__defaults__)
        self.step = torch.compile(own, fullgraph=True, dynamic=False, backend=COMPILE_BACKEND)

    @classmethod
    def open(
        cls, forward: FastDecoder, rows: int, capacity: int, max_tokens: int, vocab: int, dtype: torch.dtype, rule: DrawRule
    ) -> DecodeSession:
        device = rule.stop_ids.device
        state = DecodeState.around(
            torch.zeros(rows, vocab, dtype=dtype, device=device),
            torch.zeros(rows, 1, dtype=torch.long, device=device),
            torch.zeros(rows, capacity, dtype=torch.bool, device=device),
            max_tokens,
            sampled=rule.temperature != 0,
        )
        return cls(FusedStepper(forward, capacity, keep_dtype=True), state, rule, batch_buckets(rows))


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
    rows_per_step: float = 0.0
    """Rows forwarded per step on average (fewer than the batch where live rows were compacted)."""
    width_per_step: float = 0.0
    """Cache slots a step's attention read per row, on average (the capacity where it reads all)."""


@attrs.define(eq=False, slots=False)  # the buffers of a run are set in run()
class DecodeLoop:
    """Decode ``B`` rows from their first logits, ``max_tokens`` at most, in fixed-shape steps.

    ``graph_factory`` (None: eager) makes the graph that records the step after
    :data:`GRAPH_WARMUP_STEPS` eager ones; a capture that raises leaves the loop eager, and
    ``graph_problem`` says why. With a ``session`` (the compiled step) the buffers, cache,
    compiled step and graphs are the session's, kept from one generation to the next, and once at
    least half the rows have finished the live ones are compacted into the next smaller bucket.
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
    graph_factory: Callable[[], StepGraph] | None = None
    routes: Callable[[], torch.Tensor] | None = None
    """The last forward's experts per row, ``[B, layers, top_k]`` on the device (a MoE tap)."""
    graph_problem: str | None = None
    session: DecodeSession | None = None

    def run(self) -> Decoded:
        B, M, device = self.logits_B_V.shape[0], self.max_tokens, self.logits_B_V.device
        if self.session is None:
            self.state = DecodeState.around(self.logits_B_V, self.position_B_1, self.valid_B_C, M, sampled=self.temperature != 0)
            self.rule = DrawRule(draw, self.temperature, self.top_k, self.top_p, self.stop_ids)
            self.graphs, self.warm, self.buckets = {}, {}, (B,)
        else:
            self.state, self.rule, self.buckets = self.session.state, self.session.rule, self.session.buckets
            self.graphs, self.warm = self.session.graphs, self.session.warm
        start_state = self.generator.get_state()
        # Every uniform the loop may need, in the stream's order; the generator is set back after
        # the loop to where drawing only the used ones leaves it.
        self.state.start(self.logits_B_V, self.position_B_1, self.valid_B_C, self.prompt_width, self.generator)
        self.rows, self.order_B = B, np.arange(B)
        began = time.perf_counter()
        step, checked, rows_stepped, widths = 0, 0, 0, 0
        stopped_host_B = np.zeros(B, dtype=bool)
        tokens_host_B_M = np.zeros((B, M), dtype=np.int64)
        while step < M:
            for _ in range(min(self.check_every, M - step)):
                width = self._width(step)
                self._advance(last=step == M - 1, width=width)
                rows_stepped += self.rows
                widths += width
                step += 1
            state = self.state
            # The one copy off the device per check: the new tokens (for stop strings) and the rows' ends.
            ends_B_3 = torch.stack([state.lengths_B, state.stopped_B.long(), state.finished_B.long()], dim=1)
            packed = to_host(torch.cat([state.tokens_B_M[:, checked:step], ends_B_3], dim=1) if self.stop_text else ends_B_3)
            lengths_B, finished_B = packed[:, -3], packed[:, -1].astype(bool)
            if self.stop_text is not None:
                tokens_host_B_M[:, checked:step] = packed[:, : step - checked]
                hits = self._stop_string_hits(tokens_host_B_M, lengths_B, packed[:, -2].astype(bool), stopped_host_B, checked, step)
                for row, length in hits.items():
                    lengths_B[row], finished_B[row] = length, True
                if hits:
                    rows = torch.tensor(list(hits), device=device)
                    state.lengths_B[rows] = torch.tensor(list(hits.values()), device=device)
                    state.stopped_B[rows] = True
                    state.finished_B[rows] = True
                stopped_host_B |= finished_B
            checked = step
            if finished_B.all():
                break
            if step < M:
                self._compact(finished_B, (tokens_host_B_M, stopped_host_B))
        state = self.state
        out = to_host(
            torch.cat(
                [state.tokens_B_M.double(), state.logprobs_B_M.double(), state.lengths_B[:, None].double(),
                 state.stopped_B[:, None].double(), state.drawn.double().expand(B, 1)], dim=1,
            )
        )  # fmt: skip
        # Back in the batch's own row order (positions move when live rows are compacted).
        out[self.order_B] = out.copy()
        seconds = time.perf_counter() - began
        if state.uniforms_N is not None:
            self.generator.set_state(start_state)
            torch.rand(int(out[0, -1]), generator=self.generator, device=device)
        routes = None
        if state.routes_B_M_L_K is not None:
            routes = state.routes_B_M_L_K.cpu()
            routes[torch.from_numpy(self.order_B)] = routes.clone()
        return Decoded(
            tokens_B_M=out[:, :M].astype(np.int64),
            logprobs_B_M=out[:, M : 2 * M].astype(np.float32),
            lengths_B=out[:, 2 * M].astype(np.int64),
            stopped_B=out[:, 2 * M + 1].astype(bool),
            routes_B_M_L_K=routes,
            steps=step,
            seconds=seconds,
            rows_per_step=rows_stepped / max(step, 1),
            width_per_step=widths / max(step, 1),
        )

    def _width(self, step: int) -> int:
        """The cache slots step ``step`` attends to (it writes at slot prompt_width + step)."""
        capacity = self.state.valid_B_C.shape[1]
        return attended_width(self.prompt_width + step, capacity) if self.stepper.attends_prefix else capacity

    def _compact(self, finished_B: np.ndarray, host_B: tuple[np.ndarray, ...]) -> None:
        """Once at least half the stepping rows have finished, move the live ones (in their
        order: the uniforms follow it) to the front and step on with the smallest bucket that
        holds them. ``finished_B`` and the host's arrays are by position, and move with them."""
        live = np.flatnonzero(~finished_B[: self.rows])
        rows = min(b for b in self.buckets if b >= len(live))
        if rows > self.rows // 2:
            return
        order = np.concatenate([live, np.flatnonzero(finished_B[: self.rows])])
        order_t = torch.from_numpy(order).to(self.state.tokens_B_M.device)
        self.state.take_rows(order_t, rows)
        self.stepper.take_rows(order_t[:rows])
        for array in (*host_B, finished_B, self.order_B):
            array[: self.rows] = array[order]
        self.rows = rows

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

    def _run_step(self, forward: bool, rows: int, width: int) -> None:
        # The whole state itself where it can be: the eager step allocates the routes buffer on it.
        state = self.state if (rows, width) == tuple(self.state.valid_B_C.shape) else self.state.head(rows, width)
        if self.session is None:
            decode_step(state, self.rule, self.stepper, forward, self.routes)
            return
        # Compiled, the step always forwards (the last one into slots never read): one compile.
        if self.session.compile_problem is not None:
            decode_step(state, self.rule, self.stepper, True)
            return
        # One compile per bucket serves every width (a dynamic dimension), not one per width.
        torch._dynamo.maybe_mark_dynamic(state.valid_B_C, 1)
        began = time.perf_counter()
        try:
            self.session.step(state, self.rule, self.stepper, True)
        except Exception as error:  # noqa: BLE001 - a failed compile (it runs nothing) leaves the step uncompiled, and says why
            if rows in self.session.compile_seconds:
                raise  # it compiled and ran before: not a compile's failure
            self.session.compile_problem = f"the decode step could not be compiled ({_cause(error)})"
            decode_step(state, self.rule, self.stepper, True)
            return
        self.session.compile_seconds.setdefault(rows, time.perf_counter() - began)

    def _advance(self, last: bool, width: int) -> None:
        """One decode step attending to ``width`` slots: eager, captured, or replayed (one graph
        per rows and width). An eager last step draws without a forward (a graphed or compiled one
        runs its forward anyway, into slots never read)."""
        rows = self.rows
        key = (rows, width)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        warm = self.warm.get(key, 0)
        if self.graph_factory is None or warm < GRAPH_WARMUP_STEPS:
            self.warm[key] = warm + 1
            self._run_step(forward=not last, rows=rows, width=width)
            return
        graph = self.graph_factory()
        try:
            # The step of these rows and width, whichever loop replays it later (a kept session's graph).
            graph.capture(lambda: self._run_step(forward=True, rows=rows, width=width))
        except Exception as error:  # noqa: BLE001 - any failed capture leaves the loop eager, and says why
            self.graph_factory, self.graph_problem = None, f"the decode step could not be captured ({type(error).__name__}: {error})"
            self._run_step(forward=not last, rows=rows, width=width)
            return
        self.graphs[key] = graph
        graph.replay()


ModelForward = FastDecoder | TransformersForward


def fused_problem(model: Any, fast: bool) -> str | None:
    """Why the sampler's forward is not the fused decoder (None: it is)."""
    return "the model with --backend-opt fast_forward=false" if not fast else unsupported_reason(model)


def model_forward(model: Any, fast: bool) -> ModelForward:
    return FastDecoder(model) if fused_problem(model, fast) is None else TransformersForward(model)


def forward_path(model: Any, fast: bool) -> str:
    """Which forward :func:`model_forward` gives ``model``, and why (for the run's first lines)."""
    if not fast:
        return "transformers (--backend-opt fast_forward=false)"
    reason = unsupported_reason(model)
    if reason is None:
        return "fused decoder (Llama/Qwen, fp32 or on CUDA bf16/fp16: faster than transformers', docs/performance.md)"
    return f"transformers (the fused decoder does not run {reason})"
