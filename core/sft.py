"""``grpo-core sft``: supervised fine-tuning, the recipe beside the RL loops.

The same run folder (lock, ``--overwrite``), trainer plugins, checkpoints and exact resume,
loggers and ``final/`` as ``grpo-core run`` (``grpo_core.lifecycle``); what differs is the step:
a batch of examples, one cross-entropy loss over their target tokens, one optimizer step.

An example is a row's prompt, encoded as the run's rollout encodes it (so an RL run that starts
from this policy prompts it as it was taught), and its target: the row's ``--completion-field``
text followed by the tokenizer's end-of-sequence token, or, where the rollout wraps prompts in
the chat template, the assistant turn that template renders. A ``messages`` row is a chat whose
every assistant turn is a target and the rest context.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import attrs

from grpo_core.checkpoint import capture_rng
from grpo_core.config import SFTConfig
from grpo_core.data import load_dataset, steps_available
from grpo_core.errors import DataError, PluginError
from grpo_core.hookspecs import declared
from grpo_core.lifecycle import (
    Run,
    end_step,
    finish_run,
    guard_run,
    open_run_folder,
    own_run_dir,
    resume_point_and_trainer,
    resume_state,
    seed_everything,
)
from grpo_core.measure import evaluate_before_training, held_out_config, refuse_idle_eval_options
from grpo_core.metrics import Metrics, record, scope
from grpo_core.preflight import check_model_folder
from grpo_core.selection import select_plugins
from grpo_core.stages import fwd_bwd_chunks, learning_rate, optimizer_step, record_perf
from grpo_core.types import Prompt, RunState

SHOWN_LONG = 3
"""How many over-long examples a notice names; the count covers them all."""
SFT_EVAL_OPTIONS = ("eval_dataset", "eval_mix", "eval_prompts")
"""The settings of the held-out loss besides ``--eval-every`` (``grpo-core run``'s others measure samples)."""


@attrs.frozen
class Example:
    """One training sequence: its tokens and 1.0 on each target token (0.0 on the context);
    ``source``: the mixture's source of its row (None outside a mixture)."""

    id: str
    tokens: list[int]
    loss_mask: list[float]
    source: str | None = None

    @property
    def target_tokens(self) -> int:
        return int(sum(self.loss_mask))

    def datum(self) -> Any:
        """The Tinker datum (inputs shifted against targets, the mask on the targets)."""
        import tinker

        return tinker.Datum(
            model_input=tinker.ModelInput.from_ints(self.tokens[:-1]),
            loss_fn_inputs={"target_tokens": self.tokens[1:], "weights": self.loss_mask[1:]},
        )


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def chat_example(tokenizer: Any, prompt: Prompt) -> Example:
    """A ``messages`` row: the whole chat, each assistant turn (as the template renders it, its
    closing token included) a target. The template must render a turn the same whatever follows it."""
    messages = prompt.messages or []
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{prompt.id}: a 'messages' row is a chat, but the tokenizer has no chat template")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{prompt.id}: 'messages' has no assistant turn to train on")
    tokens = render_chat(tokenizer, messages, False)
    mask = [0.0] * len(tokens)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(render_chat(tokenizer, messages[:i], True))
        through = render_chat(tokenizer, messages[: i + 1], False)
        if tokens[: len(through)] != through or start > len(through):
            raise DataError(
                f"{prompt.id}: the chat template renders assistant turn {i + 1} differently once later turns follow it "
                "(it rewrites the history, e.g. drops past reasoning); give each turn as a row of its own"
            )
        mask[start : len(through)] = [1.0] * (len(through) - start)
    return Example(prompt.id, tokens, mask, prompt.source)


def prompt_example(tokenizer: Any, prompt: Prompt, prompt_tokens: list[int], chat: bool, completion: str | list[int]) -> Example:
    """A prompt row: ``prompt_tokens`` (as the rollout encodes the prompt) and the ``completion``
    after them; in the chat template's assistant turn where ``chat``, else followed by the eos
    token. A completion of token ids is the target as it is."""
    if isinstance(completion, list):
        target = completion
    elif chat:
        full = render_chat(tokenizer, [{"role": "user", "content": prompt.text}, {"role": "assistant", "content": completion}], False)
        if full[: len(prompt_tokens)] != prompt_tokens:
            raise DataError(f"{prompt.id}: the chat template renders the prompt differently once an answer follows it")
        target = full[len(prompt_tokens) :]
    else:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        target = list(tokenizer(completion, add_special_tokens=False)["input_ids"]) + eos
    return Example(prompt.id, prompt_tokens + target, [0.0] * len(prompt_tokens) + [1.0] * len(target), prompt.source)


