from __future__ import annotations

import io

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_core.engine import optim
from grpo_core.engine.optim import (
    StochasticRoundingAdamW,
    add_element_noise,
    noise_key,
    noise_table,
    truncate_to_bf16,
)
from grpo_core.errors import PluginError

MASK32 = (1 << 32) - 1


def stochastic_round_to_bf16(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    x.view(torch.int32).add_(noise)
    return truncate_to_bf16(x)


def uniform_noise(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1 << 16, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    x = torch.tensor([1.0 + 2**-10, -3.0 - 3 * 2**-9, 1e-30, 0.0]).repeat(20000, 1)
    rounded = stochastic_round_to_bf16(x.clone().view(-1), uniform_noise(x.numel())).float().view(x.shape)
    for column in range(x.shape[1]):
        # Only the two bf16 values around x: x truncated to bf16 and the next one away from zero.
        truncated = (x[0, column].view(torch.int32) & -(1 << 16)).view(torch.float32)
        away = (truncated.view(torch.int32) + (1 << 16)).view(torch.float32)
        assert set(rounded[:, column].unique().tolist()) <= {truncated.item(), away.item()}
    # 1 + 2^-10 lies an eighth of the way from 1 to the next bf16 (1 + 2^-7): unbiased on average.
    assert rounded[:, 0].mean().item() == pytest.approx(1.0 + 2**-10, rel=2e-4)
    assert rounded[:, 1].mean().item() == pytest.approx(-3.0 - 3 * 2**-9, rel=2e-4)
    assert torch.equal(rounded[:, 3], torch.zeros(20000))


def test_stochastic_rounding_keeps_inf_and_nan():
    x = torch.tensor([float("inf"), float("-inf"), float("nan")])
    rounded = stochastic_round_to_bf16(x, torch.full((3,), 0xFFFF, dtype=torch.int32)).float()
    assert rounded[0] == float("inf") and rounded[1] == float("-inf") and rounded[2].isnan()


def python_mix(x: int, multipliers: tuple[int, ...]) -> int:
    for multiplier in multipliers:
        x ^= x >> 16
        x = (x * multiplier) & MASK32
    return x ^ (x >> 15)


def test_noise_is_the_documented_integer_hash_exactly(monkeypatch):
    # Python integers never overflow: a device whose integer products wrapped would differ.
    positions = [0, 1, 2, 12345, (1 << 20) - 1]
    table = noise_table(1 << 20, torch.device("cpu"))
    expected = [python_mix(i, (0x7FEB352D, 0x5BD1E995)) >> 16 for i in positions]
    assert table[positions].tolist() == expected
    # Uniform on [0, 2^16): each of 16 bins holds 1/16 of a million values within 5 sigma.
    counts = torch.bincount(table >> 12, minlength=16).float()
    assert (counts - (1 << 16)).abs().max().item() < 5 * (1 << 16) ** 0.5
    assert abs(torch.corrcoef(torch.stack([table[:-1].float(), table[1:].float()]))[0, 1].item()) < 0.01
    keys = {noise_key(7, 3, 2, 0), noise_key(7, 4, 2, 0), noise_key(7, 3, 3, 0), noise_key(7, 3, 2, 1), noise_key(8, 3, 2, 0)}
    assert len(keys) == 5 and all(0 <= k < 1 << 32 for k in keys)
    # Element i gets entry (i + key) mod the table's length, wrapping around its end.
    monkeypatch.setattr(optim, "SLICE_ELEMENTS", 1 << 20)
    key = (1 << 20) - 3 + (5 << 20)
    bits = torch.zeros(10, dtype=torch.int32)
    add_element_noise(bits, key)
    assert bits.tolist() == table[[(i + key) % (1 << 20) for i in range(10)]].tolist()


def adamw_in_float32(start_bf16, grads, settings):
    """The update the earlier implementation computed before rounding: torch's AdamW in float32."""
    p = torch.nn.Parameter(start_bf16.float())
    optimizer = torch.optim.AdamW([p], **settings)
    for grad in grads:
        p.grad = grad.float()
        optimizer.step()
    return p.detach()


def test_a_bf16_step_is_the_float32_update_rounded_without_bias_to_a_neighbour(monkeypatch):
    monkeypatch.setattr(optim, "SLICE_ELEMENTS", 1 << 17)  # a quick table: 1 slice
    copies, settings = 4096, {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    values = torch.tensor([1.0, -0.3, 2.5e-3, 7.0, -1e-5, 0.0, 100.0, 0.7], dtype=torch.bfloat16)
    start = values.repeat(copies, 1)  # every column's copies round independently
    grad = torch.tensor([0.5, -2.0, 1e-3, 0.0, 3.0, 1.0, -0.1, 1e-8], dtype=torch.bfloat16).repeat(copies, 1)
    exact = adamw_in_float32(start, [grad], settings)[0]
    p = torch.nn.Parameter(start.clone())
    p.grad = grad.clone()
    StochasticRoundingAdamW([p], seed=11, **settings).step()
    rounded = p.detach().float()
    for column in range(values.numel()):
        below = (exact[column].view(torch.int32) & -(1 << 16)).view(torch.float32)
        above = (below.view(torch.int32) + (1 << 16)).view(torch.float32)
        assert set(rounded[:, column].unique().tolist()) <= {below.item(), above.item()}, column
        # The mean of the copies is the float32 update within 5 standard errors of a coin flip.
        bound = 5 * 0.5 * (above - below).abs().item() / copies**0.5
        assert abs(rounded[:, column].mean().item() - exact[column].item()) <= bound, column


def test_float32_parameters_get_torchs_adamw_update():
    torch.manual_seed(0)
    ours, theirs = torch.nn.Parameter(torch.randn(5, 7)), torch.nn.Parameter(torch.randn(5, 7))
    theirs.data.copy_(ours.data)
    settings = {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    optimizers = [StochasticRoundingAdamW([ours], **settings), torch.optim.AdamW([theirs], **settings)]
    for _ in range(4):
        grad = torch.randn(5, 7)
        for p, optimizer in zip((ours, theirs), optimizers):
            p.grad = grad.clone()
            optimizer.step()
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_bf16_updates_below_half_an_ulp_still_move_the_weights_on_average():
    # lr 1e-4 on weights of 1.0: each step is 1/40 of a bf16 ulp at 1.0, lost by round-to-nearest.
    p = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    optimizer = StochasticRoundingAdamW([p], lr=1e-4, seed=3)
    for _ in range(50):
        p.grad = torch.ones_like(p)
        optimizer.step()
    assert p.dtype == torch.bfloat16
    assert optimizer.state[p]["exp_avg"].dtype == torch.float32
    assert p.float().mean().item() == pytest.approx(1.0 - 50 * 1e-4, abs=3e-4)
    nearest = torch.ones(4096, dtype=torch.bfloat16)
    nearest -= 1e-4
    assert torch.equal(nearest, torch.ones_like(nearest))  # what plain bf16 arithmetic would keep


def make_params():
    torch.manual_seed(0)
    shapes = [(40, 30), (30,), (7,), (100, 3), (5, 5)]
    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in shapes]
    params.append(torch.nn.Parameter(torch.randn(6)))  # a float32 one among them
    return params


def set_grads(params, step):
    generator = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)


def run(seed, steps, params=None, optimizer=None):
    params = params if params is not None else make_params()
    optimizer = optimizer or StochasticRoundingAdamW(params, lr=1e-2, weight_decay=0.1, seed=seed)
    for _ in range(steps):
        set_grads(params, optimizer.state[params[0]].get("step", 0))
        optimizer.step()
    return params, optimizer


def test_rounding_repeats_with_the_seed_and_differs_across_seeds():
    first, again, other = (run(seed, 3)[0] for seed in (0, 0, 1))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first[:-1], other[:-1]))
    assert torch.equal(first[-1], other[-1])  # float32 weights are not rounded: the seed is moot


