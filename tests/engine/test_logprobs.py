"""Padding-free batches: sequences that run whole packed end to end (engine/logprobs.py)."""

from __future__ import annotations

import pytest
import torch

from grpo_core.config import RunConfig
from grpo_core.engine import logprobs as engine_logprobs
from grpo_core.engine.forward import TRAINER_FORWARD, TransformersForward, computing_in_float32
from grpo_core.engine.logprobs import first_trained, pack_rows, packed_layout, target_logprobs
from grpo_core.engine.models import load_model, model_path
from grpo_core.plugins.backends.local import LocalBackend
from tests.core.tiny_runs import length_reward  # noqa: F401 (autouse: the runs below score with the "length" reward)
from tests.engine.ragged_datums import datum, ragged_datums


def spy(monkeypatch, *names):
    paths = []
    for name in names:
        original = getattr(engine_logprobs, name)
        monkeypatch.setattr(engine_logprobs, name, lambda *a, _f=original, _n=name, **k: paths.append(_n) or _f(*a, **k))
    return paths


def make_trainer(model_dir, **options):
    return LocalBackend(**options).make_trainer(config=RunConfig(model=str(model_dir)))


@pytest.mark.parametrize(
    ("lengths", "width", "rows"),
    [
        ([5, 2, 3, 1, 4], 5, [[0], [4, 3], [2, 1]]),
        ([5, 2, 3, 1, 4], 10, [[0, 4, 3], [2, 1]]),
        ([3, 3, 3], 3, [[0], [1], [2]]),
        ([7], 7, [[0]]),
        ([1, 1, 1, 1, 4], 4, [[4], [0, 1, 2, 3]]),
    ],
    ids=["first_fit_longest_first", "wider", "equal_lengths", "one", "short_ones_fill_a_row"],
)
def test_pack_rows_fills_rows_first_fit_longest_first(lengths, width, rows):
    assert pack_rows(lengths, width) == rows


@pytest.mark.parametrize(
    ("token_cost", "pair_cost", "rows"),
    [
        # Widths 5, 10, 20: 4 rows of 5 (20t + 100p), 2 of 8 (16t + 128p), 1 of 14 (14t + 196p).
        (1.0, 1.0, [[0], [1], [2], [3]]),
        (100.0, 1.0, [[0, 1, 2, 3]]),
        (1.0, 0.0, [[0, 1, 2, 3]]),
        (20.0, 1.0, [[0, 1], [2, 3]]),
    ],
    ids=["attention_heavy", "weights_heavy", "no_attention", "in_between"],
)
def test_packed_layout_takes_the_width_of_least_estimated_cost(token_cost, pair_cost, rows):
    assert packed_layout([5, 3, 3, 3], token_cost, pair_cost) == rows


def test_layer_costs_are_a_layers_weights_and_the_work_of_one_attention_pair(tiny_model_dir):
    model, _ = load_model(str(tiny_model_dir), torch.device("cpu"), "sdpa")
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    # Per layer: its weights (the final norm's 64 spread over both layers); q·k and a·v of 4 heads of 16.
    assert TransformersForward(model).layer_costs == (layer + 64 / 2, 2 * 4 * 16) == (37056, 128)


