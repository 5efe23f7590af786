from __future__ import annotations

import math

import pytest

from grpo_core import Prompt, Sample, make_plugin
from grpo_core.errors import PluginError
from grpo_core.plugins.advantages.grpo import GRPOAdvantage
from grpo_core.plugins.advantages.igpo import IGPOAdvantage, score_turns
from grpo_core.plugins_manager import build_manager
from grpo_core.stages import compute_advantages
from grpo_core.types import Turn


def conversation(tokenizer, prompt: Prompt, pieces: list[tuple[str, str]], reward: float) -> Sample:
    """A trajectory from (policy text, observation text) pairs: the policy's tokens are trained."""
    tokens = tokenizer.encode(prompt.text, add_special_tokens=False)
    mask = [0.0] * len(tokens)
    turns = []
    for said, observed in pieces:
        start = len(tokens)
        tokens += tokenizer.encode(said, add_special_tokens=False)
        end = len(tokens)
        tokens += tokenizer.encode(observed, add_special_tokens=False)
        mask += [1.0] * (end - start) + [0.0] * (len(tokens) - end)
        turns.append(Turn(start, end, len(tokens)))
    sample = Sample(
        prompt=prompt,
        tokens=tokens,
        sampling_logprobs=[0.0] * len(tokens),
        loss_mask=mask,
        text="",
        finish_reason="stop",
        policy_version=0,
        turns=turns,
    )
    sample.reward = reward
    return sample


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    from grpo_core.config import RunConfig
    from grpo_core.plugins.backends.local import LocalBackend

    return LocalBackend().make_trainer(config=RunConfig(model=str(tiny_model_dir)))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).float().eval()