@pytest.mark.parametrize("slice_elements", [1 << 24, 64], ids=["whole", "sliced"])
def test_resume_from_the_state_dict_is_bitwise(monkeypatch, slice_elements):
    monkeypatch.setattr(optim, "SLICE_ELEMENTS", slice_elements)
    straight, _ = run(5, 4)
    params, optimizer = run(5, 2)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
    fresh = StochasticRoundingAdamW(resumed, lr=1e-2, weight_decay=0.1, seed=5)
    fresh.load_state_dict(saved["optimizer"])
    assert fresh.state[resumed[0]]["exp_avg"].dtype == torch.float32
    run(5, 2, resumed, fresh)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_a_state_dict_of_another_optimizer_is_refused():
    params = make_params()
    other = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    set_grads(params, 0)
    other.step()
    with pytest.raises(ValueError, match="parameter 0 is not StochasticRoundingAdamW's.*momentum_buffer"):
        StochasticRoundingAdamW(params).load_state_dict(other.state_dict())


def test_large_tensors_update_in_slices_like_small_ones(monkeypatch):
    # float16 is rounded to nearest (no noise): slicing and packing must not change a bit.
    def step():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s).half()) for s in [(10, 10), (3,), (50,)]]
        optimizer = StochasticRoundingAdamW(params, lr=0.01)
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(p.shape).half()
            optimizer.step()
        return params, optimizer

    whole, _ = step()
    monkeypatch.setattr(optim, "SLICE_ELEMENTS", 7)
    sliced, optimizer = step()
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced))
    assert optimizer.state[sliced[0]]["step"] == 2


