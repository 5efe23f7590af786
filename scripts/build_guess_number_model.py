"""Build the warmed-up model for the ``guess_number`` environment (the IGPO information task).

    python scripts/build_guess_number_model.py [--out core/assets/guess_number] [--seed 0]

Everything is made here from nothing (no hub downloads), from one seed, on one CPU thread.

Why the choices are what they are:

* The game is plugins/envs/guess_number.py: a hidden number in 1..16; each turn the policy
  asks "Is it more than N?" (answered "Yes."/"No.") or answers "It is N." (reward 1 when
  right). The conversations the model is warmed up on are played against that very
  environment code, rendered with the chat template shipped in the tokenizer (below), exactly
  as the multi_turn rollout renders them.

* Chat template: plain "Q:\\n{user}\\n" and "A:\\n{assistant}<eos>\\n", generation prompt
  "A:\\n". The generation point ends in a newline, which the byte-level pre-tokenizer always
  keeps as its own token, so the policy's tokens followed by the next rendering extend the
  conversation token for token (the rollout's prefix check holds).

* Warm-up behaviour (what RL starts from): the format is learned, the strategy is poor on
  purpose. A demonstration asks 0..4 questions (uniformly), each with a threshold drawn
  uniformly inside the range still consistent with the answers so far (never a useless
  question, rarely the midpoint), then guesses uniformly among the numbers still consistent.
  Sampled at T=1 the model wins ~30% of games (build_info.json keeps the measured rate), so
  groups have reward variance; binary search (4 midpoint questions) wins every game, so RL
  has room: more questions and better thresholds. Only questions narrow the answer, so the
  turn-level information gain is exactly what tells a good question from a bad one.

* Model: a ~0.3M-parameter Qwen3 (fp32, tied embeddings), ~1.3 MB: small enough to ship
  beside the default model and to do RL on a laptop CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from grpo_core import Prompt  # noqa: E402
from grpo_core.plugins.envs.guess_number import GuessNumberEnv  # noqa: E402

DEFAULT_OUT = REPO / "core" / "assets" / "guess_number"
EOS, PAD = "<|endoftext|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ 'A:\\n' + m['content'] + eos_token + '\\n' }}"
    "{% else %}{{ 'Q:\\n' + m['content'] + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'A:\\n' }}{% endif %}"
)
N_TRAIN_ROWS, N_TEST_ROWS = 512, 128


# ----------------------------------------------------------------------------- demonstrations


def demonstration(env: GuessNumberEnv, secret: int, rng: random.Random) -> list[dict]:
    """One game played by the warm-up behaviour against the environment itself."""
    episode = env.env_reset(Prompt(id="demo", text="", answer=str(secret)))
    messages = list(episode.messages)
    lo, hi = env.low, env.high
    for _ in range(rng.randint(0, min(4, env.max_turns - 1))):
        if lo == hi:
            break
        threshold = rng.randint(lo, hi - 1)
        said = f"Is it more than {threshold}?"
        step = episode.step(said, [])
        messages += [{"role": "assistant", "content": said}, *step.messages]
        if step.messages[0]["content"] == "Yes.":
            lo = threshold + 1
        else:
            hi = threshold
    said = f"It is {rng.randint(lo, hi)}."
    episode.step(said, [])
    messages.append({"role": "assistant", "content": said})
    return messages


def encode_dialog(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the whole game and the positions the model learns (its turns and their eos)."""
    ids = as_ids(tok.apply_chat_template(messages, tokenize=True))
    trained = [0] * len(ids)
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = as_ids(tok.apply_chat_template(messages[:j], tokenize=True, add_generation_prompt=True))
        upto = as_ids(tok.apply_chat_template(messages[: j + 1], tokenize=True))
        assert ids[: len(upto)] == upto and upto[: len(before)] == before, "the chat template does not extend the conversation"
        assert upto[-2] == tok.eos_token_id
        trained[len(before) : len(upto) - 1] = [1] * (len(upto) - 1 - len(before))
    return ids, trained


def as_ids(out) -> list[int]:
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


# ----------------------------------------------------------------------------- tokenizer and model


