"""Shared pieces of the benchmark: models, prompts, the reward, FLOP counting, the matmul probe.

Imported by the orchestrator (``run.py``, ``sweep.py``) and by every contender's worker
script, including the TRL worker that runs in its own virtualenv: nothing here imports
grpo_core or trl.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"

# The two configurations of the issue. P = prompt tokens (every prompt has exactly P tokens),
# L = forced completion tokens (every completion has exactly L tokens).
CONFIGS: dict[str, dict[str, Any]] = {
    "overhead": {
        "model": {
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
        },
        "prompt_tokens": 16,
        "completion_tokens": 8,
        "prompts_per_step": 8,
        "group_size": 8,
        "timed_steps": 20,  # a step is ~0.2-0.5 s: 5 would leave the median to a shared machine's whims
    },
    "compute": {
        "model": {
            "hidden_size": 384,
            "intermediate_size": 1024,
            "num_hidden_layers": 6,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "head_dim": 64,
        },
        "prompt_tokens": 16,
        "completion_tokens": 32,
        "prompts_per_step": 8,
        "group_size": 8,
        "timed_steps": 5,
    },
    # Qwen3-0.6B's shape with its real 151,936-row vocabulary (596M parameters, 155.6M of them the
    # tied embedding), so the LM head and the [B, T, V] logits cost what they cost. ~8-12 GB per
    # fp32 contender: opt-in (``--config real``), not part of ``all``.
    "real": {
        "model": {
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
        },
        "vocab_size": 151936,
        "prompt_tokens": 16,
        "completion_tokens": 32,
        "prompts_per_step": 2,
        "group_size": 4,
        "timed_steps": 3,  # a step is ~40 s of CPU time on one thread
        "repeats": 1,  # 8 contenders x ~3 min each on an idle core, 10 on a loaded one
    },
}
LEARNING_RATE = 1e-5
SEED = 0
VOCAB = 512
"""Tokens the BPE trainer makes. A configuration's ``vocab_size`` (default VOCAB) is the number of
tokens the model can produce; the tokenizer has one more: eos, id ``vocab_size``, which no logit
exists for, so it is never sampled and every completion runs to the forced length."""


def vocab_size(name: str) -> int:
    return CONFIGS[name].get("vocab_size", VOCAB)


def _corpus() -> list[str]:
    lines = []
    for a in range(100):
        for b in range(0, 100, 3):
            lines.append(f"Question: what is {a} plus {b}?\nAnswer: {a} + {b} = {a + b}\n#### {a + b}")
            lines.append(f"Question: what is {a} times {b}?\nAnswer: {a} * {b} = {a * b}\n#### {a * b}")
            lines.append(f"Question: what is {a} minus {b}?\nAnswer: {a} - {b} = {a - b}\n#### {a - b}")
    return lines


def build_model(path: Path, name: str, seed: int = SEED) -> Path:
    """A random Qwen3 of the configuration ``name`` and a byte-level BPE tokenizer trained here.

    The tokenizer has V = ``vocab_size(name)`` ordinary ids (0 = ``<|pad|>``) plus
    ``<|endoftext|>`` at id V; the model's vocabulary is V, so eos is a real token that the
    tokenizer and every trainer know about but the model can never sample. Beyond the VOCAB
    trained tokens, the ids up to V are filler tokens (see ``_pad_vocab``).

    A model built earlier from the same configuration and seed is reused (``built.json`` records
    them): the real-size model is 2.4 GB, and another benchmark may be reading it.
    """
    recipe = {"model": CONFIGS[name]["model"], "vocab_size": vocab_size(name), "trained_vocab": VOCAB, "seed": seed}
    marker = path / "built.json"
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return path
    import torch
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    # eos sits outside the model's vocabulary on purpose: silence transformers' warning about it.
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        _corpus(),
        trainers.BpeTrainer(
            vocab_size=VOCAB, special_tokens=["<|pad|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        ),
    )
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"the BPE trainer made {tok.get_vocab_size()} tokens, not {VOCAB}")
    vocab = vocab_size(name)
    if vocab > VOCAB:
        tok = _pad_vocab(tok, vocab)
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    assert tokenizer.eos_token_id == vocab and tokenizer.pad_token_id == 0
    torch.manual_seed(seed)
    # A configuration's model table may set these two as well (the GPU shapes: Qwen3-8B's LM head is untied).
    shape = {"max_position_embeddings": 512, "tie_word_embeddings": True, **CONFIGS[name]["model"]}
    config = Qwen3Config(
        vocab_size=vocab,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **shape,
    )
    path.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    marker.write_text(json.dumps(recipe))
    return path


def _pad_vocab(tok: Any, size: int) -> Any:
    """``tok`` with ordinary tokens appended up to ``size`` ids.

    Each filler is three byte-level characters that no merge produces, so prompts encode exactly
    as before while every id the model samples still decodes (to three bytes, shown as U+FFFD
    where they are not UTF-8): a sampled id is never out of the tokenizer's range.
    """
    import itertools

    from tokenizers import Tokenizer, pre_tokenizers

    state = json.loads(tok.to_str())
    table = state["model"]["vocab"]
    fillers = ("".join(chars) for chars in itertools.product(sorted(pre_tokenizers.ByteLevel.alphabet()), repeat=3))
    next_id = len(table)
    for text in fillers:
        if next_id == size:
            break
        if text not in table:
            table[text] = next_id
            next_id += 1
    return Tokenizer.from_str(json.dumps(state))


def make_prompts(tokenizer: Any, num_tokens: int, count: int, seed: int = SEED) -> list[str]:
    """``count`` distinct-ish arithmetic prompts that each encode to exactly ``num_tokens`` tokens.

    "Question: what is n1 op n2 ... nk?\nAnswer:" is 2k+7 tokens with this tokenizer (every
    number below 100 and every word is one token); an extra newline makes even lengths.
    """
    import random

    rng = random.Random(seed)
    k, extra = divmod(num_tokens - 7, 2)
    if k < 1:
        raise ValueError(f"prompts need at least 9 tokens, not {num_tokens}")
    prompts = []
    for _ in range(count):
        terms = [str(rng.randrange(100))]
        for _ in range(k - 1):
            terms += [rng.choice(["plus", "minus", "times"]), str(rng.randrange(100))]
        text = f"Question: what is {' '.join(terms)}?\n{chr(10) * extra}Answer:"
        n = len(tokenizer(text)["input_ids"])
        if n != num_tokens:
            raise RuntimeError(f"prompt {text!r} has {n} tokens, not {num_tokens}")
        prompts.append(text)
    return prompts


def write_dataset(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"question": p, "answer": ""}) + "\n" for p in prompts))
    return path


def reward_of_text(text: str) -> float:
    """The benchmark's reward: cheap, deterministic and varied (a hash of the characters in [0, 1])."""
    return (sum(map(ord, text)) % 17) / 16.0