def test_parameters_without_a_gradient_or_elements_are_left_alone():
    used, unused, empty = (torch.nn.Parameter(torch.ones(s, dtype=torch.bfloat16)) for s in (4, 4, 0))
    used.grad, empty.grad = torch.ones(4, dtype=torch.bfloat16), torch.ones(0, dtype=torch.bfloat16)
    optimizer = StochasticRoundingAdamW([used, unused, empty], lr=0.1)
    optimizer.step()
    assert torch.equal(unused, torch.ones(4, dtype=torch.bfloat16)) and unused not in optimizer.state
    assert (used < 1).all() and optimizer.state[empty]["step"] == 1


class CountKernels(TorchDispatchMode):
    """aten operations that compute (views, which launch nothing, are not counted)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.allocated_elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.count += 1
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default):
            self.allocated_elements += out.numel()
        return out


def test_a_step_is_a_few_operations_per_tensor_not_a_dozen():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 16).bfloat16()) for _ in range(40)]
    optimizer = StochasticRoundingAdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn(16, 16).bfloat16()
    optimizer.step()  # the first step also makes the moments and the noise table
    with CountKernels() as counter:
        optimizer.step()
    # One noise multiply per tensor and about ten whole-buffer operations (the earlier
    # implementation issued 13 per tensor: 520 here).
    assert counter.count <= len(params) + 12


@pytest.mark.parametrize("moments", ["fp32", "bf16", "8bit"])
def test_the_packed_buffers_are_kept_from_step_to_step(moments):
    """A large CPU tensor made anew is a fresh mapping whose pages fault in at every step."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 64).bfloat16()) for _ in range(4)]
    optimizer = StochasticRoundingAdamW(params, lr=1e-3, moments=moments)
    for p in params:
        p.grad = torch.randn(64, 64).bfloat16()
    with CountKernels() as first:
        optimizer.step()
    with CountKernels() as second:
        optimizer.step()
    buffers = 2 if moments == "fp32" else 4
    assert first.allocated_elements >= buffers * 4 * 64 * 64
    # 8-bit moments are requantized through small temporaries; nothing buffer-sized is made again.
    assert second.allocated_elements < 4 * 64 * 64


MOMENT_DTYPES = {
    "fp32": {"exp_avg": torch.float32, "exp_avg_sq": torch.float32},
    "bf16": {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16},
    "8bit": {"exp_avg": torch.int8, "exp_avg_absmax": torch.float32, "exp_avg_sq": torch.uint8, "exp_avg_sq_absmax": torch.float32},
}


@pytest.mark.parametrize("moments", ["fp32", "bf16", "8bit"])
def test_moments_are_kept_in_the_chosen_form(moments):
    params = make_params()
    run(0, 1, params, StochasticRoundingAdamW(params, lr=1e-2, moments=moments))
    optimizer = run(0, 1, params, StochasticRoundingAdamW(params, lr=1e-2, moments=moments))[1]
    state = optimizer.state[params[0]]
    assert {k: v.dtype for k, v in state.items() if k != "step"} == MOMENT_DTYPES[moments]
    held = sum(v.numel() * v.element_size() for s in optimizer.state.values() for k, v in s.items() if k != "step")
    count = sum(p.numel() for p in params)
    # The scales round up to whole blocks per tensor: at most one extra block each.
    assert count * optim.moment_bytes(moments) <= held <= count * optim.moment_bytes(moments) + len(params) * 8
    assert optim.moment_bytes("offload") == 0 and optim.moment_bytes("8bit") == pytest.approx(2.03125)


