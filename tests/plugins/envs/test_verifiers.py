"""The verifiers env on a taskset defined here, with the real ``verifiers`` package (the extra).

Why this taskset: verifiers 0.4's environments on its hub need downloads, sandboxes or a judge
model; a ``vf.Taskset`` built from an in-memory list is the smallest real one, and its two
``@vf.reward`` functions (one weighted) are scored by verifiers' own ``Task.score``, so the test
checks the reward verifiers computes, not a copy of it.
"""

from __future__ import annotations

import concurrent.futures
import gc
import json
import sys
from pathlib import Path

import pytest

from grpo_core import PluginError, Prompt
from grpo_core.data import dataset_source, load_prompts
from grpo_core.plugins.envs.verifiers import INDEX_FIELD, VerifiersEnv, check_seat, main
from grpo_core.types import EnvStep
from tests.helpers import grpo_core_in_process

vf = pytest.importorskip("verifiers.v1")

SPEC = "tests.plugins.envs.test_verifiers:SumTaskset"


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def exact(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def brief(self, task, trace) -> float:
        return float(len(trace.last_reply) <= 3)


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a in range(4):
            yield SumTask(SumData(prompt=f"{a}+1=", answer=str(a + 1), system_prompt="Answer with a number." if a == 0 else None))


def sum_taskset_of_two():
    return SumTaskset(vf.TasksetConfig()).take(2)


def infinite_taskset():
    class Endless(SumTaskset):
        INFINITE = True

    return Endless(vf.TasksetConfig())


def chat_and_userless_tasks():
    class Mixed(SumTaskset):
        def load(self):
            yield SumTask(
                SumData(
                    prompt=[vf.UserMessage(content="1+1="), vf.AssistantMessage(content="2"), vf.UserMessage(content="+1=")], answer="3"
                )
            )
            yield SumTask(SumData(prompt=None, answer="1"))
            yield SumTask(SumData(prompt=[vf.ToolMessage(content="2", tool_call_id="c1")], answer="2"))

    return Mixed(vf.TasksetConfig())


def not_a_taskset():
    return [1, 2]


def episode(index: int, spec: str = SPEC):
    return VerifiersEnv(taskset=spec).env_reset(Prompt(id="row", text="", metadata={INDEX_FIELD: index}))


def test_a_task_opens_with_its_system_prompt_and_prompt():
    assert episode(0).messages == [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "0+1="}]
    assert episode(2).messages == [{"role": "user", "content": "2+1="}]


def test_a_chat_prompt_opens_as_its_messages_and_a_task_without_prompt_is_refused():
    spec = "tests.plugins.envs.test_verifiers:chat_and_userless_tasks"
    chat = episode(0, spec)
    assert chat.messages == [
        {"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "+1="}
    ]  # fmt: skip
    assert chat.step("3", []).reward == 1.5  # the last reply is the policy's, not the prompt's assistant message
    with pytest.raises(PluginError, match="task 1 has no prompt"):
        episode(1, spec)
    with pytest.raises(PluginError, match="task 2 opens with tool messages; only system, user, assistant are adapted"):
        episode(2, spec)


@pytest.mark.parametrize(("said", "reward"), [("3", 1.5), (" 3\n", 1.5), ("4", 0.5), ("three", 0.0)])
def test_the_answer_is_scored_by_the_tasks_weighted_rewards_and_ends_the_episode(said, reward):
    step = episode(2).step(said, [1])
    assert step.done and step.messages == [] and step.reward == reward


def test_a_function_returning_a_bounded_view_is_a_taskset():
    env = VerifiersEnv(taskset="tests.plugins.envs.test_verifiers:sum_taskset_of_two")
    assert len(env.tasks) == 2
    with pytest.raises(PluginError, match="names task 2, but the taskset .* has 2"):
        env.env_reset(Prompt(id="row", text="", metadata={INDEX_FIELD: 2}))


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("", "taskset must be MODULE:NAME"),
        ("tests.plugins.envs.test_verifiers", "taskset must be MODULE:NAME"),
        ("tests.plugins.envs.test_verifiers:Nope", "cannot load taskset .*Nope"),
        ("no_such_module_here:X", "cannot load taskset"),
        ("tests.plugins.envs.test_verifiers:not_a_taskset", r"is \[1, 2\], not a verifiers Taskset"),
        ("tests.plugins.envs.test_verifiers:infinite_taskset", "is infinite"),
    ],
)
def test_a_bad_taskset_is_refused(spec, error):
    with pytest.raises(PluginError, match=error):
        VerifiersEnv(taskset=spec)


