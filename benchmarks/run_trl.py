"""Benchmark worker: TRL's GRPOTrainer (run in benchmarks/.venv-trl, which run.py sets up).

``.venv-trl/bin/python run_trl.py SPEC.json RESULT.json [--bf16] [--gradient-checkpointing]
[--device cuda] [--vllm-colocate]``. Configured to do the same work as
grpo-core: G completions for each of the step's prompts generated in one batch with
transformers ``generate`` (no vLLM), one optimizer step per generation batch (no gradient
accumulation, num_iterations=1, so no extra old-logprob forward), beta=0 (no reference model),
loss_type="grpo", temperature 1, no top-k/top-p, fp32 on the CPU, and gradient checkpointing
off (TRL turns it on by default; grpo-core did not recompute activations). ``--bf16`` is
GRPOConfig's ``bf16=True`` (the Trainer's bf16 autocast over the fp32 model and optimizer state),
``--gradient-checkpointing`` its ``gradient_checkpointing=True`` with TRL's own checkpointing
arguments. ``--device cuda`` trains on the GPU (``gpu.py``; ``use_cpu=False``), timing each phase
after a ``torch.cuda.synchronize()`` and recording the peak GPU memory after each step;
``--vllm-colocate`` samples with ``use_vllm=True, vllm_mode="colocate"`` instead of ``generate``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import current_rss_mb, load_spec, peak_rss_mb, reward_of_text, write_result


def bench_reward(completions, **kwargs):
    return [reward_of_text(c) for c in completions]


def main(spec_path: str, result_path: str, *flags: str) -> None:
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    parser = argparse.ArgumentParser(prog="run_trl.py SPEC RESULT")
    parser.add_argument("--bf16", action="store_true", help="GRPOConfig bf16=True")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="GRPOConfig gradient_checkpointing=True")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: GRPOConfig use_cpu=False")
    parser.add_argument("--vllm-colocate", action="store_true", help='GRPOConfig use_vllm=True, vllm_mode="colocate" (needs --device cuda)')
    settings = parser.parse_args(list(flags))
    if settings.vllm_colocate and settings.device != "cuda":
        parser.error("--vllm-colocate needs --device cuda (vLLM samples on the GPU)")
    on_gpu = settings.device == "cuda"
    spec = load_spec(spec_path)
    L, G, B = spec["completion_tokens"], spec["group_size"], spec["prompts_per_step"]
    record: dict[str, list] = {
        "ends": [],
        "cpu_ends": [],
        "peaks": [],
        "gpu_peaks": [],
        "generate": [],
        "gen_and_score": [],
        "lengths": [],
    }

    def synchronized() -> float:
        """The wall clock once the GPU's queued work is done (kernels run asynchronously)."""
        if on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter()

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            t = synchronized()
            out = super()._generate(prompts)
            record["generate"].append(synchronized() - t)
            record["lengths"].append([len(ids) for ids in out[1]])
            return out

        def _generate_and_score_completions(self, inputs):
            t = synchronized()
            out = super()._generate_and_score_completions(inputs)
            record["gen_and_score"].append(synchronized() - t)
            return out

    class StepEnd(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            record["rss_start_mb"] = current_rss_mb()

        def on_step_end(self, args, state, control, **kwargs):
            record["ends"].append(synchronized())
            record["cpu_ends"].append(time.process_time())
            record["peaks"].append(peak_rss_mb())
            record["gpu_peaks"].append(torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None)

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    dataset = datasets.Dataset.from_dict({"prompt": spec["prompts"]})
    steps = spec["steps"] + 1
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        use_cpu=not on_gpu,
        use_vllm=settings.vllm_colocate,
        vllm_mode="colocate",
        vllm_max_model_length=spec["prompt_tokens"] + L,
        bf16=settings.bf16,
        gradient_checkpointing=settings.gradient_checkpointing,
        per_device_train_batch_size=B * G,
        gradient_accumulation_steps=1,
        num_generations=G,
        num_iterations=1,
        max_completion_length=L,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="grpo",
        epsilon=0.2,
        scale_rewards="group",
        learning_rate=spec["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=steps,
        logging_steps=steps,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=spec["seed"],
    )
    trainer = TimedGRPOTrainer(
        model=model, reward_funcs=bench_reward, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[StepEnd()]
    )
    started, started_cpu = time.perf_counter(), time.process_time()
    trainer.train()
    out_steps = []
    prev, prev_cpu = started, started_cpu
    for i, end in enumerate(record["ends"]):
        period = end - prev
        gen_score = record["gen_and_score"][i]
        out_steps.append(
            {
                "period": period,
                "cpu": record["cpu_ends"][i] - prev_cpu,
                "sample": record["generate"][i],
                "reward": gen_score - record["generate"][i],
                "train": period - gen_score,
                "completion_lengths": record["lengths"][i],
                "peak_rss_mb": record["peaks"][i],
                "peak_gpu_gib": record["gpu_peaks"][i],
            }
        )
        prev, prev_cpu = end, record["cpu_ends"][i]
    write_result(
        result_path,
        {
            "contender": "TRL",
            "flags": list(flags),
            "rss_start_mb": record.get("rss_start_mb"),
            "steps": out_steps,
            "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
            "split": {
                "sample": "GRPOTrainer._generate (tokenize, generate, decode)",
                "reward": "rest of _generate_and_score_completions (rewards, advantages)",
                "train": "rest of the step (forward/backward, optimizer, Trainer bookkeeping)",
            },
        },
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
