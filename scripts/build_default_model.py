"""Build the embedded default model and task that ``grpo-core run`` uses with no arguments.

    python scripts/build_default_model.py [--out core/assets/default] [--seed 0]

Everything is made here from nothing (no hub downloads), from one seed, so the shipped
folder can be rebuilt bit for bit on one CPU thread in roughly 10-15 minutes (the
script prints the measured greedy and T=1 accuracies at the end; build_info.json keeps them).

Why the choices are what they are:

* Task: synthetic GSM8K look-alikes ("Tom has 3 apples. He buys 5 more. ...", answer
  "3 + 5 = 8\\n#### 8"). Same row format as GSM8K so the very same prompt/reward code
  (prompt ``"Question: " + q + "\\nAnswer:"``, reward = exact ``#### N``) serves both the
  default and the real data set. Four templates (add, subtract, multiply table, two-step)
  give arithmetic a tiny model can learn in minutes but not perfectly; answers stay in
  0..~100 so completions are ~20 tokens and RL steps are cheap. The test split is drawn
  after the train split from the same stream and excludes any question seen in train; a
  third "dev" draw (not shipped) is used for every build-time decision so the shipped test
  numbers are not tuned on.

* Tokenizer: byte-level BPE trained on the generated text (the corpus is tiny, so the
  vocab saturates at a few hundred tokens: every word is one token). Digits are
  pre-tokenized one by one so numbers are spelled digit by digit and arithmetic is
  learnable and a digit is never merged with its neighbours. Because of the digit split
  and the pre-tokenizer boundaries, tokenizing prompt and completion separately gives the
  same ids as tokenizing their concatenation (checked below), so RL code may do either.
  ``tokenizer_class`` is written as ``PreTrainedTokenizerFast`` so that transformers 4.x
  loads it as well as 5.x.

* Model: a ~0.84M-parameter Qwen3 (the architecture the project targets on real runs),
  fp32, tied embeddings, ~3.4 MB on disk. Big enough to learn the arithmetic in ~1200
  steps on one thread, small enough to ship in the wheel and to do RL on a laptop CPU.

* Calibration. GRPO needs reward variance inside each group: a model that is always right
  or always wrong at temperature 1 gives zero advantage. We want a model that "knows" the
  answer under greedy decoding (>= ~0.7) but samples it only ~25% of the time at T=1, so
  that RL visibly sharpens it within minutes. Rather than stopping training at a lucky
  step (noisy, and early checkpoints are simply wrong more often, which RL cannot fix
  quickly), we train to convergence of the schedule and then bake a temperature into the
  weights: the final RMSNorm weight is multiplied by ``logit_scale`` < 1, which scales all
  logits exactly by that factor (the embeddings are tied, so the norm is the only place to
  do it). Greedy decoding is unchanged; T=1 sampling behaves like sampling the trained
  model at T = 1/logit_scale. ``logit_scale`` is found by bisection so that dev-set T=1
  accuracy is ~0.25. The knowledge is already in the weights, so GRPO only has to sharpen
  the sampling distribution - exactly the behaviour the default run is meant to show. In a
  scratch check (8 prompts x 8 samples, AdamW lr 3e-4, grad clip 1) the mean train reward
  went from ~0.3 to ~0.65-0.7 in 100 steps, ~2 min on one thread. The model is small and
  sharp-edged: lr 1e-3 already made the reward drift down and 3e-3 collapsed it.

* Determinism: python/torch RNGs seeded from --seed, one torch thread, no dropout,
  sampling with an explicit torch.Generator.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "core" / "assets" / "default"

N_TRAIN, N_TEST, N_DEV = 5000, 500, 200
EOS, PAD = "<|endoftext|>", "<|pad|>"
TARGET_T1 = 0.25  # dev-set accuracy of T=1 sampling the calibration aims at

NAMES = [("Tom", "He"), ("Anna", "She"), ("Sam", "He"), ("Mia", "She"), ("Ben", "He"), ("Lily", "She")]
OBJECTS = ["apples", "pencils", "stickers", "marbles", "cookies", "books"]


# ----------------------------------------------------------------------------- task


def make_row(rng: random.Random) -> dict:
    name, pron = rng.choice(NAMES)
    obj = rng.choice(OBJECTS)
    kind = rng.choice(["add", "sub", "mul", "two"])
    if kind == "add":
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        q = f"{name} has {a} {obj}. {pron} buys {b} more. How many {obj} does {name} have now?"
        work, ans = f"{a} + {b} = {a + b}", a + b
    elif kind == "sub":
        a = rng.randint(10, 60)
        b = rng.randint(1, a - 1)
        q = f"{name} has {a} {obj}. {pron} gives {b} to a friend. How many {obj} does {name} have left?"
        work, ans = f"{a} - {b} = {a - b}", a - b
    elif kind == "mul":
        a, b = rng.randint(2, 10), rng.randint(2, 10)
        q = f"{name} has {a} boxes. Each box has {b} {obj}. How many {obj} does {name} have in total?"
        work, ans = f"{a} * {b} = {a * b}", a * b
    else:
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        s = a + b
        c = rng.randint(1, s - 1)
        q = f"{name} has {a} {obj}. {pron} buys {b} more and gives {c} to a friend. How many {obj} does {name} have left?"
        work, ans = f"{a} + {b} = {s}\n{s} - {c} = {s - c}", s - c
    return {"question": q, "answer": f"{work}\n#### {ans}"}


def make_splits(seed: int) -> tuple[list[dict], list[dict], list[dict]]:
    """Train, then test and dev drawn from the same stream, unique questions across all three."""
    rng = random.Random(seed)
    seen: set[str] = set()

    def draw(n: int) -> list[dict]:
        rows = []
        while len(rows) < n:
            row = make_row(rng)
            if row["question"] not in seen:
                seen.add(row["question"])
                rows.append(row)
        return rows

    train = draw(N_TRAIN)
    test = draw(N_TEST)
    dev = draw(N_DEV)
    return train, test, dev


def prompt_of(question: str) -> str:
    return "Question: " + question + "\nAnswer:"


def completion_of(answer: str) -> str:
    return " " + answer


_ANSWER_RE = re.compile(r"####\s*(-?\d+)")


def final_answer(text: str) -> str | None:
    found = _ANSWER_RE.findall(text)
    return found[-1] if found else None


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer(texts: list[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, model_max_length=256)


def encode_pair(tok, row: dict) -> tuple[list[int], list[int]]:
    p = tok(prompt_of(row["question"]), add_special_tokens=False)["input_ids"]
    c = tok(completion_of(row["answer"]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return p, c


# ----------------------------------------------------------------------------- sampling / eval


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    temperature: float,
    max_new: int,
    eos: int,
    pad: int,
    gen: torch.Generator | None = None,
    batch_size: int = 200,
) -> list[list[int]]:
    """Left-padded batched decoding with a KV cache; temperature 0 means greedy."""
    results: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        n, width = len(chunk), max(len(p) for p in chunk)
        ids = torch.full((n, width), pad)
        mask = torch.zeros((n, width), dtype=torch.long)
        for j, p in enumerate(chunk):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        cache, logits, last = out.past_key_values, out.logits[:, -1], pos[:, -1]
        done = torch.zeros(n, dtype=torch.bool)
        res: list[list[int]] = [[] for _ in chunk]
        for _ in range(max_new):
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                probs = torch.softmax(logits.float() / temperature, -1)
                nxt = torch.multinomial(probs, 1, generator=gen)[:, 0]
            for j, t in enumerate(nxt.tolist()):
                if not done[j]:
                    if t == eos:
                        done[j] = True
                    else:
                        res[j].append(t)
            if bool(done.all()):
                break
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], 1)
            last = last + 1
            out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None], past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
        results.extend(res)
    return results


def accuracy(model, tok, rows: list[dict], temperature: float, samples: int = 1, seed: int = 0, max_new: int = 40) -> dict:
    model.eval()
    prompts = [tok(prompt_of(r["question"]), add_special_tokens=False)["input_ids"] for r in rows]
    prompts = [p for p in prompts for _ in range(samples)]
    gen = torch.Generator().manual_seed(seed)
    outs = generate(model, prompts, temperature, max_new, tok.eos_token_id, tok.pad_token_id, gen)
    correct = [final_answer(tok.decode(o)) == final_answer(rows[k // samples]["answer"]) for k, o in enumerate(outs)]
    lens = [len(o) + 1 for o in outs]
    return {
        "acc": sum(correct) / len(correct),
        "mean_len": sum(lens) / len(lens),
        "truncated": sum(len(o) >= max_new for o in outs) / len(outs),
    }


def set_logit_scale(model, base_norm: torch.Tensor, scale: float) -> None:
    with torch.no_grad():
        model.model.norm.weight.copy_(base_norm * scale)


# ----------------------------------------------------------------------------- training


def train_sft(
    model, data: list[tuple[list[int], list[int]]], pad: int, steps: int, batch_size: int, lr: float, seed: int, log_every: int = 100
) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(seed)
    warmup = max(1, steps // 20)
    t0 = time.time()
    model.train()
    for step in range(1, steps + 1):
        # linear warmup, cosine decay to 10% of peak
        cur = lr * min(1.0, step / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for group in opt.param_groups:
            group["lr"] = cur
        idx = torch.randint(len(data), (batch_size,), generator=gen).tolist()
        width = max(len(data[i][0]) + len(data[i][1]) for i in idx)
        ids = torch.full((batch_size, width), pad)
        labels = torch.full((batch_size, width), -100)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for j, i in enumerate(idx):
            p, c = data[i]
            n = len(p) + len(c)
            ids[j, :n] = torch.tensor(p + c)
            mask[j, :n] = 1
            labels[j, len(p) : n] = torch.tensor(c)  # loss on completion tokens (incl. eos) only
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % log_every == 0 or step == steps:
            print(f"  sft step {step}/{steps}  loss {loss.item():.4f}  lr {cur:.2e}  {time.time() - t0:.0f}s", flush=True)
    model.eval()


def calibrate(model, tok, dev: list[dict], target: float, seed: int, iters: int = 8) -> float:
    """Bisect the logit scale so that dev T=1 accuracy (4 samples/prompt) is close to target."""
    base = model.model.norm.weight.detach().clone()
    lo, hi = 0.2, 1.0
    acc = accuracy(model, tok, dev, 1.0, 4, seed)["acc"]
    print(f"  logit_scale 1.0000: dev T=1 acc {acc:.3f}", flush=True)
    if acc <= target:
        return 1.0  # already spread enough: leave the model as trained
    best = (abs(acc - target), hi)
    for _ in range(iters):
        mid = round((lo + hi) / 2, 4)
        set_logit_scale(model, base, mid)
        acc = accuracy(model, tok, dev, 1.0, 4, seed)["acc"]
        print(f"  logit_scale {mid:.4f}: dev T=1 acc {acc:.3f}", flush=True)
        best = min(best, (abs(acc - target), mid))
        if acc > target:
            hi = mid
        else:
            lo = mid
    scale = best[1]
    set_logit_scale(model, base, scale)
    return scale


# ----------------------------------------------------------------------------- main


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def clear_outputs(out: Path) -> None:
    """Remove only what this script writes, so a rebuild leaves no stale files behind."""
    for name in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "build_info.json",
        "chat_template.jinja",
    ]:
        (out / name).unlink(missing_ok=True)
    if (out / "task").is_dir():
        shutil.rmtree(out / "task")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1200, help="SFT steps (batch 64)")
    ap.add_argument("--lr", type=float, default=4e-3)
    args = ap.parse_args()

    t_start = time.time()
    torch.set_num_threads(1)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    train, test, dev = make_splits(args.seed)
    tok = build_tokenizer([prompt_of(r["question"]) + completion_of(r["answer"]) for r in train])
    print(f"data: {len(train)} train / {len(test)} test rows; tokenizer vocab {len(tok)}", flush=True)

    data = [encode_pair(tok, r) for r in train]
    for r, (p, c) in zip(train[:200], data[:200]):
        joint = tok(prompt_of(r["question"]) + completion_of(r["answer"]), add_special_tokens=False)["input_ids"]
        assert joint == p + c[:-1], "prompt/completion tokenization is not concatenative"
    clen = [len(c) for _, c in data]
    print(
        f"completion tokens (incl. eos): mean {sum(clen) / len(clen):.1f}, max {max(clen)}; prompt max {max(len(p) for p, _ in data)}",
        flush=True,
    )

    hidden = 128
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(config).float()
    print(f"model: qwen3, {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)

    print(f"SFT: {args.steps} steps, batch 64, lr {args.lr}", flush=True)
    train_sft(model, data, tok.pad_token_id, args.steps, 64, args.lr, args.seed)

    dev_greedy = accuracy(model, tok, dev, 0.0)["acc"]
    print(f"dev greedy acc {dev_greedy:.3f}; calibrating logit scale for T=1 acc ~{TARGET_T1}", flush=True)
    scale = calibrate(model, tok, dev, TARGET_T1, seed=args.seed + 1)
    print(f"logit_scale = {scale}", flush=True)

    eval_rows = test[:200]
    greedy = accuracy(model, tok, eval_rows, 0.0)
    sampled = accuracy(model, tok, eval_rows, 1.0, samples=4, seed=args.seed + 2)

    args.out.mkdir(parents=True, exist_ok=True)
    clear_outputs(args.out)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(args.out)
    os.chmod(args.out / "model.safetensors", 0o644)  # safetensors writes 0600; the file ships in a wheel
    tok.save_pretrained(args.out)
    # Name the class transformers 4.x knows too (5.x maps it to its TokenizersBackend).
    tc_path = args.out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    (args.out / "task").mkdir()
    write_jsonl(args.out / "task" / "train.jsonl", train)
    write_jsonl(args.out / "task" / "test.jsonl", test)
    info = {
        "seed": args.seed,
        "sft_steps": args.steps,
        "sft_lr": args.lr,
        "logit_scale": scale,
        "prompt_format": "Question: {question}\\nAnswer:",
        "completion_format": " {answer}<eos>",
        "test_eval_prompts": len(eval_rows),
        "test_greedy_acc": round(greedy["acc"], 4),
        "test_t1_acc": round(sampled["acc"], 4),
        "test_t1_mean_completion_tokens": round(sampled["mean_len"], 2),
        "dev_greedy_acc_before_calibration": round(dev_greedy, 4),
    }
    (args.out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")

    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote {args.out} ({size / 1e6:.2f} MB) in {time.time() - t_start:.0f}s")
    print(
        f"test ({len(eval_rows)} prompts): greedy acc {greedy['acc']:.3f}; "
        f"T=1 sample acc {sampled['acc']:.3f} (4 samples each, mean completion {sampled['mean_len']:.1f} "
        f"tokens, {sampled['truncated']:.1%} hit the 40-token cap)"
    )


if __name__ == "__main__":
    main()