def test_moments_offload_and_unknown_forms_are_refused_where_they_cannot_work():
    with pytest.raises(ValueError, match="offload.*host memory for CUDA parameters; these are in it already"):
        StochasticRoundingAdamW(make_params(), moments="offload")
    with pytest.raises(ValueError, match="moments 'int4': use one of fp32, bf16, 8bit, offload"):
        StochasticRoundingAdamW(make_params(), moments="int4")


def test_bf16_moments_are_the_float32_ones_rounded_without_bias():
    copies = 8192
    grad = torch.tensor([0.3, -1.7, 2e-3, 5.0]).repeat(copies, 1)
    exact_p, p = torch.nn.Parameter(torch.zeros_like(grad)), torch.nn.Parameter(torch.zeros_like(grad))
    exact, ours = (
        torch.optim.AdamW([exact_p], lr=1e-3, betas=(0.9, 0.99)),
        StochasticRoundingAdamW([p], lr=1e-3, betas=(0.9, 0.99), seed=2, moments="bf16"),
    )
    for optimizer, param in ((exact, exact_p), (ours, p)):
        param.grad = grad.clone()
        optimizer.step()
    for key in ("exp_avg", "exp_avg_sq"):
        want, got = exact.state[exact_p][key][0], ours.state[p][key].float()
        for column in range(4):
            below = (want[column].view(torch.int32) & -(1 << 16)).view(torch.float32)
            above = (below.view(torch.int32) + (1 << 16)).view(torch.float32)
            assert set(got[:, column].unique().tolist()) <= {below.item(), above.item()}, (key, column)
            bound = 5 * 0.5 * (above - below).abs().item() / copies**0.5
            assert abs(got[:, column].mean().item() - want[column].item()) <= bound, (key, column)
    # The two moments and the weights draw different noise: their roundings are not the same coin.
    up_m = ours.state[p]["exp_avg"].float()[:, 0] > exact.state[exact_p]["exp_avg"][0, 0]
    up_v = ours.state[p]["exp_avg_sq"].float()[:, 0] > exact.state[exact_p]["exp_avg_sq"][0, 0]
    p_m, p_v = up_m.float().mean().item(), up_v.float().mean().item()
    independent = p_m * p_v + (1 - p_m) * (1 - p_v)
    assert abs((up_m == up_v).float().mean().item() - independent) < 5 * 0.5 / copies**0.5


def test_8bit_codes_keep_relative_precision_over_a_wide_range():
    torch.manual_seed(0)
    n = 10 * optim.QUANT_BLOCK + 17  # a partial last block
    magnitudes = 10 ** torch.empty(n).uniform_(-4, 0)  # four decades below each block's largest
    signed = magnitudes * torch.randn(n).sign()
    for x, is_signed in ((signed, True), (magnitudes**2, False)):
        codes, absmax = optim.quantize_blockwise(x, signed=is_signed)
        assert codes.dtype == (torch.int8 if is_signed else torch.uint8) and codes.numel() == n
        assert absmax.numel() == 11 and torch.equal(absmax[0], x[: optim.QUANT_BLOCK].abs().max())
        back = torch.empty(n)
        optim.dequantize_blockwise(codes, absmax, back)
        assert torch.equal(back.sign(), x.sign())
        block_max = absmax.repeat_interleave(optim.QUANT_BLOCK)[:n]
        relative = (back - x).abs() / x.abs()
        # Half a code step in the power-law domain (x = absmax (q / levels)^power) at most.
        power, levels = (2, 127) if is_signed else (4, 255)
        q = (x.abs() / block_max) ** (1 / power) * levels
        coded = q >= 2
        assert (relative[coded] <= ((q[coded] + 0.5) / q[coded]) ** power - 1 + 1e-5).all(), is_signed
        assert relative.median().item() < 0.05, is_signed  # over four decades
    # An all-zero block (a parameter that never had a gradient) reads back as zeros.
    codes, absmax = optim.quantize_blockwise(torch.zeros(300), signed=False)
    back = torch.ones(300)
    optim.dequantize_blockwise(codes, absmax, back)
    assert torch.equal(back, torch.zeros(300))


