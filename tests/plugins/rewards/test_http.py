"""The http reward against a real server on 127.0.0.1: batching, concurrency, retries, time limits,
malformed answers (counted, never a crash or a hang), secret headers."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
import threading
import time

import attrs
import pytest

from grpo_core import PluginError, Prompt, Sample, make_plugin
from grpo_core.config import RunConfig
from grpo_core.plugins.rewards.http import RewardServiceError, parse_headers
from grpo_core.plugins_manager import redact
from grpo_core.selection import Selection, WeightedReward
from grpo_core.stages import RewardError, score_groups
from grpo_core.types import RewardFailures
from tests.conftest import REPO
from tests.helpers import grpo_core_in_process, small_run_args
from tests.plugins.rewards.json_server import Reply, elapsed, json_server

PROMPT = Prompt(id="p1", text="what is 2 plus 3?", answer="#### 5", metadata={"question": "what is 2 plus 3?", "level": 1})


def group(*texts: str, prompt: Prompt = PROMPT) -> list[Sample]:
    return [Sample(prompt, [7, 8, 9], [0.0, -0.1, -0.2], [0.0, 1.0, 1.0], t, "stop", 0) for t in texts]


def length_scores(path, body) -> Reply:
    return Reply({"scores": [float(len(s["completion"])) for s in body["samples"]]})


def started(reward, reward_timeout: float):
    reward.on_run_start(config=RunConfig(reward_timeout=reward_timeout), run_dir=None, total_steps=None, start_step=0)
    return reward


def test_scores_come_back_in_order_and_the_request_carries_the_schema():
    with json_server(length_scores) as server:
        reward = make_plugin("http", url=server.url + "/score")
        assert reward.reward(prompt=PROMPT, samples=group("a", "bbb", "cc")) == [1.0, 3.0, 2.0]
    [(path, body, headers)] = server.requests
    assert path == "/score" and headers["content-type"] == "application/json"
    assert body == {
        "samples": [
            {"prompt": "what is 2 plus 3?", "completion": c, "answer": "#### 5", "row": {"question": "what is 2 plus 3?", "level": 1}}
            for c in ("a", "bbb", "cc")
        ]
    }


def test_a_chat_prompt_goes_as_role_lines_and_a_missing_answer_as_null():
    chat = Prompt(id="c", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    with json_server(length_scores) as server:
        make_plugin("http", url=server.url).reward(prompt=chat, samples=group("x", prompt=chat))
    sent = server.requests[0][1]["samples"][0]
    assert sent["prompt"] == "system: be brief\nuser: hi" and sent["answer"] is None and sent["row"] == {}


def test_token_ids_on_request():
    with json_server(length_scores) as server:
        make_plugin("http", url=server.url).reward(prompt=PROMPT, samples=group("a"))
        make_plugin("http", url=server.url, token_ids=True).reward(prompt=PROMPT, samples=group("a"))
    without, with_ids = (r[1]["samples"][0] for r in server.requests)
    assert "prompt_ids" not in without and "completion_ids" not in without
    assert with_ids["prompt_ids"] == [7] and with_ids["completion_ids"] == [8, 9]


def test_batch_size_splits_a_group_into_requests_and_keeps_the_order():
    with json_server(length_scores) as server:
        reward = make_plugin("http", url=server.url, batch_size=2)
        assert reward.reward(prompt=PROMPT, samples=group("a", "bb", "ccc", "dddd", "eeeee")) == [1.0, 2.0, 3.0, 4.0, 5.0]
    sizes = sorted(len(body["samples"]) for _, body, _ in server.requests)
    assert sizes == [1, 2, 2]


@pytest.mark.parametrize("concurrency", [1, 3])
def test_concurrency_is_the_most_requests_in_flight(concurrency):
    def slow(path, body):
        time.sleep(0.15)
        return length_scores(path, body)

    with json_server(slow) as server:
        reward = make_plugin("http", url=server.url, batch_size=1, concurrency=concurrency)
        assert reward.reward(prompt=PROMPT, samples=group(*["x"] * 6)) == [1.0] * 6
    assert server.max_in_flight == concurrency


def test_null_scores_fail_only_their_samples():
    with json_server(lambda path, body: Reply({"scores": [None, 0.5]})) as server:
        assert make_plugin("http", url=server.url).reward(prompt=PROMPT, samples=group("a", "b")) == [None, 0.5]


MALFORMED = [
    (Reply(b"not json"), "the answer is not JSON: 'not json'"),
    (Reply({"score": [1.0, 1.0]}), 'the answer is not {"scores": [...]}'),
    (Reply([1.0, 1.0]), 'the answer is not {"scores": [...]}'),
    (Reply({"scores": [1.0]}), "the answer has 1 scores for 2 samples"),
    (Reply({"scores": [1.0, "1.0"]}), "a score is not a finite number or null: '1.0'"),
    (Reply({"scores": [1.0, True]}), "a score is not a finite number or null: True"),
    (Reply(b'{"scores": [1.0, Infinity]}'), "a score is not a finite number or null: inf"),
    (Reply({"error": "bad request"}, status=400), "HTTP 400"),
    (Reply({"error": "no"}, status=404), "HTTP 404"),
]


@pytest.mark.parametrize(("reply", "message"), MALFORMED)
def test_a_malformed_answer_fails_the_call_with_its_reason(reply, message):
    with json_server(lambda path, body: reply) as server:
        reward = make_plugin("http", url=server.url, retries=3, backoff=0.0)
        with pytest.raises(RewardServiceError, match="^" + server.url + ": ") as info:
            reward.reward(prompt=PROMPT, samples=group("a", "b"))
    assert message in str(info.value)
    assert len(server.requests) == 1  # the service answered: no retry


def test_a_malformed_batch_fails_only_its_own_samples():
    def second_batch_malformed(path, body):
        return Reply({"scores": "oops"}) if body["samples"][0]["completion"] == "c" else length_scores(path, body)

    with json_server(second_batch_malformed) as server:
        reward = make_plugin("http", url=server.url, batch_size=2)
        assert reward.reward(prompt=PROMPT, samples=group("a", "bb", "c", "d", "eeeee")) == [1.0, 2.0, None, None, 5.0]


def answers(*replies: Reply):
    """A server script: the n-th request gets the n-th reply, later ones the last."""
    calls = []

    def answer(path, body):
        calls.append(1)
        return replies[min(len(calls), len(replies)) - 1]

    return answer


def test_retries_get_past_temporary_errors():
    ok = Reply({"scores": [1.0]})
    script = [Reply({}, status=503), Reply({}, status=429), ok]
    with json_server(answers(*script)) as server:
        assert make_plugin("http", url=server.url, retries=2, backoff=0.0).reward(prompt=PROMPT, samples=group("a")) == [1.0]
    assert len(server.requests) == 3
    with json_server(answers(*script)) as server:
        with pytest.raises(RewardServiceError, match=r"HTTP 429 \(after 1 retries\)"):
            make_plugin("http", url=server.url, retries=1, backoff=0.0).reward(prompt=PROMPT, samples=group("a"))
    assert len(server.requests) == 2


def test_backoff_waits_between_retries():
    script = [Reply({}, status=500), Reply({"scores": [1.0]})]
    with json_server(answers(*script)) as server:
        _, quick = elapsed(lambda: make_plugin("http", url=server.url, backoff=0.0).reward(prompt=PROMPT, samples=group("a")))
    with json_server(answers(*script)) as server:
        result, waited = elapsed(lambda: make_plugin("http", url=server.url, backoff=0.6).reward(prompt=PROMPT, samples=group("a")))
    assert result == [1.0]
    assert waited >= 0.3 > quick  # jitter: between half and all of the backoff


def test_a_refused_connection_is_retried_then_fails_the_call():
    with json_server(length_scores) as server:
        url = server.url
    reward = make_plugin("http", url=url, retries=2, backoff=0.0)
    with pytest.raises(RewardServiceError, match=r"ConnectError: .*\(after 2 retries\)"):
        reward.reward(prompt=PROMPT, samples=group("a"))


def test_request_timeout_bounds_each_request():
    with json_server(answers(Reply({"scores": [1.0]}, delay=30.0))) as server:
        reward = make_plugin("http", url=server.url, request_timeout=0.3, retries=1, backoff=0.0)
        result, seconds = elapsed(lambda: reward.reward(prompt=PROMPT, samples=group("a")))
    assert isinstance(result, RewardServiceError) and "no answer within 0.3 s (after 1 retries)" in str(result)
    assert 0.6 <= seconds < 3.0 and len(server.requests) == 2


def test_the_runs_reward_timeout_bounds_the_whole_call_retries_included():
    with json_server(answers(Reply({"scores": [1.0]}, delay=30.0))) as server:
        reward = started(make_plugin("http", url=server.url, request_timeout=60.0, retries=5), reward_timeout=1.0)
        result, seconds = elapsed(lambda: reward.reward(prompt=PROMPT, samples=group("a")))
    assert isinstance(result, RewardServiceError) and "out of time (the run's --reward-timeout)" in str(result)
    assert 0.8 <= seconds < 1.0 + 1.0  # it stops a little before the run would


def test_batches_that_answered_keep_their_scores_when_another_runs_out_of_time():
    def last_batch_hangs(path, body):
        return Reply({"scores": [9.0]}, delay=30.0 if body["samples"][0]["completion"] == "slow" else 0.0)

    with json_server(last_batch_hangs) as server:
        reward = started(make_plugin("http", url=server.url, batch_size=1, concurrency=2), reward_timeout=1.0)
        result, seconds = elapsed(lambda: reward.reward(prompt=PROMPT, samples=group("a", "slow", "b")))
    assert result == [9.0, None, 9.0] and seconds < 2.0


def selection_of(reward) -> Selection:
    return Selection(manager=None, plugins={}, rewards=[WeightedReward("http", 1.0, reward)], loss=None)


def test_in_a_run_slow_failing_and_malformed_answers_are_counted_never_a_crash_or_a_hang():
    def mixed(path, body):
        kind = body["samples"][0]["row"]["kind"]
        if kind == "slow":
            return Reply({"scores": [1.0] * len(body["samples"])}, delay=30.0)
        if kind == "failing":
            return Reply({"error": "down"}, status=503)
        if kind == "malformed":
            return Reply(b"<html>oops</html>")
        if kind == "null":
            return Reply({"scores": [None] * len(body["samples"])})
        return Reply({"scores": [0.5] * len(body["samples"])})

    kinds = ["ok", "slow", "failing", "malformed", "null", "ok"]
    groups = [group("a", "b", prompt=Prompt(id=k + str(i), text="q", metadata={"kind": k})) for i, k in enumerate(kinds)]
    with json_server(mixed) as server:
        reward = started(make_plugin("http", url=server.url, retries=1, backoff=0.0), reward_timeout=1.0)
        selection = selection_of(reward)
        failures = RewardFailures()
        metrics, seconds = elapsed(lambda: score_groups(selection, groups, max_failures_in_a_row=100, timeout=1.0, failures=failures))
    assert seconds < 6.0
    assert [[s.reward for s in g] for g in groups] == [[0.5, 0.5]] + [[None, None]] * 4 + [[0.5, 0.5]]
    # slow, failing and malformed raise (errors), or the run's timer fires first; null only fails its samples
    assert metrics["reward/failed"] == 8.0 and metrics["reward/errors"] + metrics["reward/timeouts"] == 3.0
    assert failures.in_a_row == 0


def test_a_service_that_keeps_failing_trips_the_runs_circuit_breaker():
    with json_server(lambda path, body: Reply({"error": "down"}, status=500)) as server:
        selection = selection_of(make_plugin("http", url=server.url, retries=0))
        groups = [group("a", "b"), group("c", "d"), group("e", "f")]
        with pytest.raises(
            RewardError, match=r"rewards failed on 4 samples in a row; last: reward 'http' raised RewardServiceError: .*HTTP 500"
        ):
            score_groups(selection, groups, max_failures_in_a_row=4, timeout=5.0)
    assert len(server.requests) == 2


def test_headers_reach_the_service():
    with json_server(length_scores) as server:
        make_plugin("http", url=server.url, headers="Authorization: Bearer s3cret; X-Team: rl").reward(prompt=PROMPT, samples=group("a"))
        make_plugin("http", url=server.url, headers='{"Authorization": "Bearer json"}').reward(prompt=PROMPT, samples=group("a"))
    first, second = (r[2] for r in server.requests)
    assert first["Authorization"] == "Bearer s3cret" and first["X-Team"] == "rl"
    assert second["Authorization"] == "Bearer json"


def test_headers_are_a_secret(monkeypatch):
    reward = make_plugin("http", headers="Authorization: Bearer s3cret")
    assert "s3cret" not in repr(reward)
    assert redact("reward", "http", {"headers": "Authorization: Bearer s3cret", "batch_size": 4}) == {"headers": "***", "batch_size": 4}
    monkeypatch.setenv("REWARD_HEADERS", "Authorization: Bearer from-env")
    assert parse_headers(make_plugin("http", headers="env:REWARD_HEADERS").headers) == {"Authorization": "Bearer from-env"}


@pytest.mark.parametrize("text", ["Authorization Bearer s3cret", '{"Authorization": 5, "k": "s3cret"}', "{s3cret", ": s3cret"])
def test_bad_headers_are_refused_without_showing_the_value(text):
    with pytest.raises(PluginError, match="value hidden: secret option") as info:
        make_plugin("http", headers=text)
    assert "s3cret" not in str(info.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"url": "127.0.0.1:8100"}, "url must be an http:// or https:// address"),
        ({"batch_size": 0}, "batch_size must be > 0"),
        ({"concurrency": 0}, "concurrency must be > 0"),
        ({"request_timeout": 0}, "request_timeout must be > 0"),
        ({"retries": -1}, "retries must be >= 0"),
        ({"backoff": -1}, "backoff must be >= 0"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(PluginError, match=message):
        make_plugin("http", **options)


def test_the_example_server_answers_the_schema(tmp_path):
    namespace = runpy.run_path(str(REPO / "examples" / "reward_server.py"))
    score = namespace["score"]
    assert score({"answer": "#### 5", "completion": "it is 5"}) == 1.0
    assert score({"answer": "#### 5", "completion": "it is 6"}) == 0.0
    assert score({"answer": None, "completion": "5"}) is None


@attrs.define
class ExampleServer:
    url: str
    process: subprocess.Popen


@pytest.fixture
def example_server():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, str(REPO / "examples" / "reward_server.py"), str(port)])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        yield ExampleServer(f"http://127.0.0.1:{port}/score", process)
    finally:
        process.kill()
        process.wait()


def test_a_run_trains_on_the_example_servers_scores_and_keeps_the_headers_out_of_config_json(
    example_server, tiny_model_dir, tiny_dataset, tmp_path
):
    run_dir = tmp_path / "run"
    out = grpo_core_in_process(
        *small_run_args(tiny_model_dir, tiny_dataset, run_dir, "--reward", "http", "--reward-opt", f"url={example_server.url}",
                        "--reward-opt", "headers=Authorization: Bearer s3cret")
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["reward/failed"] == 0 and m["reward/errors"] == 0 for m in metrics)
    config = (run_dir / "config.json").read_text()
    assert "s3cret" not in config and json.loads(config)["plugin_options"]["reward"]["http"]["headers"] == "***"
    assert "s3cret" not in out.stdout + out.stderr


def test_close_at_run_end_then_a_later_call_starts_again():
    with json_server(length_scores) as server:
        reward = make_plugin("http", url=server.url)
        assert reward.reward(prompt=PROMPT, samples=group("a")) == [1.0]
        reward.on_run_end(summary={}, run_dir=None)
        assert reward.reward(prompt=PROMPT, samples=group("bb")) == [2.0]
        reward.on_run_end(summary={}, run_dir=None)


def test_the_run_end_stops_a_request_the_run_gave_up_on():
    """A call abandoned at --reward-timeout must not keep retrying (or hold the process) after the run."""
    with json_server(lambda path, body: Reply({"scores": [1.0]}, delay=30.0)) as server:
        reward = make_plugin("http", url=server.url, request_timeout=60.0, retries=3)
        outcome = []
        call = threading.Thread(target=lambda: outcome.append(elapsed(lambda: reward.reward(prompt=PROMPT, samples=group("a")))))
        call.start()
        time.sleep(0.5)
        reward.on_run_end(summary={}, run_dir=None)
        call.join(5.0)
        assert not call.is_alive()
    [(result, seconds)] = outcome
    assert isinstance(result, RewardServiceError) and seconds < 3.0