def completion_of(prompt: Prompt, config: SFTConfig, vocab_size: int) -> str | list[int]:
    """The row's target: its text in ``--completion-template``, or a list of token ids (pre-tokenized: taken as they are)."""
    row, field = prompt.metadata, config.completion_field
    if field not in row:
        raise DataError(f"{prompt.id}: missing field '{field}' (fields: {', '.join(row) or 'none'}); set --completion-field")
    value = row[field]
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if not all(0 <= t < vocab_size for t in value):
            raise DataError(f"{prompt.id}: the target (field '{field}') holds token ids outside the vocabulary (0-{vocab_size - 1})")
        return value
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{prompt.id}: the target (field '{field}') is empty, or neither a string nor a list of token ids")
    return config.completion_template.replace("{completion}", value)


@attrs.define
class Examples:
    """A dataset's examples (``prompts``: the rows they were made of, in step), and those cut or
    left out for being over the length limit."""

    examples: list[Example]
    prompts: list[Prompt] = attrs.field(factory=list)
    truncated: list[str] = attrs.field(factory=list)
    skipped: list[str] = attrs.field(factory=list)

    @property
    def counts(self) -> dict[str, int]:
        return {
            "data/examples": len(self.examples),
            "data/target_tokens": sum(e.target_tokens for e in self.examples),
            "data/truncated_examples": len(self.truncated),
            "data/skipped_long_examples": len(self.skipped),
        }


def encode_examples(prompts: Sequence[Prompt], rollout: Any, tokenizer: Any, config: SFTConfig, max_len: int | None) -> Examples:
    """Every row as an example; one longer than ``max_len`` is refused, cut or left out (``--long-examples``)."""
    encode = declared(rollout, "rollout", "encode")
    if encode is None and any(p.messages is None for p in prompts):
        raise PluginError(
            f"--rollout {config.rollout} does not say how it encodes a prompt (no encode method): sft cannot train on its prompts"
        )
    chat = bool(declared(rollout, "rollout", "chat_template")) and getattr(tokenizer, "chat_template", None) is not None
    if config.completion_template.count("{completion}") != 1:
        raise PluginError(f"--completion-template {config.completion_template!r} must hold {{completion}} once")
    result = Examples([])
    for prompt in prompts:
        if prompt.messages is not None:
            example = chat_example(tokenizer, prompt)
        else:
            # A pre-tokenized prompt is taken as it is: no chat template around it or its target.
            in_chat = chat and prompt.tokens is None
            example = prompt_example(tokenizer, prompt, encode(tokenizer, prompt), in_chat, completion_of(prompt, config, len(tokenizer)))
        if max_len is None or len(example.tokens) <= max_len:
            result.examples.append(example)
            result.prompts.append(prompt)
            continue
        context = example.loss_mask.index(1.0)
        why = f"{prompt.id}: {len(example.tokens)} tokens ({context} before the first target token) > --max-seq-len {max_len}"
        if config.long_examples == "error":
            raise DataError(f"{why}; raise --max-seq-len, or pass --long-examples truncate or skip")
        cut = attrs.evolve(example, tokens=example.tokens[:max_len], loss_mask=example.loss_mask[:max_len])
        if config.long_examples == "truncate" and cut.target_tokens:
            result.examples.append(cut)
            result.prompts.append(prompt)
            result.truncated.append(why)
        else:
            result.skipped.append(why)
    for reasons, what in ((result.truncated, "cut to fit"), (result.skipped, "left out")):
        if reasons:
            print(
                f"{len(reasons)} examples over the length limit {what} (--long-examples); first: {'; '.join(reasons[:SHOWN_LONG])}",
                file=sys.stderr,
            )
    if not result.examples:
        raise DataError(f"every example is longer than --max-seq-len {max_len}; first: {result.skipped[0]}")
    return result


