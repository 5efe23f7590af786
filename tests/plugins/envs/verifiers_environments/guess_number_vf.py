"""A verifiers environment for the tests, loaded by its id (this module's name) as verifiers
loads any: a number-guessing game its ``Env.run`` plays turn by turn, answering each guess with
a hint, its seat allowed four guesses.

Why this one: verifiers 0.4 ships no environment that runs offline without a model of its own
(TextArena downloads word lists, user-sim needs a second model as the user, the harbor and
nemo-gym tasksets need containers); this is the smallest real one, and it uses each part the
adapter drives: a Taskset, an Env with a seat (its ``max_turns``), its interaction turns, the
task's ``@vf.reward`` functions and the env's ``finalize`` recording a reward of its own.
"""

from __future__ import annotations

import verifiers.v1 as vf

__all__ = ["GuessEnv", "GuessTaskset"]

ANSWERS = (3, 5, 7, 2)


class GuessData(vf.TaskData):
    answer: int


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def solved(self, task, trace) -> float:
        return float(trace.last_reply == str(task.answer))

    @vf.reward(weight=0.5)
    async def digits(self, task, trace) -> float:
        """Partial credit: the share of the guesses that hold a digit."""
        guesses = [m.content or "" for m in trace.assistant_messages]
        return sum(any(c.isdigit() for c in g) for g in guesses) / max(len(guesses), 1)


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        for answer in ANSWERS:
            yield GuessTask(GuessData(prompt="Guess my number, 1 to 9.", system_prompt="Answer with one digit.", answer=answer))


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(max_turns=4)


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as chat:
            segment = await chat.turn()
            while not segment.terminated and segment.last_reply != str(task.data.answer):
                segment = await chat.turn(hint(segment.last_reply, task.data.answer))

    async def finalize(self, task, episode):
        for trace in episode.traces:
            trace.record_reward("played", 1.0, 0.25)


def hint(guess: str, answer: int) -> str:
    if not guess.isdigit():
        return "One digit, please."
    return "Higher." if int(guess) < answer else "Lower."