@pytest.mark.parametrize("metadata", [{}, {INDEX_FIELD: "1"}, {INDEX_FIELD: True}, {INDEX_FIELD: -1}])
def test_a_row_that_names_no_task_is_refused(metadata):
    with pytest.raises(PluginError, match=INDEX_FIELD + "|names task -1"):
        VerifiersEnv(taskset=SPEC).env_reset(Prompt(id="row", text="", metadata=metadata))


def test_the_rows_written_are_the_tasks_read_back_as_a_dataset(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    assert main([SPEC, str(path)]) == 0 and "4 rows written" in capsys.readouterr().out
    prompts = load_prompts(dataset_source(str(path)))
    assert [p.metadata[INDEX_FIELD] for p in prompts] == [0, 1, 2, 3]
    assert prompts[3].messages == [{"role": "user", "content": "3+1="}]
    assert main(["nope", str(tmp_path / "x.jsonl")]) == 1 and not (tmp_path / "x.jsonl").exists()


def test_without_the_extra_it_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(PluginError, match=r"pip install 'grpo-core\[verifiers\]'"):
        VerifiersEnv(taskset=SPEC)


def test_listed_by_grpo_core_plugins():
    infos = json.loads(grpo_core_in_process("plugins", "--json").stdout)
    info = next(i for i in infos if (i["kind"], i["name"]) == ("env", "verifiers"))
    assert info["distribution"] == "grpo-core" and [o["name"] for o in info["options"]] == ["taskset", "environment"]


def test_a_three_step_run_through_the_multi_turn_rollout(tmp_path):
    rows = tmp_path / "rows.jsonl"
    assert main([SPEC, str(rows)]) == 0
    out = grpo_core_in_process(
        "run", "--dataset", str(rows), "--rollout", "multi_turn", "--env", "verifiers", "--env-opt", f"taskset={SPEC}",
        "--max-steps", "3", "--prompt-groups-per-step", "1", "--completions-per-prompt", "4", "--max-completion-tokens", "4",
        "--run-dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    # One turn per task; each answer scores 0, 0.5, 1 or 1.5, so a group of 4 averages a multiple of 1/8.
    assert all(s["multi_turn/turns_mean"] == 1.0 and s["reward/failed"] == 0 for s in steps), steps
    assert all(0.0 <= s["reward/env"] <= 1.5 and (s["reward/env"] * 8).is_integer() for s in steps), steps


# An environment: verifiers' multi-turn protocol (Env.run over its seat's interaction turns),
# on the offline guessing game in verifiers_environments/guess_number_vf.py (its docstring: why).
ENVIRONMENTS = Path(__file__).parent / "verifiers_environments"
GAME = "guess_number_vf"


@pytest.fixture
def game(monkeypatch):
    """The game's environment, loaded by its id as verifiers loads one (a module on the path)."""
    monkeypatch.syspath_prepend(str(ENVIRONMENTS))
    return VerifiersEnv(environment=GAME)


def play(env: VerifiersEnv, index: int):
    return env.env_reset(Prompt(id="row", text="", metadata={INDEX_FIELD: index}))


def test_an_environment_plays_its_conversation_a_turn_at_a_time(game):
    episode = play(game, 1)  # the answer is 5
    assert episode.messages == [
        {"role": "system", "content": "Answer with one digit."}, {"role": "user", "content": "Guess my number, 1 to 9."}
    ]  # fmt: skip
    assert episode.step("a guess", [1]) == EnvStep(messages=[{"role": "user", "content": "One digit, please."}])
    assert episode.step("2", [1]) == EnvStep(messages=[{"role": "user", "content": "Higher."}], reward=0.0, done=False)
    assert episode.step("6", [1]) == EnvStep(messages=[{"role": "user", "content": "Lower."}], reward=0.0, done=False)
    # solved (1) + 3 of 4 guesses with a digit (0.5 * 0.75) + the env's finalize reward (0.25)
    assert episode.step(" 5\n", [1]) == EnvStep(messages=[], reward=1.625, done=True)
    assert play(game, 0).step("3", [1]) == EnvStep(messages=[], reward=1.75, done=True)


def test_the_seats_max_turns_ends_the_conversation_and_it_is_scored(game):
    episode = play(game, 1)
    assert [episode.step(guess, [1]).done for guess in "1119"] == [False, False, False, True]
    episode = play(game, 1)
    # unsolved: 2 of 4 guesses with a digit (0.5 * 0.5) + the env's reward (0.25)
    assert [episode.step(guess, [1]).reward for guess in "1x1x"] == [0.0, 0.0, 0.0, 0.5]


def test_the_rollouts_last_turn_ends_the_conversation_as_the_seats_would_and_it_is_scored(game):
    """The rollout stops asking after its max_turns (2 here, the seat allows 4): the exchange ends
    as verifiers ends a seat out of turns, and the task's rubric and the env's finalize score it."""
    game.rollout_turns = 2
    episode = play(game, 1)
    assert episode.step("1", [1]) == EnvStep(messages=[{"role": "user", "content": "Higher."}], reward=0.0, done=False)
    # unsolved: 1 of 2 guesses with a digit (0.5 * 0.5) + the env's finalize reward (0.25)
    assert episode.step("x", [1]) == EnvStep(messages=[], reward=0.5, done=True, cut_at_max_turns=True)
    assert play(game, 1).step("5", [1]) == EnvStep(messages=[], reward=1.75, done=True)  # solved before the limit
    episode = play(game, 1)
    assert [episode.step(g, [1]) for g in "15"][-1] == EnvStep(messages=[], reward=1.75, done=True)  # solved at the limit


def test_an_environment_may_open_a_task_without_prompt(game):
    class UserOpens(type(game.env)):
        async def run(self, task, agents):
            async with agents.player.interaction(task.with_data(prompt=None, system_prompt=None)) as chat:
                await chat.turn("Let's play: guess my number.")

    game.env = UserOpens(game.env.config)
    episode = play(game, 0)
    assert episode.messages == [{"role": "user", "content": "Let's play: guess my number."}]
    assert episode.step("3", [1]) == EnvStep(messages=[], reward=1.75, done=True)


def test_an_unfinished_conversation_cancels_its_run(game):
    episode = play(game, 1)
    episode.step("2", [1])
    run = episode.play
    del episode
    gc.collect()
    with pytest.raises(concurrent.futures.CancelledError):
        run.result(timeout=10)


class TwoSeats(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    user: vf.AgentConfig = vf.AgentConfig()


class TwoSeatEnv(vf.Env[TwoSeats]):
    async def run(self, task, agents):
        await agents.player.run(task)


@pytest.mark.parametrize(
    ("run", "error"),
    [
        ("twice", "runs its seat more than once per task"),
        ("raise", "task 0: ValueError: the game broke"),
        ("tool", "may hand it system, user, assistant messages with text content"),
        ("nothing", "Broken.run.. ended task 0 without a turn of its seat"),
        ("silent", "task 0 ended before the policy's first turn"),
    ],
)
def test_an_environment_the_adapter_cannot_play_is_refused(game, run, error):
    class Broken(type(game.env)):
        async def run(self, task, agents):
            if run == "twice":
                await agents.player.run(task)
                await agents.player.run(task)
            elif run == "raise":
                raise ValueError("the game broke")
            elif run == "tool":
                async with agents.player.interaction(task) as chat:
                    await chat.turn()
                    await chat.turn([vf.ToolMessage(content="42", tool_call_id="c1")])
            elif run == "silent":
                async with agents.player.interaction(task):
                    pass

    game.env = Broken(game.env.config)
    with pytest.raises(PluginError, match=error):
        episode = play(game, 0)
        episode.step("3", [1])
        episode.step("3", [1])


def test_an_environment_with_several_seats_is_refused(game):
    game.env = TwoSeatEnv(TwoSeats(taskset={"id": GAME}))
    with pytest.raises(PluginError, match="has seats player, user; only environments with one seat"):
        play(game, 0)


def test_a_seat_with_token_limits_is_refused(game):
    config = game.env.config.model_copy(update={"player": vf.AgentConfig(max_turns=4, max_output_tokens=100)})
    with pytest.raises(PluginError, match="seat player sets max_output_tokens, which are not adapted"):
        check_seat(type(game.env)(config))


class WithTools(SumTask):
    @classmethod
    def toolsets(cls, config):
        return [object()]


class WithStop(SumTask):
    @vf.stop
    async def enough(self, trace) -> bool:
        return True


class WithIntercept(SumTask):
    @vf.intercept
    async def rewrite(self, response: vf.Response) -> vf.Response | None:
        return None


@pytest.mark.parametrize(
    ("task_type", "what"),
    [(WithTools, r"MCP tool servers \(Task.toolsets\)"), (WithStop, "@vf.stop hooks"), (WithIntercept, "@vf.intercept hooks")],
)
def test_a_task_with_tools_or_hooks_at_the_model_endpoint_is_refused(task_type, what):
    env = VerifiersEnv(taskset=SPEC)
    env.tasks = [task_type(SumData(prompt="1+1=", answer="2", idx=0))]
    with pytest.raises(PluginError, match=f"task 0 \\({task_type.__name__}\\) has {what}, which act in verifiers' harness"):
        env.env_reset(Prompt(id="row", text="", metadata={INDEX_FIELD: 0}))


def test_an_environment_is_named_instead_of_a_taskset(monkeypatch):
    monkeypatch.syspath_prepend(str(ENVIRONMENTS))
    with pytest.raises(PluginError, match="give taskset or environment, not both"):
        VerifiersEnv(taskset=SPEC, environment=GAME)
    with pytest.raises(PluginError, match="cannot load environment no_such_environment_here"):
        VerifiersEnv(environment="no_such_environment_here")
    with pytest.raises(PluginError, match=f"names task 4, but the environment {GAME} has 4"):
        play(VerifiersEnv(environment=GAME), 4)


def test_the_rows_of_an_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ENVIRONMENTS))
    path = tmp_path / "rows.jsonl"
    assert main(["--environment", GAME, str(path)]) == 0 and "4 rows written" in capsys.readouterr().out
    prompts = load_prompts(dataset_source(str(path)))
    assert [p.metadata[INDEX_FIELD] for p in prompts] == [0, 1, 2, 3]
    assert prompts[2].messages == [
        {"role": "system", "content": "Answer with one digit."}, {"role": "user", "content": "Guess my number, 1 to 9."}
    ]  # fmt: skip


def test_a_run_whose_rollout_cuts_the_game_short_scores_every_conversation(tmp_path):
    rows = tmp_path / "rows.jsonl"
    sys.path.insert(0, str(ENVIRONMENTS))
    try:
        assert main(["--environment", GAME, str(rows)]) == 0
    finally:
        sys.path.remove(str(ENVIRONMENTS))
    out = grpo_core_in_process(
        "run", "--dataset", str(rows), "--rollout", "multi_turn", "--env", "verifiers", "--env-opt", f"environment={GAME}",
        "--rollout-opt", "max_turns=2",  # the game's seat allows 4
        "--max-steps", "2", "--prompt-groups-per-step", "1", "--completions-per-prompt", "4", "--max-completion-tokens", "4",
        "--run-dir", str(tmp_path / "run"), "--no-drop-zero-variance-groups", env={"PYTHONPATH": str(ENVIRONMENTS)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["multi_turn/turns_mean"] <= 2 for s in steps), steps
    # The conversations the rollout's limit cut (not solved in 2 guesses) are counted as ended by max_turns.
    assert any(s["multi_turn/max_turns_frac"] > 0 for s in steps), steps
    # Every conversation was scored: at least the env's finalize reward (0.25), never the unscored 0.
    assert all(0.25 <= s["reward/env"] <= 1.75 and s["reward/failed"] == 0 for s in steps), steps


def test_a_three_step_run_plays_the_environment_over_several_turns(tmp_path):
    rows = tmp_path / "rows.jsonl"
    env = {"PYTHONPATH": str(ENVIRONMENTS)}
    sys.path.insert(0, str(ENVIRONMENTS))
    try:
        assert main(["--environment", GAME, str(rows)]) == 0
    finally:
        sys.path.remove(str(ENVIRONMENTS))
    out = grpo_core_in_process(
        "run", "--dataset", str(rows), "--rollout", "multi_turn", "--env", "verifiers", "--env-opt", f"environment={GAME}",
        "--rollout-opt", "max_turns=5",
        "--max-steps", "3", "--prompt-groups-per-step", "1", "--completions-per-prompt", "4", "--max-completion-tokens", "4",
        "--run-dir", str(tmp_path / "run"), "--no-drop-zero-variance-groups", env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    # The game ends each conversation (its seat's 4 guesses, or solved), never the rollout's max_turns (5).
    assert all(1 < s["multi_turn/turns_mean"] <= 4 and s["multi_turn/max_turns_frac"] == 0 for s in steps), steps
    # Each conversation scores the env's 0.25, plus the rubric's 0.5 per share of guesses with a digit, plus 1 if solved.
    assert all(0.25 <= s["reward/env"] <= 1.75 for s in steps), steps
    assert any(s["reward/std"] > 0 and s["optim/grad_norm"] > 0 for s in steps), steps  # the rubric told turns apart
    assert all(s["reward/failed"] == 0 for s in steps), steps
