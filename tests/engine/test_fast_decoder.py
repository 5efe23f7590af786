from __future__ import annotations

import math

import pytest
import torch

from grpo_core.engine import fast_decoder
from grpo_core.engine.fast_decoder import FastDecoder, KVCache, unsupported_reason

VOCAB = 97


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            tie_word_embeddings=True,
        )
    )


def qwen2_with_biases():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=False,
        )
    )


def llama_linear_rope_and_mlp_bias():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
    )  # fmt: skip
    return LlamaForCausalLM(config)


MODELS = [qwen3, qwen2_with_biases, llama_linear_rope_and_mlp_bias]


@pytest.fixture(params=["matmul", "sdpa"])
def attention_path(request, monkeypatch):
    """Run a test through both attention paths: short blocks as plain matmuls, and (with the
    threshold at 0) scaled_dot_product_attention for everything."""
    if request.param == "sdpa":
        monkeypatch.setattr(fast_decoder, "SMALL_ATTENTION_SCORES", 0)
    return request.param


def build(make_model):
    torch.manual_seed(0)
    model = make_model().eval()
    # Random init leaves the norms at 1, biases at 0 and logits near 0: perturb everything so
    # that every parameter counts and a small error shows.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    assert unsupported_reason(model) is None
    return model


def left_padded(lengths, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, T - n :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("make_model", MODELS)
def test_logits_equal_transformers_with_left_padding(make_model, attention_path):
    model = build(make_model)
    ids, mask, positions = left_padded([7, 4, 1], 7)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    with torch.inference_mode():
        got = FastDecoder(model)(ids, positions, mask)

    valid = mask.bool()
    assert torch.allclose(got[valid], want[valid], atol=1e-5)
    # Padded positions are garbage but finite, so they cannot poison real ones through a cache.
    assert torch.isfinite(got).all()


def test_a_call_with_grad_enabled_is_refused():
    model = build(qwen3)
    decoder = FastDecoder(model)
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(5).expand(2, 5)
    for call in (lambda: decoder(ids, positions), decoder.layer_weights):
        with pytest.raises(RuntimeError, match="the fused decoder is inference-only"):
            call()
    with torch.no_grad():
        weights = decoder.layer_weights()
    # Weights built without grad do not let a grad-enabled call through either.
    with pytest.raises(RuntimeError, match="the fused decoder is inference-only"):
        decoder(ids, positions, weights=weights)


@pytest.mark.parametrize("make_model", MODELS)
@pytest.mark.parametrize("capacity", [9, 12])
def test_cached_decoding_equals_one_full_forward(make_model, capacity, attention_path):
    """Prefill, repeat each row's cache, drop a row, decode token by token: the logits are those
    of one forward over the whole sequences (capacity 9: the cache exactly full at the end)."""
    model = build(make_model)
    decoder = FastDecoder(model)
    prompt_ids, prompt_mask, prompt_positions = left_padded([5, 3], 5)
    new_ids = torch.randint(1, VOCAB, (4, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = decoder.new_cache(capacity)
        decoder(prompt_ids, prompt_positions, prompt_mask, cache, logits_to_keep=1)
        cache.batch_repeat_interleave(2)
        mask = prompt_mask.repeat_interleave(2, dim=0)
        positions = prompt_positions[:, -1:].repeat_interleave(2, dim=0)
        rows = torch.arange(4)
        steps = []
        for t in range(4):
            if t == 2:  # the second row finishes and leaves the batch
                keep = torch.tensor([0, 2, 3])
                cache.batch_select_indices(keep)
                mask, positions, rows = mask[keep], positions[keep], rows[keep]
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long)], dim=1)
            positions = positions + 1
            steps.append((rows, decoder(new_ids[rows, t : t + 1], positions, mask, cache)[:, -1]))

        full_ids = torch.cat([prompt_ids.repeat_interleave(2, dim=0), new_ids], dim=1)
        full_mask = torch.cat([prompt_mask.repeat_interleave(2, dim=0), torch.ones(4, 4, dtype=torch.long)], dim=1)
        full_positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
        want = model(input_ids=full_ids, attention_mask=full_mask, position_ids=full_positions).logits
    for t, (rows, logits) in enumerate(steps):
        assert torch.allclose(logits, want[rows, 5 + t], atol=1e-5), t


