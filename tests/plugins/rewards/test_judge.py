"""The judge reward against a fake OpenAI-compatible chat server on 127.0.0.1."""

from __future__ import annotations

import json
import re

import pytest

from grpo_core import PluginError, Prompt, Sample, make_plugin
from grpo_core.config import RunConfig
from grpo_core.plugins.rewards.http import RewardServiceError
from grpo_core.plugins.rewards.judge import GROUP_RUBRIC, POINTWISE_RUBRIC, parse_group_scores, parse_score
from grpo_core.plugins_manager import redact
from tests.helpers import grpo_core_in_process, small_run_args
from tests.plugins.rewards.json_server import Reply, elapsed, json_server

PROMPT = Prompt(id="p", text="What is 2 + 3?", answer="#### 5")


def group(*texts: str) -> list[Sample]:
    return [Sample(PROMPT, [1, 2], [0.0, -0.1], [0.0, 1.0], t, "stop", 0) for t in texts]


def chat(text: str) -> Reply:
    return Reply({"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]})


def grades(path: str, body: dict) -> Reply:
    """A judge that grades a response by how many '!' it has (model 'half' halves that); group
    requests get a JSON object, one score per response."""
    content = body["messages"][0]["content"]
    factor = 0.5 if body["model"] == "half" else 1.0
    if "Response 1:" in content:
        responses = re.findall(r"Response \d+:\n(.*?)(?=\n\nResponse \d+:|\n\nExplain|$)", content, re.DOTALL)
        return chat(f'Ranked. {{"scores": {json.dumps([r.count("!") * factor for r in responses])}}}')
    response = content.split("Response:\n", 1)[1].split("\n\nExplain", 1)[0]
    return chat(f"Looks fine.\nScore: {response.count('!') * factor:g}")


def test_pointwise_scores_map_the_rubric_range_to_0_1_and_the_request_is_a_chat_completion():
    with json_server(grades) as server:
        judge = make_plugin("judge", base_url=server.url + "/v1", models="m")
        assert judge.reward(prompt=PROMPT, samples=group("5", "5!!!!!", "5!!!!!!!!!!")) == [0.0, 0.5, 1.0]
    assert {path for path, _, _ in server.requests} == {"/v1/chat/completions"}
    bodies = [body for _, body, _ in server.requests]
    assert (
        len(bodies) == 3
        and {
            "model": "m",
            "messages": [{"role": "user", "content": POINTWISE_RUBRIC.replace("{prompt}", "What is 2 + 3?").replace("{completion}", "5")}],
            "temperature": 0.0,
            "max_tokens": 512,
        }
        in bodies
    )


def test_temperature_and_max_tokens_are_sent():
    with json_server(grades) as server:
        make_plugin("judge", base_url=server.url, models="m", temperature=0.7, max_tokens=64).reward(prompt=PROMPT, samples=group("a"))
    assert (server.requests[0][1]["temperature"], server.requests[0][1]["max_tokens"]) == (0.7, 64)


def test_a_custom_rubric_fills_prompt_completion_and_answer_once():
    rubric = "Q: {prompt}\nRef: {answer}\nA: {completion}\nScore: ?"
    with json_server(lambda path, body: chat("Score: 10")) as server:
        judge = make_plugin("judge", base_url=server.url, models="m", rubric=rubric)
        assert judge.needs_answer is True and make_plugin("judge", models="m").needs_answer is False
        assert judge.reward(prompt=PROMPT, samples=group("I say {answer}")) == [1.0]
    assert server.requests[0][1]["messages"][0]["content"] == "Q: What is 2 + 3?\nRef: #### 5\nA: I say {answer}\nScore: ?"


def test_the_judges_reply_is_kept_on_the_sample():
    with json_server(grades) as server:
        samples = group("ok!")
        make_plugin("judge", base_url=server.url, models="m").reward(prompt=PROMPT, samples=samples)
    assert samples[0].reward_details == {"judge": "Looks fine.\nScore: 1"}


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        ("I refuse to grade.", "no score in the reply"),
        ("Score: 11", "the score 11 is outside [0, 10]"),
        ("Score: -1", "the score -1 is outside [0, 10]"),
    ],
)
def test_an_unparseable_reply_fails_its_sample_and_shows_in_the_details(reply, reason):
    def one_bad(path, body):
        return chat(reply) if "bad" in body["messages"][0]["content"] else chat("Score: 4")

    with json_server(one_bad) as server:
        judge = make_plugin("judge", base_url=server.url, models="m")
        samples = group("good", "bad")
        assert judge.reward(prompt=PROMPT, samples=samples) == [0.4, None]
        assert samples[1].reward_details["judge"] == reply
        with pytest.raises(RewardServiceError, match=re.escape(reason)):
            judge.reward(prompt=PROMPT, samples=group("bad", "bad too"))