def hand_score(model, context: list[int], answer: list[int]) -> float:
    """Mean teacher-forced log-probability of ``answer`` after ``context``, straight from the model."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([context + answer])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    n = len(context)
    return sum(float(logprobs[n - 1 + j, a]) for j, a in enumerate(answer)) / len(answer)


def mixed_group(tokenizer) -> list[Sample]:
    """Three trajectories of 3, 2 and 1 turns (the last one single-turn), one prompt."""
    prompt = Prompt(id="p", text="Question: what is 3 plus 4?\n", answer="7")
    return [
        conversation(tokenizer, prompt, [("Answer: 3 + 1", "\n#### 4\n"), ("Answer: 3 + 4", "\n#### 7\n"), ("Answer: 7", "\n")], 1.0),
        conversation(tokenizer, prompt, [("Answer: 2 + 2", "\n#### 4\n"), ("Answer: 4", "\n")], 0.0),
        conversation(tokenizer, prompt, [("Answer: 3 + 4 = 7", "\n")], 1.0),
    ]


def population(values):
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


@pytest.mark.parametrize("info_gain", ["log_prob_diff", "prob_diff"])
@pytest.mark.parametrize("norm", ["separate", "joint"])
def test_gains_and_turn_advantages_equal_a_hand_computation_on_a_tiny_model(trainer, hf_model, info_gain, norm):
    tokenizer = trainer.tokenizer
    group = mixed_group(tokenizer)
    template = "Answer: {answer}"
    lead = tokenizer.encode("Answer: ", add_special_tokens=False)
    answer = tokenizer.encode("7", add_special_tokens=False)

    # By hand: s_t after each turn but the last, straight from the model.
    contexts = [[s.turns[0].start] + [t.context_end for t in s.turns[:-1]] if len(s.turns) > 1 else [] for s in group]
    scores = [[hand_score(hf_model, s.tokens[:end] + lead, answer) for end in ends] for s, ends in zip(group, contexts)]
    assert [len(x) for x in scores] == [3, 2, 0]
    f = math.exp if info_gain == "prob_diff" else (lambda x: x)
    gains = [[f(b) - f(a) for a, b in zip(x, x[1:])] for x in scores]
    rewards = [s.reward for s in group]
    pooled_gains = [g for x in gains for g in x]
    gain_mean, gain_std = population(pooled_gains if norm == "separate" else pooled_gains + rewards)
    out_mean, out_std = population(rewards if norm == "separate" else pooled_gains + rewards)
    normalized = [[(g - gain_mean) / (gain_std + 1e-8) for g in x] + [(r - out_mean) / (out_std + 1e-8)] for x, r in zip(gains, rewards)]
    returns = [[sum(x[t:]) for t in range(len(x))] for x in normalized]  # gamma = 1

    plugin = IGPOAdvantage(info_gain=info_gain, norm=norm, answer_template=template)
    kept, metrics = compute_advantages(build_manager([plugin]), [group], drop_zero_variance=True, trainer=trainer)

    assert kept == [group]
    for sample, rets in zip(group, returns):
        expected = [0.0] * len(sample.tokens)
        for turn, value in zip(sample.turns, rets):
            expected[turn.start : turn.end] = [value] * (turn.end - turn.start)
        # z-scores amplify the ~1e-6 gap between the fast decoder and transformers
        assert sample.advantages == pytest.approx(expected, rel=1e-3, abs=1e-4)
        assert any(a != 0 for a in sample.advantages)
    # the turns' tokens are what differs: the first sample's three turns get three different values
    assert len({round(v, 6) for v in returns[0]}) == 3
    assert metrics["igpo/ig_mean"] == pytest.approx(population(pooled_gains)[0], abs=1e-6)
    assert metrics["igpo/ig_std"] == pytest.approx(population(pooled_gains)[1], abs=1e-6)
    assert metrics["igpo/ig_mean_turn1"] == pytest.approx((gains[0][0] + gains[1][0]) / 2, abs=1e-6)
    assert metrics["igpo/ig_mean_turn2"] == pytest.approx(gains[0][1], abs=1e-6)
    assert metrics["igpo/ig_std_turn2"] == 0.0
    assert metrics["igpo/scored_sequences"] == 5.0
    assert metrics["igpo/answer_logprob_t0"] == pytest.approx(scores[0][0], abs=1e-5)
    assert metrics["time/igpo"] > 0


def test_score_turns_scores_only_the_answer_tokens_after_each_context(trainer, hf_model):
    tokenizer = trainer.tokenizer
    group = mixed_group(tokenizer)
    scores, _ = score_turns(trainer, [group], "Answer: {answer} is right")
    answer = tokenizer.encode("7", add_special_tokens=False)
    lead = tokenizer.encode("Answer: ", add_special_tokens=False)
    first = group[0]
    assert scores[0][0] == pytest.approx(
        [
            hand_score(hf_model, first.tokens[:end] + lead, answer)
            for end in (first.turns[0].start, first.turns[0].context_end, first.turns[1].context_end)
        ],
        abs=1e-5,
    )
    assert scores[0][2] == []
    # The template's lead is part of the context: without it the scores differ.
    bare, _ = score_turns(trainer, [group], "{answer}")
    assert bare[0][0][0] == pytest.approx(hand_score(hf_model, first.tokens[: first.turns[0].start], answer), abs=1e-5)
    assert bare[0][0][0] != pytest.approx(scores[0][0][0], abs=1e-3)


class CountingTrainer:
    def __init__(self, trainer):
        self.inner, self.tokenizer, self.calls = trainer, trainer.tokenizer, []

    def forward(self, datums):
        self.calls.append(len(datums))
        return self.inner.forward(datums)


def test_one_trainer_forward_scores_every_turn_of_every_group_of_a_step(trainer):
    counting = CountingTrainer(trainer)
    groups = [mixed_group(trainer.tokenizer), mixed_group(trainer.tokenizer)]
    compute_advantages(build_manager([IGPOAdvantage()]), groups, drop_zero_variance=True, trainer=counting)
    assert counting.calls == [10]
    counting.calls.clear()
    groups = [mixed_group(trainer.tokenizer), mixed_group(trainer.tokenizer)]
    compute_advantages(build_manager([IGPOAdvantage()]), groups, drop_zero_variance=True, trainer=counting, max_samples_per_call=4)
    assert counting.calls == [4, 4, 2]
    # An outcome-only advantage never calls the trainer.
    counting.calls.clear()
    compute_advantages(build_manager([GRPOAdvantage()]), [mixed_group(trainer.tokenizer)], drop_zero_variance=True, trainer=counting)
    assert counting.calls == []


def fake_group(turn_counts, rewards):
    """Samples of 10 tokens with turns of 2 tokens each (start 2, 5, 8, ...), for the math alone."""
    prompt = Prompt(id="p", text="q", answer="a")
    group = []
    for count, reward in zip(turn_counts, rewards):
        turns = [Turn(2 + 3 * k, 4 + 3 * k, 5 + 3 * k) for k in range(count)]
        s = Sample(prompt=prompt, tokens=list(range(12)), sampling_logprobs=[0.0] * 12, loss_mask=[0.0] * 12, text="", finish_reason="stop",
                       policy_version=0, turns=turns)  # fmt: skip
        s.reward = reward
        group.append(s)
    return group


def test_gamma_discounts_later_turns():
    group = fake_group([3, 1], [1.0, 0.0])
    plugin = IGPOAdvantage(gamma=0.5)
    plugin.turn_scores_G = [[-3.0, -2.0, -0.5], []]
    adv = plugin.advantage(rewards_G=[1.0, 0.0], samples=group)
    # gains 1.0 and 1.5 -> z = -1, +1 ; outcomes 1, 0 -> z = +1, -1
    z = 1 / (1 + 1e-8)
    r1, r2, r3 = -z, z, z
    expected_returns = [r1 + 0.5 * r2 + 0.25 * r3, r2 + 0.5 * r3, r3]
    assert [adv[0][2], adv[0][5], adv[0][8]] == pytest.approx(expected_returns)
    assert adv[0][3] == adv[0][2] and adv[0][4] == 0.0 and adv[0][0] == 0.0 and adv[0][11] == 0.0
    assert adv[1][2:4] == pytest.approx([-z, -z]) and adv[1][4:] == [0.0] * 8
    plugin.gamma = 1.0
    plugin.turn_scores_G = [[-3.0, -2.0, -0.5], []]
    assert plugin.advantage(rewards_G=[1.0, 0.0], samples=group)[0][2] == pytest.approx(r1 + r2 + r3)


def test_single_turn_samples_get_grpo_with_population_std():
    rewards = [1.0, 0.0, 0.0, 0.5]
    samples = fake_group([0, 0, 0, 0], rewards)
    plugin = IGPOAdvantage()
    plugin.turn_scores_G = [[], [], [], []]
    expected = GRPOAdvantage(std="population").advantage(rewards_G=rewards, samples=samples)
    assert plugin.advantage(rewards_G=rewards, samples=samples) == pytest.approx(expected)
    # one recorded turn is the same thing, given to that turn's tokens only
    samples = fake_group([1, 1, 1, 1], rewards)
    plugin.turn_scores_G = [[], [], [], []]
    out = plugin.advantage(rewards_G=rewards, samples=samples)
    assert [a[2] for a in out] == pytest.approx(expected) and all(a[5] == 0.0 for a in out)


def test_a_lone_gain_is_not_scaled_and_joint_pools_it_with_the_outcomes():
    group = fake_group([2, 1], [1.0, 0.0])
    plugin = IGPOAdvantage()
    plugin.turn_scores_G = [[-2.0, -1.0], []]
    adv = plugin.advantage(rewards_G=[1.0, 0.0], samples=group)
    assert adv[0][2] == pytest.approx(0.0 + 1.0)  # lone gain: std 1, z = 0; plus the outcome's z
    joint = IGPOAdvantage(norm="joint")
    joint.turn_scores_G = [[-2.0, -1.0], []]
    adv = joint.advantage(rewards_G=[1.0, 0.0], samples=group)
    mean, std = population([1.0, 1.0, 0.0])
    assert adv[0][2] == pytest.approx((1.0 - mean) / std + (1.0 - mean) / std)
    assert adv[1][2] == pytest.approx((0.0 - mean) / std)


def test_equal_outcomes_with_information_gain_are_kept_and_without_dropped(trainer):
    group = fake_group([3, 2], [1.0, 1.0])
    plugin = IGPOAdvantage()
    manager = build_manager([plugin])

    class FixedScores:
        tokenizer = trainer.tokenizer

        def forward(self, datums):
            import torch

            return [torch.full((len(d.loss_fn_inputs["target_tokens"].data),), -1.0 - k * k) for k, d in enumerate(datums)]

    kept, metrics = compute_advantages(manager, [group], drop_zero_variance=True, trainer=FixedScores())
    assert len(kept) == 1 and metrics["groups/dropped_zero_variance"] == 0.0
    flat = fake_group([1, 1], [1.0, 1.0])
    kept, metrics = compute_advantages(manager, [flat], drop_zero_variance=True, trainer=FixedScores())
    assert kept == [] and metrics["groups/dropped_zero_variance"] == 1.0
    kept, _ = compute_advantages(manager, [fake_group([1, 1], [1.0, 1.0])], drop_zero_variance=False, trainer=FixedScores())
    assert [s.advantages for s in kept[0]] == [[0.0] * 12, [0.0] * 12]


def test_bad_inputs_fail_clearly(trainer):
    with pytest.raises(ValueError, match="must contain"):
        IGPOAdvantage(answer_template="The answer is")
    with pytest.raises(ValueError, match="gamma"):
        IGPOAdvantage(gamma=1.5)
    with pytest.raises(PluginError, match="needs the trainer"):
        compute_advantages(build_manager([IGPOAdvantage()]), [fake_group([2, 2], [1.0, 0.0])], drop_zero_variance=True)
    group = fake_group([2, 2], [1.0, 0.0])
    for s in group:
        s.prompt.answer = None
    with pytest.raises(PluginError, match="has no answer"):
        compute_advantages(build_manager([IGPOAdvantage()]), [group], drop_zero_variance=True, trainer=trainer)
    plugin = IGPOAdvantage()
    with pytest.raises(ValueError, match="turn scores for 0 samples and 2"):
        plugin.advantage(rewards_G=[1.0, 0.0], samples=fake_group([2, 2], [1.0, 0.0]))
    plugin.turn_scores_G = [[-1.0], [-1.0, -2.0]]
    with pytest.raises(ValueError, match="has 2 turns but 1 turn scores"):
        plugin.advantage(rewards_G=[1.0, 0.0], samples=fake_group([2, 2], [1.0, 0.0]))


def test_options_reach_the_plugin_by_name():
    plugin = make_plugin(
        "igpo", kind="advantage", info_gain="prob_diff", norm="joint", gamma=0.9, answer_template="The answer is {answer}."
    )
    assert (plugin.info_gain, plugin.norm, plugin.gamma, plugin.answer_template) == ("prob_diff", "joint", 0.9, "The answer is {answer}.")
    assert plugin.gains([-1.0, -0.5]) == pytest.approx([math.exp(-0.5) - math.exp(-1.0)])
    assert IGPOAdvantage().gains([-1.0, -0.5]) == pytest.approx([0.5])


def test_a_run_through_the_cli_scores_turns_and_trains(tiny_model_dir, tmp_path):
    import json

    from tests.helpers import grpo_core_in_process

    dataset = tmp_path / "games.jsonl"
    dataset.write_text("".join(json.dumps({"question": "Guess my number from 1 to 16.", "answer": str(n)}) + "\n" for n in (3, 11, 7, 16)))
    run_dir = tmp_path / "run"
    out = grpo_core_in_process(
        "run", "--model", str(tiny_model_dir), "--dataset", str(dataset), "--rollout", "multi_turn", "--rollout-opt", "max_turns=3",
        "--env", "guess_number", "--advantage", "igpo", "--advantage-opt", "answer_template=It is {answer}.",
        "--max-steps", "2", "--prompt-groups-per-step", "2", "--completions-per-prompt", "3", "--max-completion-tokens", "4",
        "--logger", "jsonl", "--run-dir", str(run_dir), env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for metrics in steps:
        # the random tiny model never plays the game (3 turns each, reward 0), yet the gains
        # carry signal: both groups train, and each of 6 games scored 3 contexts (turns 0, 1, 2)
        assert metrics["multi_turn/turns_mean"] == 3.0 and metrics["reward/total"] == 0.0
        assert metrics["igpo/scored_sequences"] == 18.0 and metrics["time/igpo"] > 0
        assert metrics["groups/kept"] == 2.0 and metrics["train/samples"] == 6.0
        assert {"igpo/ig_mean_turn1", "igpo/ig_mean_turn2"} <= set(metrics)