def test_unpadded_batches_need_no_mask(attention_path):
    model = build(qwen3)
    ids = torch.randint(1, VOCAB, (3, 6), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(6).expand(3, 6)
    decoder = FastDecoder(model)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        assert torch.allclose(decoder(ids, positions), want, atol=1e-5)
        cache = decoder.new_cache(6)
        decoder(ids[:, :4], positions[:, :4], None, cache)
        # Two new tokens on top of a cache, no mask: causal among themselves.
        assert torch.allclose(decoder(ids[:, 4:], positions[:, 4:], None, cache), want[:, 4:], atol=1e-5)


def test_static_cache_refuses_to_overflow():
    cache = KVCache(capacity=3)
    k = torch.zeros(1, 1, 2, 4)
    cache.update(0, k, k)
    with pytest.raises(ValueError, match="holds 3 positions; 4 asked for"):
        cache.update(0, k, k)


def test_unsupported_models_are_named_with_the_reason():
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

    model = build(qwen3)
    assert unsupported_reason(model) is None
    assert unsupported_reason(build(qwen3).to(torch.bfloat16)) == "weights that are not float32 (bfloat16 and float16 run on CUDA)"
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2))
    assert "model type 'gpt2'" in unsupported_reason(gpt2)
    windowed = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            use_sliding_window=True,
            sliding_window=4,
        )
    )
    assert unsupported_reason(windowed) == "sliding-window attention"
    assert unsupported_reason(model.to(torch.float64)) == "weights that are not float32 (bfloat16 and float16 run on CUDA)"


@pytest.mark.parametrize("make_model", [qwen3, qwen2_with_biases])
def test_a_step_at_a_slot_reads_only_its_masks_width_of_the_cache(make_model):
    """A decode step written at a slot attends to the cache's first ``mask width`` slots: the slots
    past them filled with NaN (which a masked read would turn into NaN logits, 0 x NaN) leave its
    logits those of the step over the whole, clean capacity (grouped and plain heads)."""
    model = build(make_model)
    decoder = FastDecoder(model)
    ids, mask, positions = left_padded([5, 3], 5)
    capacity, width = 16, 8
    token = torch.tensor([[7], [11]])
    logits = {}
    with torch.no_grad():
        for poisoned in (False, True):
            cache = decoder.new_cache(capacity)
            prompts = decoder.new_cache(5)
            decoder(ids, positions, mask, prompts, logits_to_keep=1)
            cache.fill_from(prompts, 1)
            if poisoned:
                for buffer in (*cache.keys, *cache.values):
                    buffer[:, :, width:] = math.nan
            valid = torch.zeros(2, capacity, dtype=torch.bool)
            valid[:, :5] = mask.bool()
            valid[:, 5] = True
            cache.slot_1 = torch.tensor([5])
            keys = capacity if not poisoned else width
            logits[poisoned] = decoder(token, positions[:, -1:] + 1, valid[:, None, None, :keys], cache, logits_to_keep=1)[:, -1]
            if poisoned:
                new_B_H_1_D = torch.zeros(2, cache.keys[0].shape[1], 1, cache.keys[0].shape[3])
                k, v = cache.update(0, new_B_H_1_D, new_B_H_1_D, width)
                assert k.shape[2] == v.shape[2] == width and k.data_ptr() == cache.keys[0].data_ptr()
    assert torch.isfinite(logits[True]).all()
    assert torch.allclose(logits[True], logits[False], atol=1e-6), (logits[True] - logits[False]).abs().max()