def test_parse_score_takes_the_last_match():
    pattern = re.compile(r"(?i)score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)")
    assert parse_score("Score: 2 ... on reflection, **Score:** 8", pattern, 0, 10) == 0.8
    assert parse_score("score = 7.5", pattern, 0, 10) == 0.75


def test_min_and_max_score_set_the_range():
    with json_server(lambda path, body: chat("Score: 3")) as server:
        judge = make_plugin("judge", base_url=server.url, models="m", min_score=1, max_score=5)
        assert judge.reward(prompt=PROMPT, samples=group("a")) == [0.5]


def test_a_score_over_max_score_fails():
    with json_server(lambda path, body: chat("Score: 3")) as server:
        with pytest.raises(RewardServiceError, match=r"outside \[0, 2\]"):
            make_plugin("judge", base_url=server.url, models="m", max_score=2).reward(prompt=PROMPT, samples=group("a"))


def test_score_pattern():
    with json_server(lambda path, body: chat("Score: 1\nGrade 9/10")) as server:
        judge = make_plugin("judge", base_url=server.url, models="m", score_pattern=r"Grade (\d+)/10")
        assert judge.reward(prompt=PROMPT, samples=group("a")) == [0.9]


def test_several_judges_are_averaged_and_each_must_answer():
    with json_server(grades) as server:
        judge = make_plugin("judge", base_url=server.url, models="full,half")
        samples = group("!!!!", "")
        assert judge.reward(prompt=PROMPT, samples=samples) == [pytest.approx(0.3), 0.0]
        assert samples[0].reward_details["judge"] == "[full] Looks fine.\nScore: 4\n\n[half] Looks fine.\nScore: 2"
    assert sorted(b["model"] for _, b, _ in server.requests) == ["full", "full", "half", "half"]

    def half_fails(path, body):
        return chat("no idea") if body["model"] == "half" else grades(path, body)

    with json_server(half_fails) as server:
        samples = group("!!!!")
        with pytest.raises(RewardServiceError, match="no score in the reply"):
            make_plugin("judge", base_url=server.url, models="full,half").reward(prompt=PROMPT, samples=samples)
        assert samples[0].reward_details["judge"] == "[full] Looks fine.\nScore: 4\n\n[half] no idea"


def test_identical_requests_are_sent_once_per_step():
    with json_server(grades) as server:
        judge = make_plugin("judge", base_url=server.url, models="m")
        assert judge.reward(prompt=PROMPT, samples=group("a!", "a!", "b")) == [0.1, 0.1, 0.0]
        assert len(server.requests) == 2
        judge.reward(prompt=PROMPT, samples=group("a!", "b"))
        assert len(server.requests) == 2  # the same step: answered from the cache
        judge.on_step(step=1)
        judge.reward(prompt=PROMPT, samples=group("a!", "b"))
        assert len(server.requests) == 4
    with json_server(grades) as server:
        judge = make_plugin("judge", base_url=server.url, models="m", cache=False)
        judge.reward(prompt=PROMPT, samples=group("a!", "a!", "b"))
        judge.reward(prompt=PROMPT, samples=group("a!", "b"))
        assert len(server.requests) == 3 + 2


