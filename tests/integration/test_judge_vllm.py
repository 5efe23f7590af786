"""The judge reward against a real vLLM server serving the suite's tiny model as the judge.

The tiny model grades at random, so this checks the plumbing, not the grades: every reply is
read by the same rule (a digit 0-9, the last one, is the score; none: the sample fails, counted),
shown in samples.jsonl, and the run finishes.
"""

from __future__ import annotations

import json
import re

import pytest

from grpo_core import Prompt, Sample, make_plugin
from tests.helpers import TEMPLATE, grpo_core
from tests.integration.vllm_server import VLLMServer, build_server_model, ensure_vllm_venv

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# The tiny model's context is 256 tokens, and its tokenizer spends about one per character on prose.
RUBRIC = "Q: {prompt}\nA: {completion}\nScore 0-9:"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def judge_server(tmp_path_factory):
    ensure_vllm_venv()
    root = tmp_path_factory.mktemp("judge")
    model = build_server_model(root / "model", tied=True)
    template = root / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    server = VLLMServer(model, root / "vllm.log", name="judge", extra_args=("--chat-template", str(template)))
    server.start()
    yield server
    server.stop()


def last_digit_score(reply: str) -> float | None:
    digits = re.findall(r"(\d)", reply)
    return int(digits[-1]) / 9 if digits else None


def test_the_judge_reads_the_servers_replies_by_its_rule(judge_server):
    judge = make_plugin("judge", base_url=judge_server.url, rubric=RUBRIC, score_pattern=r"(\d)", max_score=9, max_tokens=8)
    prompt = Prompt(id="p", text="what is 2 plus 3?")
    samples = [Sample(prompt, [1, 2], [0.0, 0.0], [0.0, 1.0], text, "stop", 0) for text in ("5", "6", "5")]
    try:
        scores = judge.reward(prompt=prompt, samples=samples)
    except Exception as exc:  # every reply unparseable: counted as an error, with the reason
        assert "no score in the reply" in str(exc)
        return
    for sample, score in zip(samples, scores):
        assert score == last_digit_score(sample.reward_details["judge"])
    assert judge.models == [] and samples[0].reward_details == samples[2].reward_details  # the served model; one request for both


def test_a_run_with_the_judge_shows_its_replies_in_samples_jsonl(judge_server, tmp_path, tiny_model_dir, tiny_dataset):
    run_dir = tmp_path / "run"
    out = grpo_core(
        "run", "--model", str(tiny_model_dir), "--dataset", str(tiny_dataset), "--prompt-template", TEMPLATE,
        "--max-steps", "2", "--prompt-groups-per-step", "2", "--completions-per-prompt", "4",
        "--max-completion-tokens", "6", "--run-dir", str(run_dir), "--max-reward-failures-in-a-row", "1000",
        "--no-drop-zero-variance-groups",
        "--reward", "judge", "--reward-opt", f"base_url={judge_server.url}", "--reward-opt", "models=judge",
        "--reward-opt", f"rubric={RUBRIC}", "--reward-opt", r"score_pattern=(\d)", "--reward-opt", "max_score=9",
        "--reward-opt", "max_tokens=8", "--logger", "jsonl", "--logger-opt", "jsonl.samples_every=1",
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 4, out.stdout + out.stderr
    # The random judge rarely writes a digit: a run in which every reward failed trained nothing, and says so.
    if all(row["reward/judge"] is None for row in rows):
        assert out.returncode == 1 and "error: nothing was trained" in out.stderr, out.stderr
    else:
        assert out.returncode == 0, out.stdout + out.stderr
    for row in rows:
        expected = last_digit_score(row["reward_detail/judge"])
        assert row["reward/judge"] == (None if expected is None else pytest.approx(expected))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["reward/failed"] for m in metrics) == sum(row["reward/judge"] is None for row in rows)
