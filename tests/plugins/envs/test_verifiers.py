"""The verifiers env on a taskset defined here, with the real ``verifiers`` package (the extra).

Why this taskset: verifiers 0.4's environments on its hub need downloads, sandboxes or a judge
model; a ``vf.Taskset`` built from an in-memory list is the smallest real one, and its two
``@vf.reward`` functions (one weighted) are scored by verifiers' own ``Task.score``, so the test
checks the reward verifiers computes, not a copy of it.
"""

from __future__ import annotations

import json
import sys

import pytest

from grpo_core import PluginError, Prompt
from grpo_core.data import dataset_source, load_prompts
from grpo_core.plugins.envs.verifiers import INDEX_FIELD, VerifiersEnv, main
from tests.test_cli import grpo_core_in_process

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
    assert info["distribution"] == "grpo-core" and [o["name"] for o in info["options"]] == ["taskset"]


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