def test_a_failed_request_is_not_cached():
    calls = []

    def first_fails(path, body):
        calls.append(1)
        return Reply({"error": "busy"}, status=400) if len(calls) == 1 else chat("Score: 5")

    with json_server(first_fails) as server:
        judge = make_plugin("judge", base_url=server.url, models="m")
        with pytest.raises(RewardServiceError, match="HTTP 400"):
            judge.reward(prompt=PROMPT, samples=group("a"))
        assert judge.reward(prompt=PROMPT, samples=group("a")) == [0.5]


def test_group_mode_ranks_the_whole_group_in_one_request():
    with json_server(grades) as server:
        judge = make_plugin("judge", base_url=server.url, models="m,half", mode="group")
        samples = group("!", "!!!!!!", "")
        assert judge.reward(prompt=PROMPT, samples=samples) == [pytest.approx(0.075), pytest.approx(0.45), 0.0]
        assert samples[0].reward_details["judge"].startswith('[m] Ranked. {"scores": [1.0, 6.0, 0.0]}')
    assert len(server.requests) == 2
    content = server.requests[0][1]["messages"][0]["content"]
    expected = GROUP_RUBRIC.replace("{n}", "3").replace("{prompt}", "What is 2 + 3?")
    assert content == expected.replace("{completions}", "Response 1:\n!\n\nResponse 2:\n!!!!!!\n\nResponse 3:\n")


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        ('{"scores": [1, 2]}', "the reply has 2 scores for 3 responses"),
        ('{"scores": [1, 2, "3"]}', "a score is not a number in"),
        ('{"scores": [1, 2, 30]}', "a score is not a number in"),
        ("scores: 1, 2, 3", 'no {"scores": [...]} object'),
    ],
)
def test_group_mode_fails_the_group_on_an_unusable_reply(reply, reason):
    with json_server(lambda path, body: chat(reply)) as server:
        judge = make_plugin("judge", base_url=server.url, models="m", mode="group")
        with pytest.raises(RewardServiceError, match=re.escape(reason)):
            judge.reward(prompt=PROMPT, samples=group("a", "b", "c"))


def test_parse_group_scores_takes_the_last_object():
    assert parse_group_scores('draft {"scores": [0, 0]} final {"scores": [10, 5]} done', 2, 0, 10) == [1.0, 0.5]


def listing(*names: str):
    def answer(path, body):
        if body is None:
            return Reply({"object": "list", "data": [{"id": n, "object": "model"} for n in names]})
        return grades(path, body)

    return answer


def test_without_models_the_servers_only_model_is_used():
    with json_server(listing("served")) as server:
        judge = make_plugin("judge", base_url=server.url)
        assert judge.reward(prompt=PROMPT, samples=group("!")) == [0.1]
        assert judge.reward(prompt=PROMPT, samples=group("!!")) == [0.2]
    assert [(path, body and body["model"]) for path, body, _ in server.requests] == [
        ("/v1/models", None), ("/v1/chat/completions", "served"), ("/v1/chat/completions", "served"),
    ]  # fmt: skip
    with json_server(listing("a", "b")) as server:
        with pytest.raises(RewardServiceError, match=r"serves 2 models \(a, b\); name one: --reward-opt models=NAME"):
            make_plugin("judge", base_url=server.url).reward(prompt=PROMPT, samples=group("a"))


def test_the_api_key_is_a_bearer_token_and_a_secret():
    with json_server(grades) as server:
        make_plugin("judge", base_url=server.url, models="m", api_key="sk-123").reward(prompt=PROMPT, samples=group("a"))
    assert server.requests[0][2]["Authorization"] == "Bearer sk-123"
    assert "sk-123" not in repr(make_plugin("judge", models="m", api_key="sk-123"))
    assert redact("reward", "judge", {"api_key": "sk-123"}) == {"api_key": "***"}


