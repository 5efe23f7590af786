"""Build a teacher for on-policy distillation (``--advantage distill``) from the embedded model.

    python scripts/build_distill_teacher.py [--out runs/distill-teacher] [--steps 60] [--seed 0]

The teacher is a briefly trained copy of the embedded default model: a few dozen steps of
supervised fine-tuning on the embedded task's train answers, through the same trainer contract
a run uses (``forward_backward_custom`` and ``optim_step``). The embedded model is calibrated to
sample its answer only ~25% of the time at temperature 1 (scripts/build_default_model.py); the
fine-tuned copy is much sharper, so a student distilled from it has a large reverse KL to close,
and it shares the student's tokenizer by construction. Made from one seed on the CPU in seconds;
the suite builds it into a temporary folder (tests/plugins/advantages/test_distill.py).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PROMPT = "Question: {question}\nAnswer:"
COMPLETION = " {answer}"


def build_teacher(out: Path, steps: int = 60, learning_rate: float = 1e-3, batch: int = 32, seed: int = 0) -> Path:
    import tinker
    import torch

    from grpo_core.backend import sample_to_datum
    from grpo_core.config import RunConfig
    from grpo_core.embedded import ASSETS
    from grpo_core.plugins.backends.local import LocalBackend
    from grpo_core.types import Prompt, Sample

    torch.manual_seed(seed)
    rng = random.Random(seed)
    trainer = LocalBackend().make_trainer(config=RunConfig(model="default", device="cpu", dtype="float32", seed=seed))
    tokenizer = trainer.tokenizer
    rows = [json.loads(line) for line in (ASSETS / "task" / "train.jsonl").read_text().splitlines()]

    def sample(row: dict) -> Sample:
        prompt = tokenizer.encode(PROMPT.format(question=row["question"]))
        completion = tokenizer.encode(COMPLETION.format(answer=row["answer"])) + [tokenizer.eos_token_id]
        tokens = prompt + completion
        mask = [0.0] * len(prompt) + [1.0] * len(completion)
        return Sample(Prompt(id="sft", text=""), tokens, [0.0] * len(tokens), mask, "", "stop", 0)

    for step in range(steps):
        samples = [sample(row) for row in rng.sample(rows, batch)]
        masks = [torch.tensor(s.loss_mask[1:]) for s in samples]
        tokens = float(sum(m.sum() for m in masks))

        def nll(_datums: list, logprobs: list, masks: list = masks, tokens: float = tokens) -> tuple:
            loss = -sum((lp * m).sum() for lp, m in zip(logprobs, masks)) / tokens
            return loss, {"sft/nll": float(loss.detach())}

        result = trainer.forward_backward_custom([sample_to_datum(s) for s in samples], nll)
        trainer.optim_step(tinker.AdamParams(learning_rate=learning_rate, grad_clip_norm=1.0))
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step + 1}/{steps}: nll {result.metrics['sft/nll']:.3f}")
    out.mkdir(parents=True, exist_ok=True)
    trainer.save_weights_for_sampler(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/distill-teacher"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"teacher written to {build_teacher(args.out, steps=args.steps, seed=args.seed)}")


if __name__ == "__main__":
    main()
