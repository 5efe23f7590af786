"""The optimizer step: AdamW (torch's fused kernel for float32 weights, the stochastic-rounding
AdamW below for bfloat16 ones), gradient clipping, the finiteness checks around a step, and what a
step and a forward-backward report.

AdamW for bfloat16 parameters: float32 moments, float32 update math, stochastic rounding.

A bfloat16 weight keeps 8 significant bits: an update smaller than half a unit in the last place
(a relative 2^-9, while a typical step at lr 1e-5 is ~1e-5 of the weight) rounds back to the
weight it started from, so plain bf16 AdamW stops learning. The usual cure keeps a float32
master copy (4 more bytes per parameter: 16 B/param with the moments and a bf16 gradient);
stochastic rounding instead rounds up with probability equal to the remainder, so every update
survives in expectation, at 12 B/param (bf16 weight and gradient, float32 moments).

The step is a handful of whole-buffer operations, not a loop of small ones: the parameters'
elements are packed into float32 buffers of at most :data:`SLICE_ELEMENTS`, updated there by
torch's fused AdamW kernel (one call per buffer), rounded with counter-based noise, and written
back: 5 operations per buffer plus one per tensor slice (the noise), against 13 per tensor
slice before. The noise of an element is a pure function of (seed, step, parameter index,
element index): a hash of the element index offset by a key of the rest, its hashes made once
with exact integer tensor operations that give the same bits on every device. A run repeats
exactly and a resumed run continues as an uninterrupted one would, with nothing extra in the
checkpoint (whose layout is unchanged: torch's AdamW state with float32 moments).

Where torch.compile can build kernels (``--backend-opt optimizer_kernel``), bfloat16 weights with
float32 moments take one compiled pass per tensor instead (:func:`_one_pass_update`): the same
update and the same noise, computed in registers with no float32 copy and no table, reading and
writing each element's bytes once. It rounds the float32 update as the eager kernel does up to
the order of its float32 operations: the weights agree but for an element in thousands, one
bfloat16 step apart; a run repeats, and resumes, bitwise on the kernel it ran with.

Where the moments are kept (``--optimizer-state``, :data:`MOMENT_FORMATS`): ``fp32`` (8 B per
parameter, the default), ``bf16`` (4 B: stochastically rounded like the weights, with noise keyed
apart from theirs), ``8bit`` (2 B plus a float32 scale per :data:`QUANT_BLOCK` elements: see
:func:`quantize_blockwise`) or ``offload`` (8 B in pinned host memory, 0 on the GPU: each packed
slice of moments is copied to the device for its update and back). The update itself is always
the float32 one of torch's fused kernel, on moments decoded into float32 buffers slice by slice.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Iterable, Sequence

import tinker
import torch

from grpo_core.backend import routes_data
from grpo_core.engine.compile import compile_problem
from grpo_core.engine.logprobs import DatumRouting
from grpo_core.engine.moe_routing import load_max_over_mean

SLICE_ELEMENTS = 1 << 24
"""Elements updated at once. The peak extra memory at any model size is 12 bytes per element of
this, 192 MiB: the float32 parameter and gradient buffers (8 B, kept by the optimizer from step to
step; 8 B more for the moments where they are not float32) and the int32 noise table (4 B, kept
per process and device). A tensor larger than this is updated slice
by slice; the slices also key the noise (see :func:`add_element_noise`)."""

MOMENT_FORMATS = ("fp32", "bf16", "8bit", "offload")
QUANT_BLOCK = 256
"""Elements per scale of the 8-bit moments (a divisor of :data:`SLICE_ELEMENTS`, so a slice
starts on a block)."""

_MASK32 = (1 << 32) - 1
_TABLE_CHUNK = 1 << 20
_HIGH_HALF = 1 if sys.byteorder == "little" else 0
"""Which bfloat16 of a float32's two (viewed as bfloat16 pairs) holds its top 16 bits."""