def test_an_8bit_second_moment_that_rounds_to_zero_cannot_blow_the_update_up():
    # Element 0 saw one huge gradient long ago: its v (beta2 0.999) still sets the block's scale,
    # while its m (beta1 0.9) has decayed. Element 1's small gradients keep an m that its code
    # holds and a v that rounds to the zero code. A step without gradient (an embedding row the
    # batch did not use) must then move element 1 by about lr, not by m / eps.
    p = torch.nn.Parameter(torch.zeros(optim.QUANT_BLOCK))
    optimizer = StochasticRoundingAdamW([p], lr=1e-3, moments="8bit")
    for step in range(61):
        p.grad = torch.zeros_like(p)
        p.grad[0 if step == 0 else 1] = 1e4 if step == 0 else 1e-3
        optimizer.step()
    assert optimizer.state[p]["exp_avg"][1] != 0 and optimizer.state[p]["exp_avg_sq"][1] <= 1  # v at the bottom code
    before = p.detach().clone()
    p.grad = torch.zeros_like(p)
    optimizer.step()
    assert (p.detach() - before).abs().max().item() < 1e-2


@pytest.mark.parametrize("moments", ["fp32", "bf16", "8bit"])
def test_each_moment_form_fits_a_least_squares_problem_like_float32_moments(moments):
    torch.manual_seed(0)
    inputs, target = torch.randn(256, 32), torch.randn(32, 8)
    outputs = inputs @ target

    def fit(moments, dtype):
        w = torch.nn.Parameter(torch.zeros(32, 8, dtype=dtype))
        optimizer = StochasticRoundingAdamW([w], lr=3e-2, seed=1, moments=moments)
        for _ in range(300):
            loss = ((inputs @ w.float() - outputs) ** 2).mean()
            w.grad = torch.autograd.grad(loss, w)[0]
            optimizer.step()
        return ((inputs @ w.float() - outputs) ** 2).mean().item()

    start = (outputs**2).mean().item()
    for dtype in (torch.float32, torch.bfloat16):
        reference, ours = fit("fp32", dtype), fit(moments, dtype)
        assert ours < 1e-2 * start and ours < max(2 * reference, 1e-3 * start), (dtype, ours, reference)


@pytest.mark.parametrize("moments", ["bf16", "8bit"])
@pytest.mark.parametrize("slice_elements", [1 << 24, optim.QUANT_BLOCK], ids=["whole", "sliced"])
def test_reduced_moments_resume_bitwise_from_the_state_dict(monkeypatch, moments, slice_elements):
    monkeypatch.setattr(optim, "SLICE_ELEMENTS", slice_elements)

    def optimizer_for(params):
        return StochasticRoundingAdamW(params, lr=1e-2, weight_decay=0.1, seed=5, moments=moments)

    straight_params = make_params()
    straight, _ = run(5, 4, straight_params, optimizer_for(straight_params))
    params = make_params()
    params, optimizer = run(5, 2, params, optimizer_for(params))
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
    fresh = optimizer_for(resumed)
    fresh.load_state_dict(saved["optimizer"])
    assert {k: v.dtype for k, v in fresh.state[resumed[0]].items() if k != "step"} == MOMENT_DTYPES[moments]
    run(5, 2, resumed, fresh)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    with pytest.raises(
        ValueError, match=rf"holds exp_avg torch.float32.*other moments than these \({moments}\); resume with the --optimizer-state"
    ):
        optimizer_for(resumed).load_state_dict(run(5, 1)[1].state_dict())


def compiled_and_eager(steps: int) -> tuple[list, list, StochasticRoundingAdamW, StochasticRoundingAdamW]:
    """``make_params``'s parameters trained ``steps`` steps by the compiled and by the eager kernel."""
    eager_params, compiled_params = make_params(), make_params()
    eager = StochasticRoundingAdamW(eager_params, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), seed=5)
    compiled = StochasticRoundingAdamW(compiled_params, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), seed=5, kernel="compiled")
    for _ in range(steps):
        run(5, 1, eager_params, eager)
        run(5, 1, compiled_params, compiled)
    return eager_params, compiled_params, eager, compiled


