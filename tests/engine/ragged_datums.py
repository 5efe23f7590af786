"""Datums of very different lengths for the tests of packing and of the forward paths.

- ``datum(tokens, first_trained, gap)``: a datum over these tokens trained from target ``first_trained`` on.
- ``ragged_datums()``: distinct prompts of 3 to 40 tokens, and one datum with no trained target.
"""

from __future__ import annotations

import tinker
import torch


def datum(tokens, first_trained, gap=None):
    """A datum over ``tokens`` trained from target ``first_trained`` on (``gap``: one untrained target inside)."""
    weights = [0.0] * first_trained + [1.0] * (len(tokens) - 1 - first_trained)
    if gap is not None:
        weights[gap] = 0.0
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights}
    )


def ragged_datums():
    """Distinct prompts (no shared prefix) of very different lengths: 3 to 40 tokens."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(12, 28), (3, 5), (7, 2), (20, 9), (4, 30), (2, 1)]
    datums = []
    for i, (prompt, completion) in enumerate(shapes):
        tokens = torch.randint(2, 290, (prompt + completion,), generator=gen).tolist()
        datums.append(datum(tokens, prompt - 1, gap=prompt + 1 if i == 0 else None))
    # No trained target at all: its logprobs are all 0.
    datums.append(datum(torch.randint(2, 290, (6,), generator=gen).tolist(), 5))
    return datums
