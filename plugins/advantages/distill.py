"""The ``distill`` advantage: on-policy distillation from a teacher model's per-token logprobs."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import attrs

from grpo_core import PluginError, Sample, hookimpl, option
from grpo_core.loss import validate_non_negative, validate_positive
from grpo_core.metrics import record
from grpo_core.plugins.advantages.grpo import GRPOAdvantage
from grpo_core.remote.server_client import TOKENIZER_PROBE

__all__ = ["DistillAdvantage", "same_tokenizer"]

RETRY_DEADLINE = 600.0


def _names_a_model(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not value.strip():
        raise ValueError("teacher: name the teacher model, a folder or a cached hub name: --advantage-opt teacher=PATH")


def same_tokenizer(student: Any, teacher: Any) -> str | None:
    """Why two tokenizers would not give the same token ids (None: they do)."""
    if len(student) != len(teacher):
        return f"the student's vocabulary has {len(student)} tokens, the teacher's {len(teacher)}"
    if student.get_vocab() != teacher.get_vocab():
        return "the vocabularies map tokens to different ids"
    if student.encode(TOKENIZER_PROBE) != teacher.encode(TOKENIZER_PROBE):
        return "they split the same text into different tokens"
    if student.eos_token_id != teacher.eos_token_id:
        return f"their end-of-sequence tokens differ ({student.eos_token_id} and {teacher.eos_token_id})"
    return None


@attrs.define
class DistillAdvantage:
    """On-policy distillation: every trained token's advantage is kl_coef * (log pi_teacher(x_t) -
    log pi_sampler(x_t)), the teacher's and the sampler's logprob of the token the policy sampled,
    given the same context. That is minus the per-token estimate of the reverse KL(policy ||
    teacher): a policy gradient with it lowers that KL, pushing the policy toward what the teacher
    would have written, token by token, on the policy's own samples (Agarwal et al., GKD;
    Thinking Machines' on-policy distillation). With reward_weight > 0 the task reward's GRPO
    advantage (group-normalized), times reward_weight, is added to every trained token.

    The teacher is a local model folder with the policy's tokenizer (checked when the run starts;
    a run with another tokenizer is refused). It scores each step's samples forward-only, in
    batches of batch_size, on the run's device and in its own dtype, in the stage that computes
    advantages (in --loop async: the rollout workers, not the trainer). With teacher_url, a
    server (vLLM) scores them instead: the prompt logprobs of the policy's token ids, `teacher`
    being the served model's name, and its /tokenize is checked against the policy's tokenizer. distill/reverse_kl is the
    mean over trained tokens of log pi_sampler - log pi_teacher: it falls as the policy learns.
    Use it with a loss that takes per-token advantages as they are (grpo, importance_sampling,
    cispo...) and keep the rewards' groups: a group needs two scored samples to be trained on.
    """

    teacher: str = option(
        "", help="the teacher model: a local folder (or a cached hub name) with the policy's tokenizer", validator=_names_a_model
    )
    kl_coef: float = option(1.0, help="scale of the per-token advantage log pi_teacher - log pi_sampler", validator=validate_positive)
    reward_weight: float = option(
        0.0, help="weight of the task reward's GRPO advantage added to every token (0 = pure distillation)", validator=validate_non_negative
    )
    dtype: Literal["auto", "float32", "bfloat16"] = option("auto", help="the teacher's dtype: auto = bfloat16 on CUDA, float32 on CPU")
    batch_size: int = option(16, help="sequences per teacher forward (or per request to teacher_url)", validator=validate_positive)
    teacher_url: str = option(
        "",
        help="an OpenAI-compatible server (vLLM) serving the teacher under the name `teacher`: its prompt logprobs of the policy's tokens",
    )
    retry_deadline: float = option(
        RETRY_DEADLINE, help="teacher_url: seconds a failing request is retried before the run stops", validator=validate_positive
    )

    _device: str = attrs.field(init=False, default="auto", repr=False)
    _teacher: tuple[Any, Any] | None = attrs.field(init=False, default=None, repr=False)
    """The teacher's scorer (a LocalReference, or a ServerTeacher) and its tokenizer (None for a server), once made."""
    _teacher_logprobs: dict[int, list[float]] = attrs.field(init=False, factory=dict, repr=False)
    """The teacher's logprob of each target token (tokens[1:]) of the samples prepare_advantages
    scored, by the sample's id, until their advantage call takes them."""
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.teacher_url and self.dtype != "auto":
            raise ValueError("dtype is the local teacher's: a teacher behind teacher_url runs in the server's dtype")
        if not self.teacher_url and self.retry_deadline != RETRY_DEADLINE:
            raise ValueError("retry_deadline is for a teacher behind teacher_url; a local teacher makes no requests")

    @hookimpl
    def on_run_start(self, config: Any, run_dir: Path, total_steps: int | None, start_step: int) -> None:
        from transformers import AutoTokenizer

        from grpo_core.engine.models import model_path

        self._device = config.device
        teacher, teacher_tokenizer = self._teacher_model()
        try:
            student = AutoTokenizer.from_pretrained(model_path(config.model))
        except (OSError, ValueError) as exc:
            raise PluginError(f"distill: cannot load the tokenizer of {config.model!r} to compare it with the teacher's: {exc}") from None
        reason = same_tokenizer(student, teacher_tokenizer) if teacher_tokenizer is not None else teacher.tokenizer_difference(student)
        if reason is not None:
            raise PluginError(
                f"distill: the teacher {self.teacher!r} and the policy {config.model!r} must share the tokenizer "
                f"(the teacher scores the policy's token ids), but {reason}"
            )

    @hookimpl
    def on_run_end(self, summary: dict[str, Any], run_dir: Path) -> None:
        with self._lock:
            if self._teacher is not None and isinstance(self._teacher[0], ServerTeacher):
                self._teacher[0].close()
            self._teacher = None

    @hookimpl
    def prepare_advantages(self, groups: Sequence[Sequence[Sample]]) -> None:
        """The teacher's logprobs of every sample of ``groups``, batch_size sequences per forward."""
        from grpo_core.backend import sample_to_datum

        samples = [s for group in groups for s in group]
        teacher, _ = self._teacher_model()
        scored: dict[int, list[float]] = {}
        kl = tokens = 0.0
        for start in range(0, len(samples), self.batch_size):
            batch = samples[start : start + self.batch_size]
            for sample, logprobs in zip(batch, teacher.forward([sample_to_datum(s) for s in batch])):
                scored[id(sample)] = teacher_lp = [float(v) for v in logprobs]
                for t in range(1, len(sample.tokens)):
                    if sample.loss_mask[t]:
                        kl += sample.sampling_logprobs[t] - teacher_lp[t - 1]
                        tokens += 1
        with self._lock:
            self._teacher_logprobs = scored
        if tokens:
            record("distill/reverse_kl", kl / tokens, "mean", weight=tokens)

    @hookimpl
    def advantage(self, rewards_G: Sequence[float], samples: Sequence[Sample]) -> list[list[float]]:
        with self._lock:
            missing = [s for s in samples if id(s) not in self._teacher_logprobs]
            if missing:
                raise PluginError("distill: a sample has no teacher logprobs: the prepare_advantages hook must run before advantage")
            teacher_G = [self._teacher_logprobs.pop(id(s)) for s in samples]
        task_G = GRPOAdvantage().advantage(rewards_G, samples) if self.reward_weight else [0.0] * len(samples)
        advantages = []
        for sample, teacher_lp, task in zip(samples, teacher_G, task_G):
            per_token = [0.0] * len(sample.tokens)
            for t in range(1, len(sample.tokens)):
                if sample.loss_mask[t]:
                    per_token[t] = self.kl_coef * (teacher_lp[t - 1] - sample.sampling_logprobs[t]) + self.reward_weight * task
            advantages.append(per_token)
        return advantages

    def _teacher_model(self) -> tuple[Any, Any]:
        with self._lock:
            if self._teacher is None:
                self._teacher = self._load()
            return self._teacher

    def _load(self) -> tuple[Any, Any]:
        if self.teacher_url:
            return ServerTeacher(self.teacher_url, self.teacher, self.retry_deadline), None
        from grpo_core.engine.architectures import AUTO
        from grpo_core.engine.models import load_model, resolve_precision
        from grpo_core.engine.trainer import LocalReference

        device, dtype, _ = resolve_precision(self._device, self.dtype)
        try:
            model, tokenizer = load_model(self.teacher, device, AUTO, dtype=dtype)
        except PluginError as exc:
            raise PluginError(f"distill: the teacher: {exc}") from None
        return LocalReference(model, device), tokenizer