@pytest.mark.parametrize(
    ("costs", "rows"),
    [(None, [[0, 4, 3, 2, 1, 6, 5]]), ((1.0, 1e6), [[0], [4, 6], [3, 2, 5], [1]])],
    ids=["one_row", "rows_as_wide_as_the_longest"],
)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logprobs_and_gradients_equal_the_padded_ones(tiny_model_dir, attention, costs, rows, monkeypatch):
    model, _ = load_model(str(tiny_model_dir), torch.device("cpu"), attention)
    forward = TransformersForward(model, padding_free=True)
    assert forward.packing_problem is None
    # The tiny model's own costs pack all 7 sequences (122 tokens) into one row; attention made
    # dear, rows are as wide as the longest sequence (39).
    forward.layer_costs = costs or forward.layer_costs
    datums = ragged_datums()
    paths = spy(monkeypatch, "_logprobs_packed", "_logprobs_one_pass")
    masks = [torch.tensor(d.loss_fn_inputs["weights"].data) for d in datums]
    results = {}
    for packed in (True, False):
        logprobs, _ = target_logprobs(forward, datums, torch.device("cpu"), one_pass=True, packed=packed)
        sum((lp * m).sum() * (i + 1) for i, (lp, m) in enumerate(zip(logprobs, masks))).backward()
        results[packed] = ([lp.detach() for lp in logprobs], {n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    assert paths == ["_logprobs_packed", "_logprobs_one_pass"]
    (packed_lps, packed_grads), (padded_lps, padded_grads) = results[True], results[False]
    for d, got, want in zip(datums, packed_lps, padded_lps):
        assert got.shape == want.shape == (len(d.model_input.to_ints()),)
        first = first_trained(d.loss_fn_inputs["weights"].data)
        assert torch.allclose(got[first:], want[first:], rtol=0, atol=1e-6)
        assert not got[:first].any()  # before the first trained target: never scored
    assert packed_layout([len(d.model_input.to_ints()) for d in datums], *forward.layer_costs) == rows
    for name, grad in packed_grads.items():
        assert torch.allclose(grad, padded_grads[name], rtol=0, atol=1e-5 * float(grad.abs().max())), name


def test_sequences_that_share_a_prompt_keep_the_shared_prefix_path(tiny_model_dir, monkeypatch):
    trainer = make_trainer(tiny_model_dir)
    assert trainer.forward_fn.packs
    paths = spy(monkeypatch, "_logprobs_packed", "_logprobs_one_pass", "_logprobs_shared_prefix")
    prompt = [5, 9, 11, 4]
    trainer.forward([datum(prompt + [7] * n, len(prompt) - 1) for n in (1, 6, 3, 2)])
    assert paths == ["_logprobs_shared_prefix"]


@pytest.mark.parametrize(("checkpointing", "tokens"), [(False, 3 + 12), (True, 4 * 3 + 12)])
def test_the_trainer_counts_the_tokens_it_ran_a_shared_prompt_once_unless_checkpointing_runs_rows_whole(
    tiny_model_dir, checkpointing, tokens
):
    from grpo_core.engine.logprobs import tokens_run

    trainer = LocalBackend().make_trainer(config=RunConfig(model=str(tiny_model_dir), gradient_checkpointing=checkpointing))
    prompt = [5, 9, 11, 4]
    # Inputs of 3 + n tokens: the 3 untrained ones are the group's shared prefix, run once without checkpointing.
    datums = [datum(prompt + [7] * n, len(prompt) - 1) for n in (1, 6, 3, 2)]
    assert sum(d.model_input.length for d in datums) == 24
    for _ in range(2):
        trainer.forward_backward_custom(datums, lambda d, lps: (sum(lp.sum() for lp in lps), {}))
    trainer.forward(datums)  # no gradient: not a training token
    assert trainer.perf_counters()["forward_tokens"] == 2 * tokens
    assert trainer.perf_counters()["forward_tokens"] == 0  # read once: the next step counts its own
    assert tokens_run(ragged_datums(), whole_rows=False) == sum(d.model_input.length for d in ragged_datums())  # none shared


def test_equal_lengths_gain_nothing_from_packing_and_stay_padded(tiny_model_dir, monkeypatch):
    trainer = make_trainer(tiny_model_dir)
    paths = spy(monkeypatch, "_logprobs_packed", "_logprobs_one_pass")
    trainer.forward([datum([i, 3, 4, 5, 6], 1) for i in (10, 11, 12)])
    assert paths == ["_logprobs_one_pass"]


def test_the_trainer_and_its_reference_pack_by_default_and_the_start_line_says_so(tiny_model_dir, monkeypatch, capsys):
    trainer = make_trainer(tiny_model_dir)
    assert "trainer forward: transformers (" in capsys.readouterr().err.splitlines()[-1]
    reference = LocalBackend().make_reference(config=RunConfig(model=str(tiny_model_dir)), trainer=trainer)
    assert trainer.forward_fn.packs and reference.forward_fn.packs
    assert trainer.forward_fn.padding_line() == (
        "sequences that run whole are packed, not padded (sdpa attention isolates them with a block-diagonal mask; "
        "not varlen: varlen_attn is a CUDA kernel and this run is on cpu)"
    )
    paths = spy(monkeypatch, "_logprobs_packed", "_logprobs_one_pass")
    datums = ragged_datums()
    trainer.forward_backward_custom(datums, lambda d, lps: (sum(lp.sum() for lp in lps), {}))
    reference.forward(datums)
    assert paths == ["_logprobs_packed", "_logprobs_packed"]


def test_padding_free_false_pads_every_batch(tiny_model_dir, monkeypatch, capsys):
    trainer = make_trainer(tiny_model_dir, padding_free=False)
    assert capsys.readouterr().err.splitlines()[-1].endswith("; sequences are padded (--backend-opt padding_free=false)")
    reference = LocalBackend(padding_free=False).make_reference(config=RunConfig(model=str(tiny_model_dir)), trainer=trainer)
    assert not trainer.forward_fn.packs and not reference.forward_fn.packs
    paths = spy(monkeypatch, "_logprobs_packed", "_logprobs_one_pass")
    trainer.forward(ragged_datums())
    reference.forward(ragged_datums())
    assert paths == ["_logprobs_one_pass", "_logprobs_one_pass"]


def test_packed_sequences_are_scored_under_gradient_checkpointing_too(tiny_model_dir, monkeypatch):
    plain = make_trainer(tiny_model_dir, padding_free=False)
    checkpointed = LocalBackend().make_trainer(config=RunConfig(model=str(tiny_model_dir), gradient_checkpointing=True))
    paths = spy(monkeypatch, "_logprobs_packed", "_logprobs_one_pass")
    prompt = [5, 9, 11, 4]
    # A shared prompt: checkpointing runs every row whole, and those are packed.
    datums = [datum(prompt + [7] * n, len(prompt) - 1) for n in (1, 6, 3, 2)]
    got = [lp for lp in checkpointed.forward_backward_custom(datums, lambda d, lps: (sum(lp.sum() for lp in lps), {})).loss_fn_outputs]
    want = plain.forward(datums)
    assert paths == ["_logprobs_packed"]  # the plain trainer ran the shared-prefix path
    for g, w, d in zip(got, want, datums):
        first = first_trained(d.loss_fn_inputs["weights"].data)
        assert torch.allclose(g["logprobs"].to_torch()[first:], w[first:], atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["tiny", "default"])
def test_a_model_that_lets_packed_sequences_see_each_other_is_padded_with_the_reason(tiny_model_dir, monkeypatch, capsys, model, dtype):
    import transformers.masking_utils

    # What an attention path without packed-sequence support does: one causal mask over the row.
    # On the embedded model in bfloat16 the leak (0.045, 3 bf16 units of the largest hidden value
    # 1.9) hid under a bound of 16 bf16 units; the check computes in float32.
    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    path = str(tiny_model_dir) if model == "tiny" else "default"
    trainer = LocalBackend().make_trainer(config=RunConfig(model=path, dtype=dtype))
    reason = "sdpa attention lets sequences packed in one row see each other in this qwen3 model"
    assert trainer.forward_fn.packing_problem == reason
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"; sequences are padded ({reason})")
    paths = spy(monkeypatch, "_logprobs_packed", "_logprobs_one_pass")
    trainer.forward(ragged_datums())
    assert paths == ["_logprobs_one_pass"]


@pytest.mark.parametrize("model", ["tiny", "default"])
def test_the_bfloat16_check_computes_in_float32_packs_an_isolating_model_and_leaves_its_weights_as_they_were(tiny_model_dir, model):
    path = str(tiny_model_dir) if model == "tiny" else model_path("default")
    lm, _ = load_model(path, torch.device("cpu"), "sdpa", dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    dtypes = []
    # A hook after the call registered before the check's: it runs before the weight is put back.
    q_proj = lm.model.layers[0].self_attn.q_proj
    hook = q_proj.register_forward_hook(lambda m, args, out: dtypes.append((m.weight.dtype, args[0].dtype, out.dtype)))
    assert TransformersForward(lm, padding_free=True).packing_problem is None
    hook.remove()
    assert set(dtypes[-3:]) == {(torch.float32,) * 3}  # the check's three forwards (the head check runs in bf16)
    after = lm.state_dict()
    assert all(after[k].dtype == torch.bfloat16 and torch.equal(after[k], v) for k, v in before.items())
    assert all(p.dtype == torch.bfloat16 for p in lm.parameters())

    def fail(module, args):
        raise RuntimeError("a forward that fails midway")

    # Registered first, so it runs after the upcast of the layer's input norm and q_proj's own.
    hook = lm.model.layers[0].self_attn.o_proj.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="midway"), computing_in_float32(lm):
        lm(torch.tensor([[1, 2]]))
    hook.remove()
    assert all(p.dtype == torch.bfloat16 for p in lm.parameters())  # put back all the same
    assert all(torch.equal(lm.state_dict()[k], v) for k, v in before.items())


def test_a_model_whose_positions_do_not_restart_is_padded_with_the_reason():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=2, attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(config).eval()
    absolute = model.transformer.wpe
    counting = type(absolute).forward
    # Learned absolute positions (where a shift changes the result, unlike rotary angles) read
    # from the row's own count, whatever the position ids say.
    absolute.forward = lambda position_ids: counting(absolute, torch.arange(position_ids.shape[-1]).expand_as(position_ids))
    assert TransformersForward(model, padding_free=True).packing_problem == (
        "this gpt2 model does not restart positions with the position ids of packed sequences"
    )
    absolute.forward = lambda position_ids: counting(absolute, position_ids)
    assert TransformersForward(model, padding_free=True).packing_problem is None


@pytest.mark.parametrize(
    ("options", "forward_path", "padding_free", "info"),
    [
        (
            {},
            1.0,
            1.0,
            {
                "trainer": {
                    "forward": TRAINER_FORWARD,
                    "padding": (
                        "sequences that run whole are packed, not padded (sdpa attention isolates them with a "
                        "block-diagonal mask; not varlen: varlen_attn is a CUDA kernel and this run is on cpu)"
                    ),
                    "optimizer": "torch's fused AdamW (float32 weights and moments)",
                },
                "sampler": {
                    "forward": "fused decoder (Llama/Qwen, fp32 or on CUDA bf16/fp16: faster than transformers', docs/performance.md)",
                    "decode": "eager (fused decoder (Llama/Qwen) over a static KV cache; the host looks every 16 steps)",
                },
            },
        ),
        (
            {"fast_forward": "false", "padding_free": "false"},
            0.0,
            0.0,
            {
                "trainer": {
                    "forward": TRAINER_FORWARD,
                    "padding": "sequences are padded (--backend-opt padding_free=false)",
                    "optimizer": "torch's fused AdamW (float32 weights and moments)",
                },
                "sampler": {
                    "forward": "transformers (--backend-opt fast_forward=false)",
                    "decode": "eager (transformers' forward over a StaticCache; the host looks every 16 steps)",
                },
            },
        ),
    ],
    ids=["defaults", "both_off"],
)
def test_a_run_records_its_forward_path_and_padding_in_config_and_every_steps_metrics(
    tiny_model_dir, tiny_dataset, tmp_path, options, forward_path, padding_free, info
):
    import json

    from grpo_core.train import run
    from tests.core.tiny_runs import config, metrics_of

    run_dir = tmp_path / "run"
    run(config(tiny_model_dir, tiny_dataset, run_dir, max_steps=2, plugin_options={"backend": {"local": options}}))
    run_info = json.loads((run_dir / "config.json").read_text())["run_info"]
    # What the perf metrics are measured against (a probe's figure) is tested in test_loop.
    assert run_info["trainer"].pop("mfu_peak") and run_info["trainer"].pop("peak_memory")
    assert run_info == info
    assert [(m["perf/forward_path"], m["perf/padding_free"]) for m in metrics_of(run_dir)] == [(forward_path, padding_free)] * 2


def test_logprobs_and_entropies_reach_the_host_in_one_copy_with_their_gradients(monkeypatch):
    from grpo_core.engine import logprobs as engine_logprobs

    g = torch.Generator().manual_seed(0)
    weights = torch.randn(7, generator=g, requires_grad=True)
    logprobs = [weights[:n].cumsum(0) for n in (3, 7, 1)]
    entropy = [torch.rand(n, generator=g) for n in (3, 7, 1)]
    copies = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(tuple(self.shape)) or real_cpu(self, *a, **k))
    # The path a GPU's tensors take (here on the CPU: the copy is a no-op, the count is the point).
    host, host_entropy = engine_logprobs._gathered_on_host(logprobs, entropy)
    assert copies == [(2, 11)]  # logprobs and entropies of every datum at once
    assert [h.tolist() for h in host] == [lp.tolist() for lp in logprobs] and [e.tolist() for e in host_entropy] == [
        e.tolist() for e in entropy
    ]
    upstream = [torch.randn(len(h), generator=g) for h in host]
    (sum((h * u).sum() for h, u in zip(host, upstream))).backward()
    got = weights.grad.clone()
    weights.grad = None
    (sum((lp * u).sum() for lp, u in zip(logprobs, upstream))).backward()
    torch.testing.assert_close(got, weights.grad)
    # On a CPU nothing is copied at all, and nothing to copy is nothing.
    copies.clear()
    assert engine_logprobs.on_host(logprobs, None) == (logprobs, None) and engine_logprobs.on_host([], None) == ([], None)
    assert copies == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA GPU")
def test_a_cuda_training_call_waits_on_the_device_as_often_for_4_datums_as_for_16(tiny_model_dir):
    """Syncs counted by torch's sync debug mode: a per-datum copy (or a per-datum entropy read) would add 12."""
    import warnings

    from grpo_core.engine.models import load_model
    from grpo_core.engine.trainer import LocalTrainer
    from tests.engine.ragged_datums import datum

    cuda = torch.device("cuda")
    model, tokenizer = load_model(str(tiny_model_dir), cuda, "sdpa", dtype=torch.float32)
    trainer = LocalTrainer(model=model, tokenizer=tokenizer, device=cuda, padding_free=True)
    gen = torch.Generator().manual_seed(0)

    def syncs(n: int) -> int:
        datums = [datum(torch.randint(2, 290, (12,), generator=gen).tolist(), 2) for _ in range(n)]
        trainer.forward_backward_custom(datums, lambda d, lps: (-sum(lp.sum() for lp in lps), {}))  # warm-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer.forward_backward_custom(datums, lambda d, lps: (-sum(lp.sum() for lp in lps), {}))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    assert syncs(16) == syncs(4)