@attrs.define
class CrossEntropy:
    """The ``loss_fn(datums, logprobs)`` of one forward/backward call: −Σ log p over the call's
    target tokens, divided by the target tokens of the whole step, so that the calls of a step
    add up to its mean cross-entropy per target token (and its gradient)."""

    mask: list[Any]
    step_tokens: float

    def __call__(self, _datums: Any, logprobs: Sequence[Any]) -> tuple[Any, dict[str, float]]:
        nll = sum(-(lp * m).sum() for lp, m in zip(logprobs, self.mask))
        return nll / self.step_tokens, {}


def sft_step(trainer: Any, examples: Sequence[Example], config: SFTConfig, lr: float) -> Metrics:
    """One optimizer step on ``examples``, in forward/backward calls of at most
    ``--max-samples-per-fwd-bwd`` examples (gradient accumulation); a mixture's sources each
    counted (``data/NAME/examples``) and their loss apart (``data/NAME/loss``), from the logprobs
    of the step's own forwards."""
    import torch

    with scope() as metrics:
        datums = [e.datum() for e in examples]
        mask = [torch.tensor(e.loss_mask[1:]) for e in examples]
        tokens = float(sum(e.target_tokens for e in examples))
        record("train/examples", len(examples), "sum")
        record("train/tokens", tokens, "sum")
        record("train/forward_tokens", sum(len(e.tokens) - 1 for e in examples), "sum")
        for idx in fwd_bwd_chunks(len(examples), config.min_samples_per_fwd_bwd, config.max_samples_per_fwd_bwd):
            result = trainer.forward_backward_custom([datums[i] for i in idx], CrossEntropy([mask[i] for i in idx], tokens))
            record("loss/total", result.metrics.pop("loss"), "sum")
            logprobs = [output["logprobs"].to_torch() for output in result.loss_fn_outputs]
            record_losses([examples[i] for i in idx], logprobs, None, "data")
            call_tokens = float(sum(mask[i].sum() for i in idx))
            for key, value in result.metrics.items():
                record(key, value, "mean", weight=call_tokens)
        optimizer_step(trainer, config, lr)
    return metrics


def record_losses(examples: Sequence[Example], logprobs: Sequence[Any], overall: str | None, by_source: str) -> None:
    """Each example's mean cross-entropy per target token, weighted by those tokens, so that the
    records of several calls merge into a mean over every target token: under ``overall`` (None:
    not recorded), and a mixture's sources each apart (``BY_SOURCE/NAME/loss``, with
    ``BY_SOURCE/NAME/examples``). ``logprobs``: each example's target-token logprobs."""
    import torch

    for example, example_logprobs in zip(examples, logprobs):
        if overall is None and example.source is None:
            continue  # a training step outside a mixture: its loss is the step's own
        tokens = float(example.target_tokens)
        loss = -float((example_logprobs * torch.tensor(example.loss_mask[1:])).sum()) / tokens
        if overall is not None:
            record(overall, loss, "mean", weight=tokens)
        if example.source is not None:
            record(f"{by_source}/{example.source}/loss", loss, "mean", weight=tokens)
            record(f"{by_source}/{example.source}/examples", 1, "sum")


@attrs.define(eq=False)
class HeldOutLoss:
    """``--eval-every``: the mean cross-entropy per target token of held-out examples
    (``eval/loss``; each source of ``--eval-mix`` apart, ``eval/data/NAME/loss``), at step 0,
    every N steps and at the run's last step; forwards only."""

    examples: list[Example]
    every: int
    total_steps: int
    per_call: int
    trainer: Any = None

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.total_steps

    def __call__(self, rng: Any) -> dict[str, float]:
        """No RNG is drawn: ``rng`` stays as the step left it."""
        t0 = time.perf_counter()
        with scope() as measured:
            for start in range(0, len(self.examples), self.per_call):
                batch = self.examples[start : start + self.per_call]
                record_losses(batch, self.trainer.forward([e.datum() for e in batch]), "eval/loss", "eval/data")
        return {**measured.as_dict(), "eval/examples": float(len(self.examples)), "time/eval": time.perf_counter() - t0}