def build_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=[EOS, PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, model_max_length=256)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def train_sft(model, data: list[tuple[list[int], list[int]]], pad: int, steps: int, batch_size: int, lr: float, seed: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(seed)
    warmup = max(1, steps // 20)
    t0 = time.time()
    model.train()
    for step in range(1, steps + 1):
        cur = lr * min(1.0, step / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for group in opt.param_groups:
            group["lr"] = cur
        idx = torch.randint(len(data), (batch_size,), generator=gen).tolist()
        width = max(len(data[i][0]) for i in idx)
        ids = torch.full((batch_size, width), pad)
        labels = torch.full((batch_size, width), -100)
        for j, i in enumerate(idx):
            x, trained = data[i]
            ids[j, : len(x)] = torch.tensor(x)
            labels[j, : len(x)] = torch.tensor([t if w else -100 for t, w in zip(x, trained)])
        logits = model(input_ids=ids).logits  # right padding: real tokens never see a pad
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps:
            print(f"  sft step {step}/{steps}  loss {loss.item():.4f}  lr {cur:.2e}  {time.time() - t0:.0f}s", flush=True)
    model.eval()


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def play(model, tok, env: GuessNumberEnv, secrets: list[int], temperature: float, seed: int, max_new: int = 16) -> dict:
    """Play every game to the end against the environment, all games decoded together."""
    gen = torch.Generator().manual_seed(seed)
    episodes = [env.env_reset(Prompt(id=str(k), text="", answer=str(s))) for k, s in enumerate(secrets)]
    convs = [as_ids(tok.apply_chat_template(e.messages, tokenize=True, add_generation_prompt=True)) for e in episodes]
    rewards = [0.0] * len(secrets)
    questions = [0] * len(secrets)
    live = list(range(len(secrets)))
    while live:
        outs: dict[int, list[int]] = {k: [] for k in live}
        active = list(live)
        for _ in range(max_new):
            width = max(len(convs[k]) + len(outs[k]) for k in active)
            ids = torch.full((len(active), width), tok.pad_token_id)
            mask = torch.zeros((len(active), width), dtype=torch.long)
            for j, k in enumerate(active):
                seq = convs[k] + outs[k]
                ids[j, width - len(seq) :] = torch.tensor(seq)
                mask[j, width - len(seq) :] = 1
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]
            still = []
            for k, t in zip(active, nxt.tolist()):
                outs[k].append(t)
                if t != tok.eos_token_id:
                    still.append(k)
            active = still
            if not active:
                break
        next_live = []
        for k in live:
            text = tok.decode(outs[k], skip_special_tokens=True)
            step = episodes[k].step(text, outs[k])
            questions[k] += text.strip().startswith("Is it")
            if step.done:
                rewards[k] = step.reward
                continue
            convs[k] = (
                convs[k]
                + outs[k]
                + ([] if outs[k][-1] == tok.eos_token_id else [tok.eos_token_id])
                + as_ids(tok("\n" + "".join(f"Q:\n{m['content']}\n" for m in step.messages) + "A:\n", add_special_tokens=False))
            )
            next_live.append(k)
        live = next_live
    return {"win_rate": sum(rewards) / len(rewards), "mean_questions": sum(questions) / len(questions)}


# ----------------------------------------------------------------------------- main


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=600, help="SFT steps (batch 32)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--games", type=int, default=6000, help="demonstration games")
    args = ap.parse_args()

    t_start = time.time()
    torch.set_num_threads(1)
    random.seed(args.seed)
    rng = random.Random(args.seed)
    env = GuessNumberEnv()
    games = [demonstration(env, rng.randint(env.low, env.high), rng) for _ in range(args.games)]
    plain = ["".join(f"{'A' if m['role'] == 'assistant' else 'Q'}:\n{m['content']}\n" for m in g) for g in games]
    tok = build_tokenizer(plain)
    data = [encode_dialog(tok, g) for g in games]
    lengths = [len(x) for x, _ in data]
    print(f"{len(data)} games; vocab {len(tok)}; tokens per game mean {sum(lengths) / len(lengths):.1f}, max {max(lengths)}", flush=True)

    hidden = 96
    config = Qwen3Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=True,
        attention_dropout=0.0, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(config).float()
    print(f"model: qwen3, {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    train_sft(model, data, tok.pad_token_id, args.steps, 32, args.lr, args.seed)

    eval_secrets = [rng.randint(env.low, env.high) for _ in range(256)]
    greedy = play(model, tok, env, eval_secrets, 0.0, args.seed)
    sampled = play(model, tok, env, eval_secrets, 1.0, args.seed + 1)
    print(f"greedy: {greedy}; T=1: {sampled}", flush=True)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for name in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "build_info.json", "run.toml"]:  # fmt: skip
        (out / name).unlink(missing_ok=True)
    if (out / "task").is_dir():
        shutil.rmtree(out / "task")
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    os.chmod(out / "model.safetensors", 0o644)
    tok.save_pretrained(out)
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    (out / "task").mkdir()
    question = f"Guess my number from {env.low} to {env.high}."
    write_jsonl(
        out / "task" / "train.jsonl", [{"question": question, "answer": str(rng.randint(env.low, env.high))} for _ in range(N_TRAIN_ROWS)]
    )
    write_jsonl(
        out / "task" / "test.jsonl", [{"question": question, "answer": str(rng.randint(env.low, env.high))} for _ in range(N_TEST_ROWS)]
    )
    info = {
        "seed": args.seed, "sft_steps": args.steps, "sft_lr": args.lr, "games": args.games,
        "eval_games": len(eval_secrets),
        "greedy_win_rate": round(greedy["win_rate"], 4), "greedy_mean_questions": round(greedy["mean_questions"], 3),
        "t1_win_rate": round(sampled["win_rate"], 4), "t1_mean_questions": round(sampled["mean_questions"], 3),
    }  # fmt: skip
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({size / 1e6:.2f} MB) in {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