def _mix32(x: int) -> int:
    """A 32-bit integer hash (Wellons' lowbias32) in Python integers, for the noise keys."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def noise_key(seed: int, step: int, parameter: int, slice_index: int) -> int:
    """The 32-bit key of the noise of one slice of one parameter at one step."""
    key = 0
    for part in (seed, step, parameter, slice_index):
        key = _mix32(key ^ _mix32(part & _MASK32) ^ (part >> 32))
    return key


@functools.cache
def noise_table(n: int, device: torch.device) -> torch.Tensor:
    """``n`` int32 values uniform in [0, 2^16), the i-th the top 16 bits of a 32-bit hash of i.
    Computed in int64 with every product below 2^63, so exact (and equal) on every device; made
    once per process and device (64 MiB at the default length)."""
    table = torch.empty(n, dtype=torch.int32, device=device)
    # In chunks: the int64 temporaries of the whole table at once would take 8x its 64 MiB.
    for start in range(0, n, _TABLE_CHUNK):
        x = torch.arange(start, min(start + _TABLE_CHUNK, n), dtype=torch.int64, device=device)
        for multiplier in (0x7FEB352D, 0x5BD1E995):  # both below 2^31: x * multiplier < 2^63
            x ^= x >> 16
            x = (x * multiplier) & _MASK32
        table[start : start + x.numel()] = (x ^ (x >> 15)) >> 16
    return table


def add_element_noise(bits: torch.Tensor, key: int) -> None:
    """``bits`` += the noise of its elements: element i gets ``noise_table``'s entry
    (i + key) mod SLICE_ELEMENTS, a hash of a counter offset by a key of (seed, step, parameter,
    slice) (:func:`noise_key`). One addition per slice: the hash is never recomputed. Within a
    slice no entry repeats; an element meets a fresh, unrelated entry at every step (two steps
    share a whole slice's noise only where their keys agree modulo 2^24)."""
    table = noise_table(SLICE_ELEMENTS, bits.device)
    offset, n = key % SLICE_ELEMENTS, bits.numel()
    first = min(n, SLICE_ELEMENTS - offset)
    bits[:first].add_(table[offset : offset + first])
    if first < n:
        bits[first:].add_(table[: n - first])


def hash_noise(counters: torch.Tensor) -> torch.Tensor:
    """``noise_table``'s entries at ``counters`` (int32 in [0, 2^24)), computed in int32 instead of
    looked up: products wrap modulo 2^32 as the table's masked int64 ones do, and the shifts are
    made logical by masks. Elementwise, so a compiled kernel computes it in registers."""
    x = counters ^ (counters >> 16)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x5BD1E995
    return ((x ^ ((x >> 15) & 0x1FFFF)) >> 16) & 0xFFFF


def _one_pass_update(
    weight: torch.Tensor, gradient: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, offset: torch.Tensor, hyper: torch.Tensor
) -> None:
    """AdamW on one slice (1-D) of a bfloat16 ``weight`` with float32 moments, its float32 result
    rounded stochastically with the noise :func:`add_element_noise` adds (the counters offset by
    ``offset``, a 0-d int32 tensor) and written back: compiled, one pass over the slice's memory.
    ``hyper`` holds the step's factors as torch's fused AdamW computes them, in float64, before
    they meet float32 (:meth:`StochasticRoundingAdamW._one_pass_factors`)."""
    decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bias_correction2_sqrt, eps = hyper.unbind()
    gradient_32 = gradient.float()
    # Not lerp_: its two-sided formula costs the compiled loop a mask and a select (12 % of the step).
    exp_avg.mul_(beta1).add_(gradient_32 * one_minus_beta1)
    exp_avg_sq.mul_(beta2).addcmul_(gradient_32, gradient_32 * one_minus_beta2)
    updated = weight.float() * decay
    updated = updated - step_size * exp_avg / (exp_avg_sq.sqrt() / bias_correction2_sqrt + eps)
    counters = (torch.arange(weight.numel(), dtype=torch.int32, device=weight.device) + offset) & (SLICE_ELEMENTS - 1)
    weight.copy_(((updated.view(torch.int32) + hash_noise(counters)) & -(1 << 16)).view(torch.float32))


@functools.cache
def compiled_one_pass_update() -> Callable[..., None]:
    """:func:`_one_pass_update` compiled once per process for every slice length (dynamic shapes)."""
    return torch.compile(_one_pass_update, dynamic=True, fullgraph=True)


AUTO = "auto"
OPTIMIZER_KERNELS = (AUTO, "compiled", "eager")


def resolve_optimizer_kernel(requested: str, weight_dtype: torch.dtype, moments: str, device: torch.device) -> tuple[str, str]:
    """The kernel of the stochastic-rounding step (compiled or eager) and the start line's why;
    raises PluginError where ``requested`` (:data:`OPTIMIZER_KERNELS`) cannot apply."""
    from grpo_core.errors import PluginError

    if requested not in OPTIMIZER_KERNELS:
        raise PluginError(f"--backend-opt optimizer_kernel={requested}: use one of {', '.join(OPTIMIZER_KERNELS)}")
    if weight_dtype != torch.bfloat16:
        if requested == "compiled":
            raise PluginError(
                f"--backend-opt optimizer_kernel=compiled: the compiled step rounds bfloat16 weights, these are "
                f"{str(weight_dtype).removeprefix('torch.')}: use --dtype bfloat16, or optimizer_kernel=auto"
            )
        if moments == "fp32":
            return "eager", "torch's fused AdamW (float32 weights and moments)"
        return "eager", f"eager (float32 weights with {moments} moments)"
    if moments != "fp32":
        if requested == "compiled":
            raise PluginError(
                f"--backend-opt optimizer_kernel=compiled keeps float32 moments; --optimizer-state {moments} takes the "
                "eager step: use optimizer_kernel=auto or eager"
            )
        return "eager", f"eager (the compiled step keeps float32 moments, these are {moments})"
    problem = compile_problem(device)
    if requested == "compiled" and problem:
        raise PluginError(f"--backend-opt optimizer_kernel=compiled: {problem}")
    if requested == "eager":
        return "eager", "eager (optimizer_kernel=eager: float32 buffers, a noise table)"
    if problem:
        return "eager", f"eager ({problem})"
    if requested == AUTO and device.type != "cuda":
        return "eager", (
            f"eager (auto on {device.type}: building the compiled step takes seconds, more than it saves in most runs "
            "there, docs/performance.md; optimizer_kernel=compiled for a long one)"
        )
    return "compiled", "compiled (one torch.compile'd pass over each bfloat16 tensor, built at the first step)"


def truncate_to_bf16(x_fp32: torch.Tensor) -> torch.Tensor:
    """The bfloat16 of a float32's top 16 bits (1-D, contiguous): a strided view, no conversion.

    Stochastic rounding adds uniform noise in [0, 2^16) to a float32's bits and truncates: that
    rounds away from zero with probability = the dropped fraction, so the result is unbiased and
    one of the value's two bfloat16 neighbours. inf and nan stay what they are: their low 16
    bits are zero or a payload, which truncation drops."""
    return x_fp32.view(torch.bfloat16)[_HIGH_HALF::2]


def moment_bytes(moments: str) -> float:
    """Bytes per parameter the two Adam moments take on the training device."""
    return {"fp32": 8.0, "bf16": 4.0, "8bit": 2.0 + 2 * 4 / QUANT_BLOCK, "offload": 0.0}[moments]


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` (1-D) as rows of QUANT_BLOCK, the last one padded with zeros."""
    return torch.nn.functional.pad(x, (0, -x.numel() % QUANT_BLOCK)).view(-1, QUANT_BLOCK)


def quantize_blockwise(x_fp32: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit codes of ``x_fp32`` (1-D) and the absmax of each QUANT_BLOCK of it.

    Linear codes would lose every value below 1/255 of its block's largest; the codes are power
    laws instead, which keep relative precision over a wide range: the first moment (signed)
    stores sqrt(|x| / absmax) in 127 steps (down to 1.5e-5 of the block's largest), the second
    (non-negative) (x / absmax)^(1/4) in 255 steps (down to 2.4e-10; its square root, which
    divides the update, down to 1.5e-5). Rounded to nearest: a step repeats exactly."""
    blocks = _blocks(x_fp32)
    absmax = blocks.abs().amax(dim=1)
    scaled = blocks / torch.where(absmax > 0, absmax, 1.0)[:, None]
    if signed:
        codes = (scaled.abs().sqrt() * 127).round_() * scaled.sign()
        return codes.to(torch.int8).view(-1)[: x_fp32.numel()], absmax
    return (scaled.sqrt().sqrt() * 255).round_().to(torch.uint8).view(-1)[: x_fp32.numel()], absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, out_fp32: torch.Tensor) -> None:
    """``out_fp32`` = the values of ``codes`` (:func:`quantize_blockwise`). A second moment's zero
    code reads as half its first step's value, the most it can have lost: a moment that survived
    its quantization is then never divided by a denominator its own quantization zeroed (the
    first step's update, m / (sqrt(v) + eps), would otherwise reach m / eps)."""
    n = codes.numel()
    if codes.dtype == torch.int8:
        unit = codes.float() / 127
        values = _blocks(unit * unit.abs())
    else:
        values = _blocks((codes.float().clamp_min(0.5) / 255) ** 4)
    out_fp32.copy_((values * absmax[:, None]).view(-1)[:n])


class StochasticRoundingAdamW(torch.optim.Optimizer):
    """torch's AdamW update (decoupled weight decay, bias-corrected moments) for parameters of any
    dtype, with moments kept as ``moments`` says (:data:`MOMENT_FORMATS`); bfloat16 parameters are
    written back by stochastic rounding (:func:`truncate_to_bf16`), float32 ones exactly.

    The state is torch's AdamW layout: per parameter ``step`` (an int), ``exp_avg`` and
    ``exp_avg_sq`` (float32; bfloat16 with ``bf16``; 8-bit codes with ``8bit``, beside their
    blocks' scales ``exp_avg_absmax`` and ``exp_avg_sq_absmax``; float32 in pinned host memory
    with ``offload``)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        seed: int = 0,
        moments: str = "fp32",
        kernel: str = "eager",
    ) -> None:
        if moments not in MOMENT_FORMATS:
            raise ValueError(f"moments {moments!r}: use one of {', '.join(MOMENT_FORMATS)}")
        if kernel not in ("eager", "compiled"):
            raise ValueError(f"kernel {kernel!r}: use eager or compiled")
        if kernel == "compiled" and moments != "fp32":
            raise ValueError(f"the compiled kernel keeps float32 moments; moments {moments!r} take the eager one")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.seed = seed
        self.moments = moments
        self.kernel = kernel
        self._built = False
        self._kept_buffers: dict[torch.device, list[torch.Tensor]] = {}
        if moments == "offload" and any(p.device.type != "cuda" for group in self.param_groups for p in group["params"]):
            raise ValueError("moments 'offload' keep Adam's moments in host memory for CUDA parameters; these are in it already")

    def _state_keys(self) -> dict[str, torch.dtype]:
        if self.moments == "8bit":
            return {"exp_avg": torch.int8, "exp_avg_absmax": torch.float32, "exp_avg_sq": torch.uint8, "exp_avg_sq_absmax": torch.float32}
        dtype = torch.bfloat16 if self.moments == "bf16" else torch.float32
        return {"exp_avg": dtype, "exp_avg_sq": dtype}

    def _new_state(self, p: torch.Tensor) -> dict:
        if self.moments == "8bit":
            blocks = -(-p.numel() // QUANT_BLOCK)
            return {
                "step": 0,
                "exp_avg": torch.zeros(p.numel(), dtype=torch.int8, device=p.device),
                "exp_avg_absmax": torch.zeros(blocks, dtype=torch.float32, device=p.device),
                "exp_avg_sq": torch.zeros(p.numel(), dtype=torch.uint8, device=p.device),
                "exp_avg_sq_absmax": torch.zeros(blocks, dtype=torch.float32, device=p.device),
            }
        if self.moments == "offload":
            host = {key: torch.zeros(p.shape, dtype=torch.float32, pin_memory=True) for key in ("exp_avg", "exp_avg_sq")}
            return {"step": 0, **host}
        dtype = self._state_keys()["exp_avg"]
        return {
            "step": 0,
            **{k: torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format) for k in ("exp_avg", "exp_avg_sq")},
        }

    def load_state_dict(self, state_dict: dict) -> None:
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        keys = self._state_keys()
        for saved_id in saved_ids:
            saved = state_dict["state"].get(saved_id)
            if saved is not None and not (isinstance(saved.get("step"), int) and {"exp_avg", "exp_avg_sq"} <= saved.keys()):
                raise ValueError(
                    f"optimizer state of parameter {saved_id} is not StochasticRoundingAdamW's (an int 'step', "
                    f"'exp_avg' and 'exp_avg_sq'); it has {sorted(saved)}: was it saved by another optimizer?"
                )
            if saved is not None and {k: saved[k].dtype for k in saved if k != "step"} != keys:
                have = ", ".join(f"{k} {saved[k].dtype}" for k in sorted(saved) if k != "step")
                raise ValueError(
                    f"optimizer state of parameter {saved_id} holds {have}: it was saved with other moments than "
                    f"these ({self.moments}); resume with the --optimizer-state it was saved with"
                )
        super().load_state_dict(state_dict)
        # torch casts loaded moments to their parameter's dtype and device; these stay as saved.
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, p in zip(saved_ids, params):
            if saved_id in state_dict["state"]:
                for key in keys:
                    saved = state_dict["state"][saved_id][key]
                    if self.moments == "offload":
                        self.state[p][key] = saved.to("cpu").pin_memory()
                    else:
                        self.state[p][key] = saved.to(device=p.device)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        # Every moment made before any update: the buffers then never sit between them.
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not self.state[p]:
                    self.state[p].update(self._new_state(p))
        index = 0
        for group in self.param_groups:
            exact: dict[torch.device, list[torch.Tensor]] = {}
            packed: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
            one_pass: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                self.state[p]["step"] += 1
                if p.dtype == torch.float32 and self.moments == "fp32":
                    exact.setdefault(p.device, []).append(p)
                elif p.dtype == torch.bfloat16 and self.kernel == "compiled":
                    one_pass.setdefault(p.device, []).append((index, p))
                else:
                    packed.setdefault(p.device, []).append((index, p))
            for device, params in exact.items():
                states = [self.state[p] for p in params]
                exp_avgs, exp_avg_sqs = ([s[key] for s in states] for key in ("exp_avg", "exp_avg_sq"))
                self._fused_adamw(group, states, params, [p.grad for p in params], exp_avgs, exp_avg_sqs, device)
            for device, indexed in packed.items():
                self._step_packed(group, indexed, device)
            for device, indexed in one_pass.items():
                self._step_one_pass(group, indexed, device)

    def _fused_adamw(
        self,
        group: dict,
        states: list[dict],
        weights: list[torch.Tensor],
        gradients: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        device: torch.device,
    ) -> None:
        """torch's fused AdamW (one call) on float32 ``weights``, ``gradients`` and moments, at
        the steps of ``states``."""
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(
            weights,
            gradients,
            exp_avgs,
            exp_avg_sqs,
            [],
            list(torch.tensor([float(s["step"]) for s in states], device=device).unbind()),
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            amsgrad=False,
            maximize=False,
        )

    def _step_one_pass(self, group: dict, indexed: list[tuple[int, torch.Tensor]], device: torch.device) -> None:
        """Update the bfloat16 (parameter index, parameter) of ``indexed`` in place, one compiled
        pass per slice of SLICE_ELEMENTS (:func:`_one_pass_update`): no float32 copies, no noise
        table. Every step's settings and noise offsets reach the device in two copies, not one per
        tensor, and nothing waits for the device."""
        steps = sorted({self.state[p]["step"] for _, p in indexed})
        hyper_S_8 = torch.tensor([self._one_pass_factors(group, s) for s in steps], dtype=torch.float32, device=device)
        slices = [
            (index, p, slice_index, start) for index, p in indexed for slice_index, start in enumerate(range(0, p.numel(), SLICE_ELEMENTS))
        ]
        keys = [noise_key(self.seed, self.state[p]["step"], index, slice_index) % SLICE_ELEMENTS for index, p, slice_index, _ in slices]
        offsets = torch.tensor(keys, dtype=torch.int32, device=device)
        update = compiled_one_pass_update()
        for (_, p, _, start), offset in zip(slices, offsets):
            state = self.state[p]
            pieces = [t.view(-1)[start : start + SLICE_ELEMENTS] for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
            try:
                update(*pieces, offset, hyper_S_8[steps.index(state["step"])])
            except Exception as exc:  # torch.compile's errors differ by version and device
                if self._built:
                    raise
                # The first call builds the kernel before it changes anything.
                raise RuntimeError(
                    f"the compiled optimizer step could not be built on {device} ({type(exc).__name__}: "
                    f"{(str(exc).strip() or '?').splitlines()[0]}); --backend-opt optimizer_kernel=eager runs without it"
                ) from exc
            self._built = True

    @staticmethod
    def _one_pass_factors(group: dict, step: int) -> list[float]:
        """What :func:`_one_pass_update` multiplies by at ``step``, in float64 as torch's fused
        kernel makes them (1 - beta2 rounded to float32 alone would be 5e-5 off)."""
        lr, (beta1, beta2) = group["lr"], group["betas"]
        step_size = lr / (1 - beta1**step)
        return [1 - lr * group["weight_decay"], beta1, 1 - beta1, beta2, 1 - beta2, step_size, math.sqrt(1 - beta2**step), group["eps"]]

    def _step_packed(self, group: dict, indexed: list[tuple[int, torch.Tensor]], device: torch.device) -> None:
        """Update the (parameter index, parameter) of ``indexed`` through float32 buffers, packed
        with whole tensors or SLICE_ELEMENTS-long slices of larger ones, in order."""
        packs: list[list[tuple[int, int, torch.Tensor, int, int]]] = [[]]
        filled = 0
        for index, p in indexed:
            for slice_index, start in enumerate(range(0, p.numel(), SLICE_ELEMENTS)):
                end = min(start + SLICE_ELEMENTS, p.numel())
                if filled + end - start > SLICE_ELEMENTS:
                    packs.append([])
                    filled = 0
                packs[-1].append((index, slice_index, p, start, end))
                filled += end - start
        packs = [pack for pack in packs if pack]  # none when every tensor is empty
        if not packs:
            return
        size = max(sum(end - start for *_, start, end in pack) for pack in packs)
        float32_moments = self.moments == "fp32"
        buffers = self._buffers(device, size, 2 if float32_moments else 4)
        weights, gradients = buffers[:2]
        for pack in packs:
            lengths = [end - start for *_, start, end in pack]
            total = sum(lengths)
            params = [p.view(-1)[start:end] for *_, p, start, end in pack]
            states = [self.state[p] for *_, p, _, _ in pack]
            weights_32, gradients_32 = list(weights[:total].split(lengths)), list(gradients[:total].split(lengths))
            torch._foreach_copy_(weights_32, params)
            torch._foreach_copy_(gradients_32, [p.grad.view(-1)[start:end] for *_, p, start, end in pack])
            if float32_moments:
                moments = [[s[key].view(-1)[start:end] for s, (*_, start, end) in zip(states, pack)] for key in ("exp_avg", "exp_avg_sq")]
            else:
                moments = [list(buffer[:total].split(lengths)) for buffer in buffers[2:]]
                self._read_moments(pack, moments)
            self._fused_adamw(group, states, weights_32, gradients_32, *moments, device)
            if not float32_moments:
                self._write_moments(pack, buffers[2:], total, lengths)
            if all(p.dtype == torch.bfloat16 for *_, p, _, _ in pack):
                for (index, slice_index, p, _, _), bits in zip(pack, weights[:total].view(torch.int32).split(lengths)):
                    add_element_noise(bits, noise_key(self.seed, self.state[p]["step"], index, slice_index))
                torch._foreach_copy_(params, list(truncate_to_bf16(weights[:total]).split(lengths)))
            else:  # float32 exactly; float16 and others rounded to nearest, as copy_ does
                torch._foreach_copy_(params, weights_32)

    def _buffers(self, device: torch.device, size: int, count: int) -> list[torch.Tensor]:
        """``count`` float32 buffers of at least ``size`` elements, kept from step to step: a
        CPU tensor this large is a fresh mapping of the OS each time it is made, and faulting its
        pages in cost more than the update (71 against 11 ms to fill 2^24 elements, 1 thread)."""
        kept = self._kept_buffers.get(device, [])
        if len(kept) < count or kept[0].numel() < size:
            kept = [torch.empty(size, dtype=torch.float32, device=device) for _ in range(count)]
            self._kept_buffers[device] = kept
        return kept[:count]

    def _read_moments(self, pack: list[tuple[int, int, torch.Tensor, int, int]], moments: list[list[torch.Tensor]]) -> None:
        """The float32 moments of ``pack``'s slices into the buffers' pieces ``moments``."""
        for (*_, p, start, end), exp_avg, exp_avg_sq in zip(pack, *moments):
            state = self.state[p]
            for key, out in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                if self.moments == "8bit":
                    blocks = slice(start // QUANT_BLOCK, -(-end // QUANT_BLOCK))
                    dequantize_blockwise(state[key][start:end], state[key + "_absmax"][blocks], out)
                else:  # bf16 (exact in float32), or host memory copied over
                    out.copy_(state[key].view(-1)[start:end], non_blocking=True)

    def _write_moments(
        self, pack: list[tuple[int, int, torch.Tensor, int, int]], buffers: list[torch.Tensor], total: int, lengths: list[int]
    ) -> None:
        """The updated float32 moments of ``pack`` (``buffers``, packed) back in their kept form."""
        for which, (key, buffer) in enumerate(zip(("exp_avg", "exp_avg_sq"), buffers), start=1):
            pieces = buffer[:total].split(lengths)
            if self.moments == "bf16":
                for (index, slice_index, p, _, _), bits in zip(pack, buffer[:total].view(torch.int32).split(lengths)):
                    # Keyed apart from the weight's noise (and the other moment's): the slice's high bits.
                    add_element_noise(bits, noise_key(self.seed, self.state[p]["step"], index, slice_index | which << 32))
                pieces = truncate_to_bf16(buffer[:total]).split(lengths)
            for (*_, p, start, end), piece in zip(pack, pieces):
                state = self.state[p]
                if self.moments == "8bit":
                    codes, absmax = quantize_blockwise(piece, signed=key == "exp_avg")
                    state[key][start:end] = codes
                    state[key + "_absmax"][start // QUANT_BLOCK : -(-end // QUANT_BLOCK)] = absmax
                else:
                    state[key].view(-1)[start:end].copy_(piece)


def make_optimizer(
    params: list[torch.Tensor], seed: int, device: torch.device, moments: str = "fp32", kernel: str = "eager"
) -> torch.optim.Optimizer:
    """AdamW over ``params``: torch's fused kernel for float32 weights and moments; stochastic
    rounding for bf16 weights (by ``kernel``: compiled or eager); moments kept as ``moments`` says
    (:data:`MOMENT_FORMATS`)."""
    if moments != "fp32" or any(p.dtype != torch.float32 for p in params):
        return StochasticRoundingAdamW(params, seed=seed, moments=moments, kernel=kernel)
    # The fused kernel updates every tensor in one pass: 4-5x faster than foreach on CPU.
    return torch.optim.AdamW(params, fused=device.type in ("cpu", "cuda"))


def clip_and_step(optimizer: torch.optim.Optimizer, adam_params: tinker.AdamParams, skip: bool) -> tuple[float, bool]:
    """Set ``adam_params`` on ``optimizer``, clip its parameters' gradient norm (``grad_clip_norm``,
    0 = off) and step, unless ``skip`` or the norm is non-finite; then zero the gradients.
    Returns the norm before clipping and whether the step was skipped."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for group in optimizer.param_groups:
        group.update(
            lr=adam_params.learning_rate,
            betas=(adam_params.beta1, adam_params.beta2),
            eps=adam_params.eps,
            weight_decay=adam_params.weight_decay,
        )
    max_norm = adam_params.grad_clip_norm if adam_params.grad_clip_norm > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    # Sharded (DTensor) parameters give a sharded norm: its full value is the same on every rank.
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    skip = skip or not math.isfinite(grad_norm)
    if not skip:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skip


def forward_backward_output(
    logprobs: Sequence[torch.Tensor],
    loss: torch.Tensor,
    metrics: dict[str, float],
    routed: Sequence[dict[str, torch.Tensor]] | None = None,
) -> tinker.ForwardBackwardOutput:
    """What ``forward_backward_custom`` returns: each datum's logprobs (and ``routed`` tensors,
    a mixture-of-experts model's routing) and the metrics with the loss."""
    return tinker.ForwardBackwardOutput(
        loss_fn_output_type="TorchLossReturn",
        loss_fn_outputs=[
            {"logprobs": tinker.TensorData.from_torch(lp.detach()), **{k: routes_data(v) for k, v in extra.items()}}
            for lp, extra in zip(logprobs, routed or [{} for _ in logprobs])
        ],
        metrics={**metrics, "loss": float(loss.detach())},
    )


def routing_outputs(routing: DatumRouting, datums: Sequence[tinker.Datum]) -> list[dict[str, torch.Tensor]]:
    """Per datum: the experts its forward used (``routed_experts``) and those its routers chose
    themselves (``routed_experts_chosen``: the same unless forced)."""
    lengths = [d.model_input.length for d in datums]
    used = routing.per_datum(routing.tap.take(), lengths)
    chosen = routing.per_datum(routing.tap.take_live(), lengths)
    return [{"routed_experts": u, "routed_experts_chosen": c} for u, c in zip(used, chosen)]


def load_metrics(routes_N_L_K: torch.Tensor, num_experts: int) -> dict[str, float]:
    """How evenly a forward's tokens spread over the experts: per MoE layer the busiest expert's
    share over the mean share (``moe/load_max_over_mean/layer_<i>``; 1 = even), and the worst layer's."""
    per_layer_L = load_max_over_mean(routes_N_L_K, num_experts)
    metrics = {f"moe/load_max_over_mean/layer_{i}": float(v) for i, v in enumerate(per_layer_L)}
    metrics["moe/load_max_over_mean"] = float(per_layer_L.max())
    return metrics


def nonfinite_step_message(grad_norm: float, adam_params: tinker.AdamParams) -> str:
    return (
        f"the optimizer step made weights non-finite (grad norm {grad_norm:.3g}, lr {adam_params.learning_rate:g}); "
        "nothing is saved from them"
    )


def step_metrics(grad_norm: float, adam_params: tinker.AdamParams, skipped: bool) -> dict[str, float]:
    return {"optim/grad_norm": grad_norm, "optim/lr": adam_params.learning_rate, "optim/skipped_nonfinite": float(skipped)}


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether no element of ``tensors`` is NaN or inf, in one check (one device sync): the largest
    magnitude is NaN or inf exactly when some element is. Empty tensors (a rank's empty shard) hold none."""
    tensors = [t for t in tensors if t.numel()]
    return not tensors or bool(torch.stack([n.float() for n in torch._foreach_norm(tensors, math.inf)]).isfinite().all())
