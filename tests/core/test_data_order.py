"""The seed sets the data order: the same seed repeats it, another seed changes it."""

from __future__ import annotations

from grpo_core.data import prompt_batches
from grpo_core.types import Prompt

PROMPTS = [Prompt(id=str(i), text=f"q{i}") for i in range(40)]


def order(seed: int, epochs: int = 1, shuffle: bool = True) -> list[str]:
    return [p.id for batch in prompt_batches(PROMPTS, 4, epochs, seed, shuffle) for p in batch]


def test_the_same_seed_gives_the_same_order():
    assert order(3, epochs=2) == order(3, epochs=2)


def test_different_seeds_give_different_orders():
    orders = {tuple(order(seed)) for seed in range(10)}
    assert len(orders) == 10  # 40! orders: ten seeds never collide unless the seed is ignored
    for seed in range(10):
        assert sorted(order(seed), key=int) == [p.id for p in PROMPTS]  # each a permutation of all rows


def test_each_epoch_is_a_new_order_of_every_row():
    first, second = order(0, epochs=2)[:40], order(0, epochs=2)[40:]
    assert sorted(first) == sorted(second) == sorted(p.id for p in PROMPTS)
    assert first != second


def test_no_shuffle_keeps_the_file_order_whatever_the_seed():
    assert order(0, shuffle=False) == order(7, shuffle=False) == [p.id for p in PROMPTS]