def param_counts_of(model_dir: Path) -> dict[str, int]:
    """``param_counts`` of the saved model, built on the meta device (no memory for weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return param_counts(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)))


def param_counts(model: Any) -> dict[str, int]:
    """All parameters (tied embedding counted once) and the non-embedding ones."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    return {"all": total, "non_embedding": total - embedding}


def model_flops(n_params: int, batch: int, prompt_tokens: int, completion_tokens: int) -> dict[str, float]:
    """Model FLOPs of one step.

    ``sample``/``train``: the issue's count, 2·N per generated token and 6·N per trained token
    (a completion token). ``*_all``: every token position the model is run on, the prompt's too:
    the sampler's prefill and the training forward/backward go over P + L − 1 positions.
    """
    positions = prompt_tokens + completion_tokens - 1
    return {
        "sample": 2.0 * n_params * batch * completion_tokens,
        "train": 6.0 * n_params * batch * completion_tokens,
        "sample_all": 2.0 * n_params * batch * positions,
        "train_all": 6.0 * n_params * batch * positions,
    }


def matmul_peak(n: int = 2048, repeats: int = 10) -> dict[str, float]:
    """This machine's fp32 matmul rate: best of ``repeats`` n×n×n products, in FLOP/s."""
    import torch

    a = torch.randn(n, n)
    b = torch.randn(n, n)
    c = torch.empty(n, n)
    for _ in range(2):
        torch.mm(a, b, out=c)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b, out=c)
        times.append(time.perf_counter() - t)
    flops = 2.0 * n**3
    return {"peak_flops": flops / min(times), "median_flops": flops / sorted(times)[len(times) // 2], "threads": torch.get_num_threads()}


def current_rss_mb() -> float:
    """Resident memory now (Linux /proc), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def load_spec(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def write_result(path: str, result: dict[str, Any]) -> None:
    result["peak_rss_mb"] = peak_rss_mb()
    result["pid"] = os.getpid()
    Path(path).write_text(json.dumps(result, indent=2))
