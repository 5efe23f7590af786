from __future__ import annotations

import re
from contextlib import nullcontext

import pytest
import tinker
import torch

from grpo_core import Sample, SamplingParams
from grpo_core.backend import sample_to_datum
from grpo_core.config import RunConfig
from grpo_core.engine.forward import TransformersForward
from grpo_core.errors import PluginError
from grpo_core.plugins.backends.local import LocalBackend
from tests.plugins.backends.local_parts import make, prompts_of, to_samples


@pytest.mark.parametrize(("sampler_fast", "trainer_fast"), [(True, True), (False, False), (True, False), (False, True)])
def test_sampler_logprobs_equal_trainer_logprobs_at_temperature_1(tiny_model_dir, sampler_fast, trainer_fast):
    _, _, _, sampler = make(tiny_model_dir, sampler_fast)
    _, _, trainer, _ = make(tiny_model_dir, trainer_fast)
    prompts = prompts_of(trainer.tokenizer)
    # Every 8th token stops a completion: lengths come out ragged and finished rows leave the batch.
    params = SamplingParams(max_tokens=12, temperature=1.0, stop_token_ids=list(range(0, len(trainer.tokenizer), 8)))
    groups = sampler.sample(prompts, 4, params)
    assert [len(g) for g in groups] == [4, 4]
    samples = to_samples(prompts, groups)
    assert len({s.num_completion_tokens for s in samples}) > 1
    trainer_lps = trainer.forward([sample_to_datum(s) for s in samples])
    for s, lp in zip(samples, trainer_lps):
        n_prompt = len(s.tokens) - s.num_completion_tokens
        got = lp[n_prompt - 1 :]
        want = torch.tensor(s.sampling_logprobs[n_prompt:])
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_sampler_logprobs_follow_temperature_and_top_k(tiny_model_dir):
    _, _, trainer, sampler = make(tiny_model_dir)
    prompts = prompts_of(trainer.tokenizer)[:1]
    params = SamplingParams(max_tokens=6, temperature=0.5, top_k=3)
    completion = sampler.sample(prompts, 1, params)[0][0]
    tokens = prompts[0] + completion.tokens
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor([tokens])).logits[0].float() / 0.5
    for t, (tok, lp) in enumerate(zip(completion.tokens, completion.logprobs)):
        row = logits[len(prompts[0]) - 1 + t]
        top = torch.topk(row, 3)
        assert tok in top.indices.tolist()
        want = torch.log_softmax(top.values, -1)[top.indices.tolist().index(tok)]
        assert abs(float(want) - lp) < 1e-4


def test_sampling_is_repeatable_with_the_seed_and_stops_at_max_tokens(tiny_model_dir):
    a = make(tiny_model_dir, seed=3)[3].sample([[5, 6, 7]], 3, SamplingParams(max_tokens=5))
    b = make(tiny_model_dir, seed=3)[3].sample([[5, 6, 7]], 3, SamplingParams(max_tokens=5))
    assert [c.tokens for c in a[0]] == [c.tokens for c in b[0]]
    assert all(len(c.tokens) <= 5 for c in a[0])
    assert_finish_reasons(a[0], max_tokens=5, stop_ids={make(tiny_model_dir)[2].tokenizer.eos_token_id})


def assert_finish_reasons(completions, max_tokens, stop_ids):
    """ "stop" exactly when the last token is a stop token (and no earlier one is); otherwise
    "length", and then the completion is max_tokens long."""
    for c in completions:
        assert not stop_ids & set(c.tokens[:-1]), c.tokens
        if c.tokens[-1] in stop_ids:
            assert c.finish_reason == "stop", c
        else:
            assert c.finish_reason == "length" and len(c.tokens) == max_tokens, c


def test_finish_reason_is_stop_at_a_stop_token_and_length_at_max_tokens(tiny_model_dir):
    _, _, trainer, sampler = make(tiny_model_dir, seed=5)
    # A quarter of the vocabulary stops: both reasons occur among 16 completions of 6 tokens.
    stop_ids = set(range(0, len(trainer.tokenizer), 4))
    completions = sampler.sample([[5, 6, 7]], 16, SamplingParams(max_tokens=6, stop_token_ids=sorted(stop_ids)))[0]
    assert {c.finish_reason for c in completions} == {"stop", "length"}
    assert_finish_reasons(completions, max_tokens=6, stop_ids=stop_ids | {trainer.tokenizer.eos_token_id})


def test_stop_token_ends_the_completion_and_is_kept(tiny_model_dir):
    _, _, trainer, sampler = make(tiny_model_dir)
    # Every token id is a stop token: each completion is exactly one token, finished by "stop".
    params = SamplingParams(max_tokens=8, stop_token_ids=list(range(len(trainer.tokenizer))))
    groups = sampler.sample([[5, 6, 7], [8]], 3, params)
    assert all(len(c.tokens) == 1 and c.finish_reason == "stop" for g in groups for c in g)


