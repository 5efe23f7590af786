"""On-policy distillation with the teacher behind a real vLLM server: its prompt logprobs equal the
local teacher's, and a run through it measures the reverse KL the same run with the local teacher
does, step by step (that distillation lowers it is tests/plugins/advantages/test_distill.py's)."""

from __future__ import annotations

import json
import runpy

import pytest

from grpo_core import make_plugin
from grpo_core.config import RunConfig
from grpo_core.plugins_manager import build_manager
from grpo_core.stages import compute_advantages
from tests.conftest import REPO
from tests.helpers import grpo_core
from tests.integration.vllm_server import VLLMServer, ensure_vllm_venv

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    build_teacher = runpy.run_path(str(REPO / "scripts" / "build_distill_teacher.py"))["build_teacher"]
    return build_teacher(tmp_path_factory.mktemp("teacher") / "model", steps=60)


@pytest.fixture(scope="module")
def teacher_server(teacher, tmp_path_factory):
    ensure_vllm_venv()
    server = VLLMServer(teacher, tmp_path_factory.mktemp("teacher-server") / "vllm.log", name="teacher")
    server.start()
    yield server
    server.stop()


def embedded_group():
    from grpo_core import Prompt, Sample
    from grpo_core.plugins.backends.local import LocalBackend

    tokenizer = LocalBackend().load_tokenizer(config=RunConfig())[0]
    prompt = Prompt(id="p", text="Question: Tom has 3 apples. He buys 5 more. How many apples does Tom have now?\nAnswer:")
    start = len(tokenizer.encode(prompt.text))
    group = []
    for i, answer in enumerate([" 3 + 5 = 8\n#### 8", " 3 + 5 = 9\n#### 9", " 8"]):
        ids = tokenizer.encode(prompt.text + answer) + [tokenizer.eos_token_id]
        sample = Sample(prompt, ids, [0.0] * start + [-0.5] * (len(ids) - start), [0.0] * start + [1.0] * (len(ids) - start), "", "stop", 0)
        sample.reward = float(i == 0)
        group.append(sample)
    return group


def test_the_server_teachers_logprobs_are_the_local_teachers(teacher, teacher_server):
    advantages = []
    for options in ({}, {"teacher_url": teacher_server.url}):
        plugin = make_plugin("distill", teacher=str(teacher) if not options else "teacher", **options)
        plugin.on_run_start(config=RunConfig(device="cpu"), run_dir=None, total_steps=None, start_step=0)
        kept, _ = compute_advantages(build_manager([plugin]), [embedded_group()], drop_zero_variance=False)
        advantages.append([s.advantages for s in kept[0]])
        plugin.on_run_end(summary={}, run_dir=None)
    local, served = advantages
    assert max(abs(a - b) for x, y in zip(local, served) for a, b in zip(x, y)) < 1e-3


def test_a_run_through_the_server_teacher_measures_the_reverse_kl_the_local_teacher_does(teacher, teacher_server, tmp_path):
    kl = {}
    for where, options in (("local", [f"teacher={teacher}"]), ("server", ["teacher=teacher", f"teacher_url={teacher_server.url}"])):
        run_dir = tmp_path / where
        command = ["run", "--advantage", "distill", "--max-steps", "3", "--run-dir", str(run_dir), "--logger", "jsonl"]
        out = grpo_core(*command, *(a for o in options for a in ("--advantage-opt", o)), env={"OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stdout + out.stderr
        kl[where] = [json.loads(line)["distill/reverse_kl"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # The same seed samples the same completions; the teachers' logprobs agree within 1e-3, and so
    # the updates, to rounding.
    assert len(kl["server"]) == 3 and all(k > 0 for k in kl["server"]), kl
    assert abs(kl["server"][0] - kl["local"][0]) < 1e-3 and max(abs(a - b) for a, b in zip(kl["server"], kl["local"])) < 1e-2, kl