def held_out_loss(config: SFTConfig, rollout: Any, tokenizer: Any, max_len: int | None, total_steps: int) -> HeldOutLoss | None:
    """The held-out examples of ``--eval-every`` (None without), read and checked before the model loads."""
    if not config.eval_every:
        refuse_idle_eval_options(config, SFT_EVAL_OPTIONS, "the held-out loss is measured with --eval-every N")
        return None
    dataset = load_dataset(held_out_config(config))
    examples = encode_examples(dataset.prompts, rollout, tokenizer, config, max_len).examples
    per_call = config.max_samples_per_fwd_bwd or config.examples_per_step
    return HeldOutLoss(examples, config.eval_every, total_steps, per_call)


def start_sft(config: SFTConfig, resume: bool) -> Run:
    """Check every input before the model loads, then build the trainer and, when resuming,
    restore the newest checkpoint (as ``grpo_core.lifecycle.start_run`` does for an RL run)."""
    seed_everything(config.seed, config.threads)
    check_model_folder(config.model)
    selection = select_plugins(config, config.kinds)
    pm = selection.manager
    pm.hook.check_config(config=config, plugins=selection.plugins)
    dataset = load_dataset(config, refetch=not resume)
    tokenizer, max_context = pm.hook.load_tokenizer(config=config)
    if config.max_seq_len is not None and max_context is not None and config.max_seq_len > max_context:
        raise PluginError(f"--max-seq-len {config.max_seq_len} is over the model's context of {max_context} tokens")
    max_len = config.max_seq_len or max_context
    rollout = selection.plugins["rollout"][0]
    examples = encode_examples(dataset.prompts, rollout, tokenizer, config, max_len)
    dataset.prompts = examples.prompts  # those left out for their length are not the run's rows (data.json)
    total_steps = steps_available(len(examples.examples), config.examples_per_step, config.epochs)
    if total_steps == 0:
        raise PluginError(f"the dataset has {len(examples.examples)} examples, fewer than --examples-per-step {config.examples_per_step}")
    total_steps = min(total_steps, config.max_steps) if config.max_steps is not None else total_steps
    evaluator = held_out_loss(config, rollout, tokenizer, max_len, total_steps)
    trainer, newest, rows = resume_point_and_trainer(config, selection, dataset, total_steps, resume)
    state = RunState(run_dir=Path(str(config.run_dir)), total_steps=total_steps, data={**dataset.counts, **examples.counts})
    unobserved = resume_state(newest, selection, trainer, None, state) if newest is not None else None
    run_info = {"trainer": declared(trainer, "trainer object", "run_info")}
    open_run_folder(config, selection, state, newest is not None, rows, dataset.fetched, run_info, unobserved)
    state.rng = capture_rng(None)
    # The run's order of rows (a mixture's by its weights), each row's example in its place.
    example_of = {id(p): e for p, e in zip(examples.prompts, examples.examples)}
    rows_order = dataset.batches(config.examples_per_step, config.epochs, config.seed, config.shuffle)
    order = ([example_of[id(p)] for p in batch] for batch in rows_order)
    if evaluator is not None:
        evaluator.trainer = trainer
    r = Run(config, selection, trainer, None, None, state, islice(order, state.step, None), None, evaluator)
    if unobserved is not None:
        # The stopped run counted this step but not every plugin observed it (see grpo_core.lifecycle.end_step).
        pm.hook.on_step(step=state.step, metrics=unobserved, state=state, groups=[])
    return r


def run_sft(config: SFTConfig, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Train by supervised fine-tuning; the run folder is held, locked, from the first check to the summary."""
    started = time.perf_counter()
    with own_run_dir(config, resume, overwrite):
        r = start_sft(config, resume)
        state = r.state
        with guard_run(state, config, r.trainer):
            evaluate_before_training(r)
            for step in range(state.step + 1, state.total_steps + 1):
                t0 = time.perf_counter()
                metrics = sft_step(r.trainer, next(r.batches), config, learning_rate(config, step - 1, state.total_steps))
                seconds = time.perf_counter() - t0
                metrics.update({"time/train": seconds, "time/step": seconds}, "sum")
                record_perf(metrics, r.trainer)
                if end_step(r, step, metrics.as_dict(), []):
                    break
        return finish_run(r, config, started)
