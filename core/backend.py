"""The backend interfaces, on the Tinker training API contract.

A trainer takes ``tinker.Datum`` objects (model_input = tokens[:-1], target_tokens =
tokens[1:], weights = loss_mask[1:]) and ``tinker.AdamParams``, so a loss written for
grpo-core runs unchanged on the local backend and on a remote Tinker service.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from grpo_core.errors import PluginError

if TYPE_CHECKING:
    import tinker
    import torch

    from grpo_core.types import Completion, Sample, SamplingParams


class NonFiniteWeights(PluginError):
    """The policy's weights hold NaN or inf; no policy or checkpoint is written from them."""


CustomLossFn = Callable[[Sequence["tinker.Datum"], Sequence["torch.Tensor"]], "tuple[torch.Tensor, dict[str, float]]"]
"""``loss_fn(datums, logprobs)`` -> ``(loss, metrics)``; ``logprobs[i]`` are the target-token
logprobs of ``datums[i]`` (length = len(target_tokens)), differentiable in the weights."""


class PolicyScorer:
    """A read-only view of the policy being trained, for plugins that score with it (the
    ``prepare_advantages`` hook): its tokenizer and teacher-forced logprobs, nothing that changes it.

    ``forward`` runs in calls of at most ``max_samples_per_call`` sequences, all under ``lock``
    (the async loop's, held while a step changes the weights): the logprobs of one call come from
    one policy version, whatever thread asks.
    """

    def __init__(self, trainer: Trainer, max_samples_per_call: int | None = None, lock: Any = None) -> None:
        self._trainer = trainer
        self._size = max_samples_per_call
        self._lock = lock

    @property
    def tokenizer(self) -> Any:
        return self._trainer.tokenizer

    def forward(self, datums: Sequence[tinker.Datum]) -> list[torch.Tensor]:
        """Target-token logprobs of each datum under the current weights, without gradient."""
        size = self._size or max(len(datums), 1)
        with self._lock if self._lock is not None else contextlib.nullcontext():
            return [lp for start in range(0, len(datums), size) for lp in self._trainer.forward(list(datums[start : start + size]))]


@runtime_checkable
class Trainer(Protocol):
    """The policy being trained."""

    tokenizer: Any
    version: int
    """Number of optimizer steps applied to the weights."""

    def forward(self, datums: Sequence[tinker.Datum]) -> list[torch.Tensor]:
        """Target-token logprobs of each datum under the current weights, without gradient."""

    def forward_backward_custom(self, datums: Sequence[tinker.Datum], loss_fn: CustomLossFn) -> tinker.ForwardBackwardOutput:
        """One forward pass, ``loss_fn`` on its logprobs, backward; gradients accumulate.

        A non-finite loss is not backpropagated; the next ``optim_step`` is then skipped."""

    def optim_step(self, adam_params: tinker.AdamParams) -> dict[str, float]:
        """Apply the accumulated gradients (AdamW, clipping per ``grad_clip_norm``), zero them.

        With a non-finite loss or gradient norm the step is skipped (weights and optimizer state
        untouched) and the metrics say so: ``optim/skipped_nonfinite`` = 1.0. Weights that turn
        non-finite raise :class:`NonFiniteWeights`."""

    def save_state(self, path: str) -> None:
        """Write weights and optimizer state (refusing non-finite weights)."""

    def load_state(self, path: str) -> None:
        """Restore what ``save_state`` wrote."""

    def save_weights_for_sampler(self, path: str) -> str:
        """Write the current policy so that a sampler (or transformers) can load it (refusing
        non-finite weights)."""


@runtime_checkable
class Reference(Protocol):
    """A frozen policy that only scores tokens (for KL terms)."""

    def forward(self, datums: Sequence[tinker.Datum]) -> list[torch.Tensor]:
        """Target-token logprobs of each datum, without gradient."""


@runtime_checkable
class Sampler(Protocol):
    """Generates completions and reports the logprob of every sampled token."""

    tokenizer: Any
    version: int
    """Policy version of the weights it samples from."""
    max_context: int | None
    """Longest sequence (prompt + completion) the model takes; None when unknown."""

    def sample(self, prompts: Sequence[list[int]], num_samples: int, params: SamplingParams) -> list[list[Completion]]:
        """``num_samples`` completions for each tokenized prompt."""

    # Optional: ``concurrent_samples: int``, how many ``sample`` calls it takes at once from the
    # async loop's workers (default 1: the in-process sampler generates one call at a time, and
    # the async loop hands it the calls queued behind a generation as one batched call).
    # Optional, where ``takes_images`` is True (declared in hookspecs): ``sample(prompts, num_samples,
    # params, images=...)`` with each prompt's ``PromptImages`` (None for a text prompt).
    # Optional, for exact resume: ``state_dict() -> dict`` (its RNG, version, and weights it
    # keeps apart from the trainer's) and ``load_state_dict(state)``. A sampler without them
    # (a remote server) resumes with fresh randomness.


def sample_to_datum(sample: Sample) -> tinker.Datum:
    """The Tinker datum of a sample: inputs shifted against targets, mask on the targets."""
    import tinker

    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(sample.tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": sample.tokens[1:],
            "weights": sample.loss_mask[1:],
            **images_data(sample.images),
        },
    )


IMAGE_INPUT = "image."
"""What starts the name of a datum's ``loss_fn_inputs`` entry that holds one of its prompt's image
tensors (``image.pixel_values``): a trainer places them over the prompt's image tokens."""


def images_data(images: dict[str, torch.Tensor] | None) -> dict[str, tinker.TensorData]:
    """An image prompt's tensors (:attr:`Sample.images`) as a datum's ``loss_fn_inputs`` entries."""
    import tinker

    return {IMAGE_INPUT + name: tinker.TensorData.from_torch(tensor) for name, tensor in (images or {}).items()}


def routes_data(routes: torch.Tensor) -> tinker.TensorData:
    """A mixture-of-experts routing tensor (``[tokens, layers, top_k]`` expert indices) as a datum's
    ``loss_fn_inputs["routed_experts"]`` or a trainer's output (the Tinker contract's integers are int64)."""
    import tinker

    return tinker.TensorData(data=routes.numpy(), dtype="int64", shape=list(routes.shape))


@contextlib.contextmanager
def without_training_lines() -> Iterator[None]:
    """Make a trainer only to hold a policy (``eval``, ``export``): the lines it prints about how it
    would train (precision, optimizer, memory plan, ...) are held back; its warnings still show."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            yield
    finally:
        for line in said.getvalue().splitlines():
            if line.startswith(("warning", "note")):
                print(line, file=sys.stderr)