class ServerTeacher:
    """A teacher behind an OpenAI-compatible server: ``forward`` as a LocalReference's (the
    logprob of each target token), from the prompt logprobs of POST /v1/completions (vLLM's
    ``prompt_logprobs``) with the sequences sent as token ids, one request per call."""

    def __init__(self, base_url: str, model: str, retry_deadline: float) -> None:
        from grpo_core.remote.server_client import ServerClient

        self.client = ServerClient(base_url, retry_deadline=retry_deadline)
        self.model = model

    def forward(self, datums: Sequence[Any]) -> list[list[float]]:
        sequences = [[*d.model_input.to_ints(), d.loss_fn_inputs["target_tokens"].tolist()[-1]] for d in datums]
        body = {"model": self.model, "prompt": sequences, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        reply = self.client.post("/v1/completions", body)
        try:
            choices = sorted(reply["choices"], key=lambda c: c["index"])
            return [_prompt_logprobs(tokens, c["prompt_logprobs"]) for tokens, c in zip(sequences, choices, strict=True)]
        except (KeyError, TypeError, ValueError) as exc:
            raise PluginError(f"distill: the teacher server's answer has no prompt logprobs of the tokens sent ({exc!r})") from None

    def tokenizer_difference(self, student: Any) -> str | None:
        ours = student.encode(TOKENIZER_PROBE, add_special_tokens=False)
        theirs = self.client.post("/tokenize", {"model": self.model, "prompt": TOKENIZER_PROBE, "add_special_tokens": False})["tokens"]
        return None if ours == theirs else "the server splits a probe text into other tokens"

    def close(self) -> None:
        self.client.close()


def _prompt_logprobs(tokens: list[int], entries: list[Any]) -> list[float]:
    """The logprob of tokens[1:] from vLLM's prompt_logprobs (one entry per token, the first None;
    each maps token ids, as strings, to {"logprob": ...}, the sent token among them)."""
    if len(entries) != len(tokens):
        raise ValueError(f"{len(entries)} prompt logprobs for {len(tokens)} tokens")
    return [float(entry[str(token)]["logprob"]) for token, entry in zip(tokens[1:], entries[1:])]