def test_forward_backward_custom_matches_direct_autograd_in_one_forward_pass(tiny_model_dir):
    _, _, trainer, sampler = make(tiny_model_dir)
    assert type(trainer.forward_fn) is TransformersForward  # the fused decoder only samples
    prompts = prompts_of(trainer.tokenizer)
    samples = to_samples(prompts, sampler.sample(prompts, 2, SamplingParams(max_tokens=6)))
    datums = [sample_to_datum(s) for s in samples]
    weights = torch.linspace(-1.0, 1.0, len(samples))

    def loss_fn(_datums, logprobs):
        masks = [torch.tensor(s.loss_mask[1:]) for s in samples]
        loss = sum(w * (lp * m).sum() for w, lp, m in zip(weights, logprobs, masks)) / len(samples)
        return loss, {"custom": 1.0}

    processed = []
    forward = trainer.forward_fn

    class CountingForward:
        def __getattr__(self, name):
            return getattr(forward, name)

        def hidden_states(self, input_ids, attention_mask=None, **kwargs):
            new = input_ids.shape[1]
            processed.append(input_ids.numel() if attention_mask is None else int(attention_mask[:, -new:].sum()))
            return forward.hidden_states(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    trainer.forward_fn = CountingForward()
    out = trainer.forward_backward_custom(datums, loss_fn)
    trainer.forward_fn = forward
    # One pass: every token goes through the model at most once (a group's shared prompt once
    # for the whole group), however many model calls that takes.
    prompt_tokens = sum(len(p) - 1 for p in prompts)
    completion_tokens = sum(len(d.model_input.to_ints()) for d in datums) - sum(2 * (len(p) - 1) for p in prompts)
    assert sum(processed) == prompt_tokens + completion_tokens
    assert isinstance(out, tinker.ForwardBackwardOutput)
    assert out.metrics["custom"] == 1.0
    got = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.model.zero_grad(set_to_none=True)

    # Direct autograd: each sequence alone, full logits, no batching or padding.
    total = 0.0
    for w, s in zip(weights, samples):
        ids = torch.tensor([s.tokens])
        logp = trainer.model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
        lp = logp.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
        total = total + w * (lp * torch.tensor(s.loss_mask[1:])).sum() / len(samples)
    total.backward()
    for name, p in trainer.model.named_parameters():
        assert torch.allclose(got[name], p.grad, atol=1e-5, rtol=1e-4), name


def test_optim_step_applies_adam_params_and_counts_versions(tiny_model_dir, tmp_path):
    _, _, trainer, sampler = make(tiny_model_dir)
    datum = sample_to_datum(
        Sample(
            prompt=None,
            tokens=[5, 6, 7, 8],
            sampling_logprobs=[0.0] * 4,
            loss_mask=[0, 0, 1, 1],
            text="",
            finish_reason="stop",
            policy_version=0,
        )
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.forward_backward_custom([datum], lambda d, lps: (-lps[0].sum(), {}))
    metrics = trainer.optim_step(tinker.AdamParams(learning_rate=1e-2, grad_clip_norm=0.5))
    assert trainer.version == 1 and sampler.version == 0
    assert metrics["optim/lr"] == 1e-2 and metrics["optim/grad_norm"] > 0
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert all(p.grad is None for p in trainer.model.parameters())

    trainer.save_state(str(tmp_path / "state.pt"))
    saved = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.forward_backward_custom([datum], lambda d, lps: (-lps[0].sum(), {}))
    trainer.optim_step(tinker.AdamParams(learning_rate=1e-2))
    trainer.load_state(str(tmp_path / "state.pt"))
    assert trainer.version == 1
    assert all(torch.equal(saved[n], p) for n, p in trainer.model.named_parameters())


def test_separate_sampler_weights_follow_weight_sync(tiny_model_dir):
    from grpo_core.plugins.weight_sync.in_process import InProcessWeightSync

    _, _, trainer, sampler = make(tiny_model_dir, weight_sync_interval=2)
    assert sampler.model is not trainer.model
    with torch.no_grad():
        next(trainer.model.parameters()).add_(1.0)
    trainer.version = 1
    assert not torch.equal(next(trainer.model.parameters()), next(sampler.model.parameters()))
    assert InProcessWeightSync().weight_sync(trainer=trainer, sampler=sampler, step=1) == 1
    assert torch.equal(next(trainer.model.parameters()), next(sampler.model.parameters()))


def test_saved_policy_loads_with_transformers(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    _, _, trainer, _ = make(tiny_model_dir)
    path = trainer.save_weights_for_sampler(str(tmp_path / "final"))
    loaded = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([[5, 6, 7]])
    assert torch.allclose(loaded(ids).logits, trainer.model(ids).logits, atol=1e-6)


def test_stop_strings_end_completions_and_are_reported_as_stop(tiny_model_dir):
    _, _, trainer, sampler = make(tiny_model_dir)
    tok = trainer.tokenizer
    from collections import Counter

    # Stop on the character the random model emits most often, so some completions hit it.
    free = sampler.sample([[5, 6, 7]], 16, SamplingParams(max_tokens=10))[0]
    stop = Counter("".join(tok.decode(c.tokens) for c in free).replace(" ", "")).most_common(1)[0][0]
    stopped = sampler.sample([[5, 6, 7]], 16, SamplingParams(max_tokens=10, stop=[stop]))[0]
    hits = [c for c in stopped if stop in tok.decode(c.tokens)]
    assert hits
    for c in hits:
        assert c.finish_reason == "stop"
        assert stop not in tok.decode(c.tokens[:-1])  # it ended at the token that completed the stop string


# --- the optimizer: every AdamW setting and gradient clipping, against a hand-computed update ---


def adam_datum():
    return sample_to_datum(
        Sample(prompt=None, tokens=[5, 6, 7, 8, 9, 10], sampling_logprobs=[0.0] * 6, loss_mask=[0, 0, 1, 1, 1, 1],
               text="", finish_reason="stop", policy_version=0)
    )  # fmt: skip


def hand_adamw(param, grad, state, step, p: tinker.AdamParams):
    """One AdamW step in float64 (decoupled weight decay, bias-corrected moments), as written
    by Loshchilov & Hutter (arXiv:1711.05101) and Kingma & Ba (arXiv:1412.6980)."""
    m, v = state.get("m", torch.zeros_like(param)), state.get("v", torch.zeros_like(param))
    m = p.beta1 * m + (1 - p.beta1) * grad
    v = p.beta2 * v + (1 - p.beta2) * grad**2
    state.update(m=m, v=v)
    m_hat, v_hat = m / (1 - p.beta1**step), v / (1 - p.beta2**step)
    return param * (1 - p.learning_rate * p.weight_decay) - p.learning_rate * m_hat / (v_hat.sqrt() + p.eps)


def two_adam_steps(trainer, params: tinker.AdamParams, reference: tinker.AdamParams):
    """Two optimizer steps (beta1/beta2 only matter from the second); returns the largest error
    against the hand-computed update with ``params`` and the largest gap to the one with
    ``reference`` settings."""
    states: tuple[dict, dict] = ({}, {})
    error = gap = 0.0
    for step in (1, 2):
        trainer.forward_backward_custom([adam_datum()], lambda d, lps: (-lps[0].sum(), {}))
        named = list(trainer.model.named_parameters())
        before = {n: p.detach().double().clone() for n, p in named}
        grads = {n: p.grad.double().clone() if p.grad is not None else torch.zeros_like(before[n]) for n, p in named}
        trainer.optim_step(params)
        for n, p in named:
            want = hand_adamw(before[n], grads[n], states[0].setdefault(n, {}), step, params)
            other = hand_adamw(before[n], grads[n], states[1].setdefault(n, {}), step, reference)
            error = max(error, float((p.detach().double() - want).abs().max()))
            gap = max(gap, float((want - other).abs().max()))
    return error, gap


DEFAULT_ADAM = dict(learning_rate=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)


@pytest.mark.parametrize(
    "setting",
    [{}, {"beta1": 0.5}, {"beta2": 0.7}, {"eps": 1e-2}, {"weight_decay": 0.5}],
    ids=["defaults", "beta1", "beta2", "eps", "weight_decay"],
)
def test_optim_step_applies_every_adamw_setting(tiny_model_dir, setting):
    _, _, trainer, _ = make(tiny_model_dir)
    error, gap = two_adam_steps(trainer, tinker.AdamParams(**{**DEFAULT_ADAM, **setting}), tinker.AdamParams(**DEFAULT_ADAM))
    assert error < 1e-6
    if setting:  # the setting changes the update far beyond float32 rounding: ignoring it fails
        assert gap > 1e-4


@pytest.mark.parametrize("clip_over_norm", [0.1, 0.0, 10.0], ids=["clipped", "off", "not_binding"])
def test_grad_clip_norm_rescales_the_gradient_to_the_limit(tiny_model_dir, clip_over_norm):
    _, _, trainer, _ = make(tiny_model_dir)
    trainer.forward_backward_custom([adam_datum()], lambda d, lps: (-lps[0].sum(), {}))
    named = list(trainer.model.named_parameters())
    grads = {n: p.grad.double().clone() for n, p in named if p.grad is not None}
    norm = float(torch.sqrt(sum((g**2).sum() for g in grads.values())))
    before = {n: p.detach().double().clone() for n, p in named}
    # eps = 1 makes Adam's first step ≈ lr·g, so the gradient's scale shows in the update.
    params = tinker.AdamParams(**{**DEFAULT_ADAM, "eps": 1.0, "grad_clip_norm": clip_over_norm * norm})
    metrics = trainer.optim_step(params)
    assert metrics["optim/grad_norm"] == pytest.approx(norm, rel=1e-5)  # reported before clipping
    # torch's clip: g · min(1, limit / (‖g‖ + 1e-6))
    scale = min(1.0, clip_over_norm * norm / (norm + 1e-6)) if clip_over_norm > 0 else 1.0
    for n, p in named:
        want = hand_adamw(before[n], grads.get(n, torch.zeros_like(before[n])) * scale, {}, 1, params)
        assert torch.allclose(p.detach().double(), want, atol=1e-7, rtol=0), n
    if clip_over_norm == 0.1:  # the unclipped update is far from the clipped one: not clipping fails
        n = max(grads, key=lambda k: float(grads[k].abs().max()))
        gap = hand_adamw(before[n], grads[n], {}, 1, params) - hand_adamw(before[n], grads[n] * scale, {}, 1, params)
        assert float(gap.abs().max()) > 1e-4


# --- whole rows (distinct prompts, G = 1), packed or padded, against direct autograd --------------


@pytest.mark.parametrize(("padding_free", "path"), [(True, "_logprobs_packed"), (False, "_logprobs_one_pass")])
def test_one_pass_logprobs_and_gradients_match_direct_autograd(tiny_model_dir, monkeypatch, padding_free, path):
    from grpo_core.engine import logprobs as engine_logprobs

    paths = []
    for name in ("_logprobs_one_pass", "_logprobs_shared_prefix", "_logprobs_packed"):
        original = getattr(engine_logprobs, name)
        monkeypatch.setattr(engine_logprobs, name, lambda *a, _f=original, _n=name, **k: paths.append(_n) or _f(*a, **k))
    _, _, trainer, sampler = make(tiny_model_dir, padding_free=padding_free)
    tok = trainer.tokenizer
    prompts = [tok("Question: what is 3 plus 4?\nAnswer:")["input_ids"], tok("what is 1?")["input_ids"], tok("12 plus 9")["input_ids"]]
    samples = to_samples(prompts, sampler.sample(prompts, 1, SamplingParams(max_tokens=6)))  # G = 1: no shared prefix
    samples[2].loss_mask[-2] = 0.0  # a gap inside a completion (e.g. a tool's output)
    datums = [sample_to_datum(s) for s in samples]
    weights = torch.tensor([0.7, -1.3, 2.0])
    masks = [torch.tensor(s.loss_mask[1:]) for s in samples]

    out = trainer.forward_backward_custom(datums, lambda d, lps: (sum(w * (lp * m).sum() for w, lp, m in zip(weights, lps, masks)), {}))
    assert paths == [path]
    got = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.model.zero_grad(set_to_none=True)

    total = 0.0
    for w, s, m, returned in zip(weights, samples, masks, out.loss_fn_outputs):
        ids = torch.tensor([s.tokens])
        lp = trainer.model(input_ids=ids).logits[0, :-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        trained = m > 0
        # The logprobs the loss saw are those of the right tokens at the right positions.
        assert torch.allclose(returned["logprobs"].to_torch()[trained], lp.detach()[trained], atol=1e-5)
        total = total + w * (lp * m).sum()
    total.backward()
    for name, p in trainer.model.named_parameters():
        assert torch.allclose(got[name], p.grad, atol=1e-5, rtol=1e-4), name


# --- chunked token logprobs ---------------------------------------------------------------------


@pytest.mark.parametrize("chunk_rows", [1, 3, 1000])
def test_chunked_logprobs_and_gradients_equal_the_full_log_softmax(tiny_model_dir, chunk_rows, monkeypatch):
    from grpo_core.engine import fused_logprobs
    from grpo_core.engine.logprobs import token_logprobs

    _, _, trainer, _ = make(tiny_model_dir)
    vocab = trainer.model.config.vocab_size
    monkeypatch.setattr(fused_logprobs, "CPU_CHUNK_BYTES", 4 * vocab * chunk_rows)
    heads = []
    original_logits = fused_logprobs._logits
    monkeypatch.setattr(fused_logprobs, "_logits", lambda h, *a: heads.append(len(range(h.shape[0])[a[-1]])) or original_logits(h, *a))
    torch.manual_seed(0)
    hidden_N_E = torch.randn(7, trainer.model.config.hidden_size, requires_grad=True)
    targets_N = torch.randint(vocab, (7,))

    got, entropy = token_logprobs(trainer.forward_fn, hidden_N_E, targets_N)
    assert entropy is None  # not asked for
    assert max(heads) == min(chunk_rows, 7)  # never more than one chunk of logits at once
    got.sum().backward()
    got_grads = [hidden_N_E.grad.clone(), trainer.model.lm_head.weight.grad.clone()]
    hidden_N_E.grad, trainer.model.lm_head.weight.grad = None, None

    want = trainer.model.lm_head(hidden_N_E).float().log_softmax(-1).gather(-1, targets_N[:, None])[:, 0]
    want.sum().backward()
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-6)
    assert torch.allclose(got_grads[0], hidden_N_E.grad, atol=1e-6)
    assert torch.allclose(got_grads[1], trainer.model.lm_head.weight.grad, atol=1e-6)


def test_chunked_logprobs_keep_no_full_vocabulary_tensor_for_backward(tiny_model_dir, monkeypatch):
    from grpo_core.engine import fused_logprobs
    from grpo_core.engine.logprobs import token_logprobs

    _, _, trainer, _ = make(tiny_model_dir)
    vocab = trainer.model.config.vocab_size
    monkeypatch.setattr(fused_logprobs, "CPU_CHUNK_BYTES", 4 * vocab * 2)
    saved = []
    hidden_N_E = torch.randn(16, trainer.model.config.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        token_logprobs(trainer.forward_fn, hidden_N_E, torch.randint(vocab, (16,)), entropy=True)
    assert saved, "nothing saved for backward: the test sees no graph"
    # The output layer's weight is saved as itself (no copy); nothing else of the vocabulary's size.
    weight = trainer.model.lm_head.weight
    assert all(vocab not in t.shape for t in saved if t is not weight), [t.shape for t in saved]


def test_chunked_logprobs_of_no_positions_are_empty(tiny_model_dir):
    from grpo_core.engine.logprobs import token_logprobs

    _, _, trainer, _ = make(tiny_model_dir)
    got, entropy = token_logprobs(
        trainer.forward_fn, torch.zeros(0, trainer.model.config.hidden_size), torch.zeros(0, dtype=torch.long), entropy=True
    )
    assert got.shape == entropy.shape == (0,) and got.dtype == torch.float32


# --- precision ----------------------------------------------------------------------------------


def test_precision_auto_is_float32_on_cpu_and_each_choice_says_why():
    from grpo_core.engine.models import resolve_precision

    device, dtype, why = resolve_precision("cpu", "auto")
    assert (device.type, dtype) == ("cpu", torch.float32)
    assert why == (
        "float32 (exact: a resumed run repeats the uninterrupted one bit for bit); "
        "--dtype auto on cpu, so that a result does not depend on which CPU ran it"
    )
    assert resolve_precision("cpu", "float32")[2].endswith("; --dtype float32 on cpu")
    assert resolve_precision("cpu", "bfloat16")[1] == torch.bfloat16
    assert "stochastic rounding" in resolve_precision("cpu", "bfloat16")[2]
    if not torch.cuda.is_available():
        with pytest.raises(Exception, match="no CUDA device"):
            resolve_precision("cuda", "auto")


@pytest.mark.parametrize("reference_place", ["memory", "offload"])
def test_bfloat16_holds_weights_reference_and_sampler_in_bf16_and_trains(tiny_model_dir, capsys, reference_place):
    from grpo_core.engine.optim import StochasticRoundingAdamW

    cfg, _, trainer, sampler = make(tiny_model_dir, dtype="bfloat16")
    assert "precision: bfloat16 weights" in capsys.readouterr().err
    reference = LocalBackend(reference=reference_place).make_reference(config=cfg, trainer=trainer)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in reference.model.parameters()} == {torch.bfloat16}
    assert type(trainer.forward_fn) is TransformersForward  # the fused decoder is float32-only
    prompts = prompts_of(trainer.tokenizer)
    samples = to_samples(prompts, sampler.sample(prompts, 2, SamplingParams(max_tokens=6, temperature=1.0)))
    datums = [sample_to_datum(s) for s in samples]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    out = trainer.forward_backward_custom(datums, lambda d, lps: (-sum(lp.sum() for lp in lps), {}))
    for s, returned in zip(samples, out.loss_fn_outputs):
        n_prompt = len(s.tokens) - s.num_completion_tokens
        got = returned["logprobs"].to_torch()[n_prompt - 1 :]
        assert got.dtype == torch.float32
        # Sampler and trainer run the same bf16 forward: they agree to bf16 rounding.
        assert torch.allclose(got, torch.tensor(s.sampling_logprobs[n_prompt:]), atol=0.1)
    trainer.optim_step(tinker.AdamParams(learning_rate=1e-3))
    assert isinstance(trainer.optimizer, StochasticRoundingAdamW)
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    with reference.offloaded.loaded() if reference.offloaded else nullcontext():
        assert all(torch.equal(before[n], p) for n, p in reference.model.named_parameters())


def test_float32_keeps_torchs_fused_adamw(tiny_model_dir):
    _, _, trainer, _ = make(tiny_model_dir, dtype="float32")
    trainer.model.lm_head.weight.grad = torch.zeros_like(trainer.model.lm_head.weight)
    trainer.optim_step(tinker.AdamParams(learning_rate=1e-3))
    assert type(trainer.optimizer) is torch.optim.AdamW and trainer.optimizer.defaults["fused"]


# --- activation checkpointing -------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_with_dropout_dir(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("dropout_model")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attention_dropout=0.5)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


def test_gradient_checkpointing_recomputes_layers_with_equal_gradients_and_no_dropout(model_with_dropout_dir):
    _, _, plain, sampler = make(model_with_dropout_dir, fast_forward=False)
    _, _, checkpointed, _ = make(model_with_dropout_dir, gradient_checkpointing=True)
    assert not plain.model.is_activation_checkpointing
    assert checkpointed.model.is_activation_checkpointing
    assert all(layer.self_attn.attention_dropout == 0.0 for layer in checkpointed.model.model.layers)
    prompts = prompts_of(plain.tokenizer)
    datums = [sample_to_datum(s) for s in to_samples(prompts, sampler.sample(prompts, 2, SamplingParams(max_tokens=6)))]
    layer_calls = []
    for label, trainer in enumerate((plain, checkpointed)):
        mlp = trainer.model.model.layers[0].mlp
        mlp.forward = lambda *a, _f=mlp.forward, _label=label, **k: layer_calls.append(_label) or _f(*a, **k)

    def loss_fn(ds, lps):
        return sum((i + 1) * (lp * torch.tensor(d.loss_fn_inputs["weights"].data)).sum() for i, (d, lp) in enumerate(zip(ds, lps))), {}

    outs = [t.forward_backward_custom(datums, loss_fn) for t in (plain, checkpointed)]
    # The checkpointed layer runs again in backward (one pass + recompute); the plain one once for
    # the shared prefix and once for the suffixes.
    assert layer_calls.count(1) == 2 and layer_calls.count(0) == 2
    for d, a, b in zip(datums, *[o.loss_fn_outputs for o in outs]):
        trained = torch.tensor(d.loss_fn_inputs["weights"].data) > 0
        assert torch.allclose(a["logprobs"].to_torch()[trained], b["logprobs"].to_torch()[trained], atol=1e-5)
    for (name, p), q in zip(plain.model.named_parameters(), checkpointed.model.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), name
    assert not checkpointed.model.training  # train mode only inside the call
    again = checkpointed.forward_backward_custom(datums, loss_fn)
    for a, b in zip(outs[1].loss_fn_outputs, again.loss_fn_outputs):
        assert torch.equal(a["logprobs"].to_torch(), b["logprobs"].to_torch())  # no dropout in train mode


def test_gradient_checkpointing_is_refused_by_the_tinker_trainer():
    from grpo_core.errors import PluginError
    from grpo_core.plugins.backends.tinker import TinkerBackend

    with pytest.raises(PluginError, match="--gradient-checkpointing applies to the local trainer only"):
        TinkerBackend().make_trainer(config=RunConfig(gradient_checkpointing=True))


# --- what is written: weights in the model's dtype, sharded; optimizer state apart ---------------


def train_one_step(trainer, sampler):
    prompts = prompts_of(trainer.tokenizer)
    samples = to_samples(prompts, sampler.sample(prompts, 2, SamplingParams(max_tokens=6, temperature=1.0)))
    datums = [sample_to_datum(s) for s in samples]
    trainer.forward_backward_custom(datums, lambda d, lps: (-sum(lp.sum() for lp in lps), {}))
    trainer.optim_step(tinker.AdamParams(learning_rate=1e-3))
    return datums


MOMENT_DTYPES = {"fp32": {"F32"}, "bf16": {"BF16"}, "8bit": {"I8", "U8", "F32"}}


@pytest.mark.parametrize("optimizer_state", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_state_is_sharded_safetensors_in_the_models_dtype_and_resumes_exactly(
    tiny_model_dir, tmp_path, dtype, optimizer_state, monkeypatch
):
    from safetensors import safe_open

    from grpo_core.engine import trainer as engine_trainer

    # save_state looks SHARD_SIZE up in engine/trainer.py
    monkeypatch.setattr(engine_trainer, "SHARD_SIZE", "40KB")
    _, _, trainer, sampler = make(tiny_model_dir, dtype=dtype, optimizer_state=optimizer_state)
    datums = train_one_step(trainer, sampler)
    trainer.save_state(str(tmp_path / "trainer"))
    files = sorted(p.name for p in (tmp_path / "trainer").iterdir())
    shards = [f for f in files if f.startswith("model") and f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files
    # The moments: many shards in the form they are kept in, no pickle.
    optimizer_shards = [f for f in files if f.startswith("optimizer") and f.endswith(".safetensors")]
    assert len(optimizer_shards) > 1 and {"trainer.json", "optimizer.json", "optimizer.safetensors.index.json"} <= set(files)
    assert "optimizer.pt" not in files
    kept = set()
    for shard in optimizer_shards:
        with safe_open(tmp_path / "trainer" / shard, "pt") as f:
            kept |= {f.get_slice(k).get_dtype() for k in f.keys() if k.endswith(("exp_avg", "exp_avg_sq", "absmax"))}
    assert kept == MOMENT_DTYPES[optimizer_state]
    for shard in shards:
        with safe_open(tmp_path / "trainer" / shard, "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16" if dtype == "bfloat16" else "F32"}
    saved = engine_trainer.read_trainer_state(tmp_path / "trainer")
    assert saved["version"] == 1
    assert torch.equal(saved["model"]["lm_head.weight"], saved["model"]["model.embed_tokens.weight"])
    stored = [k for shard in shards for k in safe_open(tmp_path / "trainer" / shard, "pt").keys()]
    assert "model.embed_tokens.weight" in stored and "lm_head.weight" not in stored  # tied: stored once

    def loss(d, lps):
        return -sum(lp.sum() for lp in lps), {}

    trainer.forward_backward_custom(datums, loss)
    trainer.optim_step(tinker.AdamParams(learning_rate=1e-3))
    _, _, resumed, _ = make(tiny_model_dir, dtype=dtype, seed=0, optimizer_state=optimizer_state)
    resumed.load_state(str(tmp_path / "trainer"))
    assert resumed.model.lm_head.weight is resumed.model.model.embed_tokens.weight
    resumed.forward_backward_custom(datums, loss)
    resumed.optim_step(tinker.AdamParams(learning_rate=1e-3))
    # Bitwise in both: bf16's stochastic rounding is seeded by (seed, step, parameter).
    for (name, p), q in zip(trainer.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name


def test_policy_for_the_sampler_is_written_in_bf16_for_a_bf16_model(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    _, _, trainer, _ = make(tiny_model_dir, dtype="bfloat16")
    trainer.save_weights_for_sampler(str(tmp_path / "policy"))
    weights = {k: v for f in (tmp_path / "policy").glob("*.safetensors") for k, v in load_file(f).items()}
    assert weights and {v.dtype for v in weights.values()} == {torch.bfloat16}


def test_one_finiteness_check_finds_a_single_bad_weight(tiny_model_dir):
    _, _, trainer, _ = make(tiny_model_dir)
    assert trainer.weights_finite()
    with torch.no_grad():
        trainer.model.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
    assert not trainer.weights_finite()
    with torch.no_grad():
        trainer.model.model.layers[1].mlp.down_proj.weight[3, 5] = float("-inf")
    assert not trainer.weights_finite()


# --- the forward path ---------------------------------------------------------------------------


def test_the_transformers_forward_passes_no_deprecated_argument(tiny_model_dir, recwarn):
    import warnings

    _, _, trainer, sampler = make(tiny_model_dir, fast_forward=False)
    prompts = prompts_of(trainer.tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        # Sampling and the shared-prefix scoring both hand transformers a cache.
        samples = to_samples(prompts, sampler.sample(prompts, 2, SamplingParams(max_tokens=4)))
        trainer.forward([sample_to_datum(s) for s in samples])


def test_the_forward_path_and_its_reason_are_said_at_start(tiny_model_dir, capsys):
    make(tiny_model_dir)
    err = capsys.readouterr().err
    assert "trainer forward: transformers (faster than the fused decoder with gradients" in err
    assert "sampler forward: fused decoder" in err
    make(tiny_model_dir, fast_forward=False)
    assert "sampler forward: transformers (--backend-opt fast_forward=false)" in capsys.readouterr().err
    make(tiny_model_dir, dtype="bfloat16")
    assert (
        "sampler forward: transformers (the fused decoder does not run weights that are not float32 (bfloat16 and float16 run on CUDA))"
        in capsys.readouterr().err
    )


def test_the_start_lines_say_whether_the_trainer_checkpoints_and_why(tiny_model_dir, capsys):
    _, _, auto, _ = make(tiny_model_dir)
    assert "gradient checkpointing: off (default on cpu: a CPU run is small" in capsys.readouterr().err
    assert not auto.activation_checkpointing and not auto.model.is_activation_checkpointing
    _, _, given, _ = make(tiny_model_dir, gradient_checkpointing=True)
    assert "gradient checkpointing: on (--gradient-checkpointing)" in capsys.readouterr().err
    assert given.activation_checkpointing and given.model.is_activation_checkpointing


def test_a_checkpoint_with_the_optimizer_state_in_one_pickle_still_loads(tiny_model_dir, tmp_path):
    # Checkpoints written before the sharded layout hold optimizer.pt: they resume as before.
    _, _, trainer, sampler = make(tiny_model_dir)
    datums = train_one_step(trainer, sampler)
    trainer.save_state(str(tmp_path / "trainer"))
    folder = tmp_path / "trainer"
    for f in [*folder.glob("optimizer*")]:
        f.unlink()
    torch.save(trainer.optimizer.state_dict(), folder / "optimizer.pt")

    def loss(d, lps):
        return -sum(lp.sum() for lp in lps), {}

    _, _, resumed, _ = make(tiny_model_dir, seed=0)
    resumed.load_state(str(folder))
    for t in (trainer, resumed):
        t.forward_backward_custom(datums, loss)
        t.optim_step(tinker.AdamParams(learning_rate=1e-3))
    for (name, p), q in zip(trainer.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name


def test_optimizer_state_is_stated_and_offload_is_refused_on_a_cpu(tiny_model_dir, capsys):
    make(tiny_model_dir, dtype="bfloat16", optimizer_state="8bit")
    err = capsys.readouterr().err
    assert "optimizer state: 8bit moments: 6.03125 B per trained parameter on the cpu (weights 2 + gradients 2 + moments 2.03125)" in err
    assert re.search(r"memory plan: peak [\d.]+ GB in .*weights [\d.]+, moments", err), err
    with pytest.raises(PluginError, match="--optimizer-state offload streams Adam's moments from host memory to a GPU; on cpu"):
        make(tiny_model_dir, optimizer_state="offload")


def test_a_run_that_cannot_fit_is_refused_before_loading_naming_what_would_fit(tiny_model_dir, monkeypatch):
    from grpo_core.engine import memory_plan
    from grpo_core.plugins.backends import local

    monkeypatch.setattr(memory_plan, "free_memory", lambda device: 1000)
    real_load = local.load_model
    monkeypatch.setattr(local, "load_model", lambda *a, **k: pytest.fail("loaded a model that cannot fit"))
    with pytest.raises(PluginError) as refused:
        make(tiny_model_dir, optimizer_state="fp32")
    said = str(refused.value)
    assert re.search(r"memory plan: peak [\d.]+ GB .*: cpu has 0.00 GB free\. To fit, try --lora-rank 16", said), said
    assert "--optimizer-state bf16/8bit" in said and "--dtype bfloat16" in said and "--gradient-checkpointing" in said
    assert said.endswith("--no-memory-check runs it anyway")
    monkeypatch.setattr(local, "load_model", real_load)
    make(tiny_model_dir, memory_check=False)  # the override


@pytest.fixture
def length_reward(monkeypatch):
    """tests/core/test_resume.py's test plugins (its ``length`` reward), as its autouse fixture adds them."""
    from tests.core import test_resume

    test_resume.test_plugins.__wrapped__(monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize(("optimizer_state", "dtype"), [("bf16", "float32"), ("8bit", "float32"), ("8bit", "bfloat16")])
def test_a_run_with_reduced_moments_resumes_bitwise(tiny_model_dir, tiny_dataset, tmp_path, optimizer_state, dtype, length_reward):
    from grpo_core.train import run
    from tests.core.test_resume import assert_same_run, config

    settings = {"optimizer_state": optimizer_state, "dtype": dtype, "max_steps": 4}
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run(config(tiny_model_dir, tiny_dataset, whole, **settings))
    run(config(tiny_model_dir, tiny_dataset, resumed, **{**settings, "max_steps": 2}))
    assert run(config(tiny_model_dir, tiny_dataset, resumed, **settings), resume=True)["steps"] == 4
    assert_same_run(whole, resumed)


@pytest.mark.slow  # builds the compiled kernel
def test_optimizer_kernel_compiled_steps_bf16_weights_in_one_pass(tiny_model_dir, capsys, monkeypatch):
    from grpo_core.engine import optim
    from grpo_core.plugins.samplers.local import LocalSamplerPlugin

    cfg = RunConfig(model=str(tiny_model_dir), dtype="bfloat16")
    trainer = LocalBackend(optimizer_kernel="compiled").make_trainer(config=cfg)
    assert "optimizer kernel: compiled (one torch.compile'd pass over each bfloat16 tensor" in capsys.readouterr().err
    assert trainer.optimizer_kernel == "compiled"
    sampler = LocalSamplerPlugin().make_sampler(config=cfg, trainer=trainer)
    calls = []
    compiled = optim.compiled_one_pass_update()
    monkeypatch.setattr(optim, "compiled_one_pass_update", lambda: lambda *a: calls.append(a[0].numel()) or compiled(*a))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    train_one_step(trainer, sampler)
    assert trainer.optimizer.kernel == "compiled"
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    assert sorted(calls) == sorted(p.numel() for p in trained)  # every tensor, through the one kernel
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())


def test_optimizer_kernel_defaults_to_eager_on_a_cpu_and_refuses_compiled_float32_before_loading(tiny_model_dir, capsys, monkeypatch):
    from grpo_core.plugins.backends import local

    _, _, trainer, _ = make(tiny_model_dir, dtype="bfloat16")
    assert "optimizer kernel: eager (auto on cpu: building the compiled step takes seconds" in capsys.readouterr().err
    assert trainer.optimizer_kernel == "eager"
    assert trainer.run_info["optimizer"].startswith("eager (auto on cpu: building the compiled step takes seconds")
    _, _, trainer, _ = make(tiny_model_dir)
    assert "optimizer kernel: torch's fused AdamW (float32 weights and moments)" in capsys.readouterr().err
    monkeypatch.setattr(local, "load_model", lambda *a, **k: pytest.fail("loaded a model for a refused option"))
    with pytest.raises(PluginError, match="optimizer_kernel=compiled: the compiled step rounds bfloat16 weights, these are float32"):
        LocalBackend(optimizer_kernel="compiled").make_trainer(config=RunConfig(model=str(tiny_model_dir)))
    with pytest.raises(ValueError, match="'optimizer_kernel' must be in"):
        LocalBackend(optimizer_kernel="fast")


def test_compile_auto_says_off_and_why_at_start(tiny_model_dir, capsys):
    from grpo_core.plugins.backends.local import LocalBackend

    trainer = LocalBackend().make_trainer(config=RunConfig(model=str(tiny_model_dir)))
    assert trainer.compiled_layers is None
    said = "compile: off (auto: groups of 8 completions share their prompt and --gradient-checkpointing is off: every forward runs"
    assert said in capsys.readouterr().err
    trainer = LocalBackend().make_trainer(config=RunConfig(model=str(tiny_model_dir), gradient_checkpointing=True))
    assert trainer.compiled_layers is None
    assert "compile: off (auto: on a CPU compiling the layers takes tens of seconds" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--backend-opt", "compile=maybe"), "option 'compile' of backend.local: expected true or false, got 'maybe'"),
        (("--backend", "fsdp", "--backend-opt", "nproc=2", "--backend-opt", "compile=true"), "the fsdp backend runs its layers eagerly"),
    ],
    ids=["bad_value", "fsdp_true"],
)
def test_compile_refusals_name_the_option(args, message):
    from tests.helpers import grpo_core_in_process

    result = grpo_core_in_process("run", *args, "--max-steps", "1")
    assert result.returncode != 0
    assert message in result.stderr


def test_compile_true_that_would_compile_nothing_is_refused_before_loading(tiny_model_dir, monkeypatch, capsys):
    from grpo_core.plugins.backends import local

    real_load = local.load_model
    monkeypatch.setattr(local, "load_model", lambda *a, **k: pytest.fail("loaded a model for a refused option"))
    cached = RunConfig(model=str(tiny_model_dir), completions_per_prompt=4)
    said = r"compile=true would compile nothing: groups of 4 completions share their prompt and --gradient-checkpointing is off, "
    with pytest.raises(PluginError, match=said + ".*add --gradient-checkpointing"):
        LocalBackend(compile=True).make_trainer(config=cached)
    monkeypatch.setattr(local, "load_model", real_load)
    # Whole sequences in one pass with checkpointing: compiled.
    config = RunConfig(model=str(tiny_model_dir), completions_per_prompt=4, gradient_checkpointing=True)
    assert LocalBackend(compile=True).make_trainer(config=config).compiled_layers is not None
    assert "compile: on: each decoder layer compiled" in capsys.readouterr().err