def weights_differing_from_eager(eager_params, compiled_params, eager, compiled) -> int:
    """How many weights the compiled step left other than the eager one, once the moments agree
    within float32 rounding and every differing weight is one bf16 step away."""
    differ = 0
    for e, c in zip(eager_params, compiled_params):
        assert c.dtype == e.dtype
        for key in ("exp_avg", "exp_avg_sq"):
            scale = eager.state[e][key].abs().max()
            assert torch.allclose(compiled.state[c][key], eager.state[e][key], rtol=1e-5, atol=1e-6 * scale)
        # The same noise on the same float32 update: a weight differs only where the update's last
        # float32 bits moved it across a rounding boundary, and then by one bf16 step.
        unequal = e != c
        differ += int(unequal.sum())
        steps = (e.float().view(torch.int32) - c.float().view(torch.int32)).abs()[unequal]
        assert bool((steps == 1 << 16).all()) if e.dtype == torch.bfloat16 else not unequal.any()
    return differ


@pytest.mark.slow  # builds the kernel: 3-13 s on 2 cores
@pytest.mark.parametrize("slice_elements", [1 << 24, 64], ids=["whole", "sliced"])
def test_the_compiled_step_is_the_eager_one_up_to_float32_rounding(monkeypatch, slice_elements):
    monkeypatch.setattr(optim, "SLICE_ELEMENTS", slice_elements)
    eager_params, compiled_params, eager, compiled = compiled_and_eager(3)
    assert weights_differing_from_eager(eager_params, compiled_params, eager, compiled) <= 2  # of 1,343 bf16 weights, 3 steps
    assert compiled.state[compiled_params[0]]["step"] == 3


@pytest.mark.slow  # builds the kernel
def test_the_compiled_step_repeats_resumes_bitwise_and_keys_the_noise_by_seed(monkeypatch):
    monkeypatch.setattr(optim, "SLICE_ELEMENTS", 64)  # several slices per tensor

    def trained(seed, steps, params=None, optimizer=None):
        params = params if params is not None else make_params()
        optimizer = optimizer or StochasticRoundingAdamW(params, lr=1e-2, weight_decay=0.1, seed=seed, kernel="compiled")
        return run(seed, steps, params, optimizer)

    straight, _ = trained(5, 4)
    again, _ = trained(5, 4)
    other, _ = trained(6, 4)
    assert all(torch.equal(a, b) for a, b in zip(straight, again))
    assert not all(torch.equal(a, b) for a, b in zip(straight[:-1], other[:-1]))
    params, optimizer = trained(5, 2)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = StochasticRoundingAdamW(resumed, lr=1e-2, weight_decay=0.1, seed=5, kernel="compiled")
    fresh.load_state_dict(optimizer.state_dict())
    trained(5, 2, resumed, fresh)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


@pytest.mark.slow  # builds the kernel afresh
def test_the_compiled_step_is_one_generated_kernel_called_once_per_tensor(monkeypatch):
    from torch._inductor import metrics

    torch._dynamo.reset()
    optim.compiled_one_pass_update.cache_clear()
    metrics.reset()
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    calls = []
    compiled = optim.compiled_one_pass_update()
    monkeypatch.setattr(optim, "compiled_one_pass_update", lambda: lambda *a: calls.append(a[0].numel()) or compiled(*a))
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in [(16, 16)] * 20 + [(100,)] * 20]
    optimizer = StochasticRoundingAdamW(params, lr=1e-3, kernel="compiled")
    built = []
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape).bfloat16()
        optimizer.step()
        built.append((metrics.generated_kernel_count, torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before))
    # One kernel per graph; every length shares a graph (dynamic shapes; dynamo makes a second one
    # for views that start inside their storage); nothing is built at the second step.
    assert built[0] == built[1] and built[0][0] == built[0][1] <= 2
    assert calls == [p.numel() for p in params] * 2


def test_the_compiled_kernels_noise_is_the_tables():
    counters = torch.arange(1 << 20, dtype=torch.int32)
    assert torch.equal(optim.hash_noise(counters), noise_table(1 << 20, torch.device("cpu")))
    top = torch.tensor([(1 << 24) - 1], dtype=torch.int32)
    assert optim.hash_noise(top).item() == python_mix((1 << 24) - 1, (0x7FEB352D, 0x5BD1E995)) >> 16


def test_a_compiled_step_that_cannot_be_built_says_so_and_changes_nothing(monkeypatch):
    def refuses(*args):
        raise RuntimeError("InductorError: CppCompileError: C++ compile error\nmore lines")

    monkeypatch.setattr(optim, "compiled_one_pass_update", lambda: refuses)
    params = make_params()
    before = [p.detach().clone() for p in params]
    optimizer = StochasticRoundingAdamW(params, lr=1e-2, kernel="compiled")
    set_grads(params, 0)
    with pytest.raises(
        RuntimeError,
        match=r"could not be built on cpu \(RuntimeError: InductorError: CppCompileError: C\+\+ compile error\); "
        "--backend-opt optimizer_kernel=eager runs without it",
    ):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before[:-1], params[:-1]))