def test_retries_request_timeout_backoff_and_the_runs_reward_timeout():
    calls = []

    def busy_once(path, body):
        calls.append(1)
        return Reply({}, status=503) if len(calls) == 1 else chat("Score: 10")

    with json_server(busy_once) as server:
        with pytest.raises(RewardServiceError, match="HTTP 503"):
            make_plugin("judge", base_url=server.url, models="m", retries=0).reward(prompt=PROMPT, samples=group("a"))
        result, seconds = elapsed(
            lambda: make_plugin("judge", base_url=server.url, models="m", retries=1, backoff=0.0).reward(prompt=PROMPT, samples=group("b"))
        )
    assert result == [1.0] and seconds < 0.5
    calls.clear()
    with json_server(busy_once) as server:
        result, seconds = elapsed(
            lambda: make_plugin("judge", base_url=server.url, models="m", retries=1, backoff=0.8).reward(prompt=PROMPT, samples=group("b"))
        )
    assert result == [1.0] and seconds >= 0.4
    with json_server(lambda path, body: Reply(chat("Score: 1").body, delay=30)) as server:
        result, seconds = elapsed(
            lambda: make_plugin("judge", base_url=server.url, models="m", request_timeout=0.3, retries=0).reward(
                prompt=PROMPT, samples=group("a")
            )
        )
        assert isinstance(result, RewardServiceError) and "no answer within 0.3 s" in str(result) and seconds < 2
        judge = make_plugin("judge", base_url=server.url, models="m", retries=3)
        judge.on_run_start(config=RunConfig(reward_timeout=1.0), run_dir=None, total_steps=None, start_step=0)
        result, seconds = elapsed(lambda: judge.reward(prompt=PROMPT, samples=group("a")))
        assert isinstance(result, RewardServiceError) and "out of time" in str(result) and seconds < 2


@pytest.mark.parametrize("concurrency", [1, 4])
def test_concurrency(concurrency):
    def slow(path, body):
        import time

        time.sleep(0.15)
        return chat("Score: 1")

    with json_server(slow) as server:
        make_plugin("judge", base_url=server.url, models="m", concurrency=concurrency).reward(prompt=PROMPT, samples=group(*"abcdefgh"))
    assert server.max_in_flight == concurrency


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "group", "score_pattern": r"Grade (\d+)"}, "score_pattern is for mode=pointwise"),
        ({"rubric": "grade {prompt}"}, "rubric for mode=pointwise must contain {completion}"),
        ({"rubric": "grade {completions}", "mode": "group", "score_pattern": r"(?i)score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)"}, None),
        ({"rubric": "grade {completion} of {n}"}, "has {n}, which only the other mode fills"),
        ({"rubric": "grade {completions} and {completion}", "mode": "group"}, "has {completion}, which only the other mode fills"),
        ({"mode": "group", "rubric": "grade {completion}"}, "rubric for mode=group must contain {completions}"),
        ({"min_score": 5, "max_score": 5}, "max_score (5) must be above min_score (5)"),
        ({"score_pattern": "("}, "is not a regular expression"),
        ({"score_pattern": r"\d+"}, "must have exactly one group"),
        ({"mode": "ranking"}, "expected one of 'pointwise', 'group'"),
        ({"max_tokens": 0}, "max_tokens must be > 0"),
    ],
)
def test_bad_options_are_refused(options, message):
    if message is None:
        make_plugin("judge", **options)
        return
    with pytest.raises(PluginError, match=re.escape(message)):
        make_plugin("judge", **options)


def test_a_run_shows_the_judges_replies_in_samples_jsonl(tiny_model_dir, tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    with json_server(grades) as server:
        out = grpo_core_in_process(
            *small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--reward", "judge", "--reward-opt", f"base_url={server.url}",
                            "--reward-opt", "models=m", "--logger", "jsonl", "--logger-opt", "jsonl.samples_every=1")
        )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 4
    for row in rows:
        assert row["reward_detail/judge"] == f"Looks fine.\nScore: {row['completion'].count('!'):g}"
        assert row["reward/judge"] == pytest.approx(row["completion"].count("!") / 10)