def test_the_compiled_kernel_is_refused_for_moments_it_does_not_keep():
    with pytest.raises(ValueError, match="the compiled kernel keeps float32 moments; moments '8bit' take the eager one"):
        StochasticRoundingAdamW(make_params(), moments="8bit", kernel="compiled")
    with pytest.raises(ValueError, match="kernel 'triton': use eager or compiled"):
        StochasticRoundingAdamW(make_params(), kernel="triton")


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    ("requested", "dtype", "moments", "device", "problem", "kernel", "line"),
    [
        ("auto", torch.bfloat16, "fp32", CUDA, None, "compiled", "compiled (one torch.compile'd pass over each bfloat16 tensor"),
        ("auto", torch.bfloat16, "fp32", CPU, None, "eager", "eager (auto on cpu: building the compiled step takes seconds"),
        ("compiled", torch.bfloat16, "fp32", CPU, None, "compiled", "compiled (one torch.compile'd pass"),
        ("eager", torch.bfloat16, "fp32", CUDA, None, "eager", "eager (optimizer_kernel=eager: float32 buffers, a noise table)"),
        ("auto", torch.bfloat16, "fp32", CUDA, "Triton is missing", "eager", "eager (Triton is missing)"),
        ("auto", torch.bfloat16, "8bit", CUDA, None, "eager", "eager (the compiled step keeps float32 moments, these are 8bit)"),
        ("auto", torch.float32, "fp32", CUDA, None, "eager", "torch's fused AdamW (float32 weights and moments)"),
        ("eager", torch.float32, "bf16", CPU, None, "eager", "eager (float32 weights with bf16 moments)"),
    ],
)
def test_the_optimizer_kernel_is_chosen_by_device_weights_and_moments(
    monkeypatch, requested, dtype, moments, device, problem, kernel, line
):
    monkeypatch.setattr(optim, "compile_problem", lambda d: problem)
    chosen, why = optim.resolve_optimizer_kernel(requested, dtype, moments, device)
    assert chosen == kernel and why.startswith(line), why


@pytest.mark.parametrize(
    ("dtype", "moments", "problem", "message"),
    [
        (torch.float32, "fp32", None, "the compiled step rounds bfloat16 weights, these are float32: use --dtype bfloat16"),
        (torch.bfloat16, "bf16", None, "keeps float32 moments; --optimizer-state bf16 takes the eager step"),
        (torch.bfloat16, "fp32", "no C++ compiler here", "optimizer_kernel=compiled: no C\\+\\+ compiler here"),
    ],
)
def test_a_compiled_kernel_that_cannot_apply_is_refused(monkeypatch, dtype, moments, problem, message):
    monkeypatch.setattr(optim, "compile_problem", lambda d: problem)
    with pytest.raises(PluginError, match=message):
        optim.resolve_optimizer_kernel("compiled", dtype, moments, CPU)
    with pytest.raises(PluginError, match="optimizer_kernel=fused: use one of auto, compiled, eager"):
        optim.resolve_optimizer_kernel("fused", dtype, moments, CPU)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA GPU")
def test_on_a_gpu_the_compiled_step_is_the_eager_one_up_to_float32_rounding():
    """The Triton kernel of the compiled step against the eager packed step, both on the GPU."""
    eager_params, compiled_params = ([torch.nn.Parameter(p.detach().cuda()) for p in make_params()] for _ in range(2))
    eager = StochasticRoundingAdamW(eager_params, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), seed=5)
    compiled = StochasticRoundingAdamW(compiled_params, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), seed=5, kernel="compiled")
    for step in range(3):
        generator = torch.Generator().manual_seed(1000 + step)
        grads = [torch.randn(p.shape, generator=generator).to(p.dtype) for p in eager_params]
        for params, optimizer in ((eager_params, eager), (compiled_params, compiled)):
            for p, g in zip(params, grads):
                p.grad = g.cuda()
            optimizer.step()
    # Of 1,343 bf16 weights, 3 steps (2 on the CPU).
    assert weights_differing_from_eager(eager_params, compiled_params, eager, compiled) <= 4
