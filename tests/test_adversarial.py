"""Adversarial: what a demanding user does wrong, and the faults a run meets, each through the real
``grpo-core`` command (a subprocess), each ending in its class: exit 1 (a mistake the message
explains) or 2 (a bad command line) with one readable ``error:`` line, never a traceback, never
a hang past its deadline, never a file of the user's touched.

The cases of the kill/resume harness (signals, a logger that raises) are in test_kill_harness.py;
the lock's live holder in test_run_safety.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import grpo_core, make_plugin_package, small_run_args

USER_ERROR, USAGE_ERROR = 1, 2

ADVERSARIAL_PLUGINS = '''
import attrs
import torch
from grpo_core import hookimpl
from grpo_core.plugins.losses.grpo import GRPOLoss


@attrs.define
class BrokenReward:
    """A reward whose service is down: every call raises."""

    @hookimpl
    def reward(self, prompt, samples):
        raise ConnectionError("the grading service is down")


@attrs.define
class OnceReward:
    """Scores differ in the first group it scores only: one group of a run has a signal."""

    calls: int = 0

    @hookimpl
    def reward(self, prompt, samples):
        self.calls += 1
        return [float(self.calls == 1 and i == 0) for i, _ in enumerate(samples)]


@attrs.define
class WordyReward:
    """A reward that answers in words."""

    @hookimpl
    def reward(self, prompt, samples):
        return ["0.5" for _ in samples]


@attrs.define
class FloatLoss(GRPOLoss):
    """A loss that returns its value as a float."""

    @hookimpl
    def loss(self, inputs):
        return super().loss(inputs).loss.detach().item()


@attrs.define
class HungryLoss(GRPOLoss):
    """The grpo loss, asking for more memory than any machine has."""

    @hookimpl
    def loss(self, inputs):
        torch.empty(2**50)
        return super().loss(inputs)
'''

RIVAL_GRPO = '''
import attrs
from grpo_core.plugins.losses.grpo import GRPOLoss


@attrs.define
class RivalGRPO(GRPOLoss):
    """Another distribution's loss that claims the name 'grpo'."""
'''


def install(root: Path, name: str, body: str, entry_points: dict[str, str]) -> str:
    pkg = make_plugin_package(root, name, body, entry_points)
    target = root / f"{name}-site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(pkg)],
        check=True,
        capture_output=True,
    )
    return str(target)


@pytest.fixture(scope="module")
def world(tiny_model_dir, tiny_dataset, tmp_path_factory):
    """Everything the cases point at: the tiny model and data, broken copies of them, plugin sites."""
    root = tmp_path_factory.mktemp("adversarial")
    w = SimpleNamespace(model=tiny_model_dir, data=tiny_dataset, root=root)
    for name, damage in {
        "empty_weights": lambda f: (f / "model.safetensors").write_bytes(b""),
        "cut_weights": lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:5000]),
        "no_tokenizer": lambda f: [p.unlink() for p in f.iterdir() if p.name.startswith(("tokenizer", "special_tokens"))],
    }.items():
        shutil.copytree(tiny_model_dir, root / name)
        damage(root / name)
        setattr(w, name, root / name)
    w.fake_parquet = root / "rows.parquet"
    w.fake_parquet.write_text('{"question": "1+1?", "answer": "2"}\n')
    w.done = root / "done"  # a finished two-step run
    assert grpo_core(*small_run_args(tiny_model_dir, tiny_dataset, w.done)).returncode == 0
    w.plugins = install(
        root,
        "grpo-adversarial-plugins",
        ADVERSARIAL_PLUGINS,
        {
            "reward.broken": "grpo_adversarial_plugins:BrokenReward",
            "reward.wordy": "grpo_adversarial_plugins:WordyReward",
            "reward.once": "grpo_adversarial_plugins:OnceReward",
            "loss.float": "grpo_adversarial_plugins:FloatLoss",
            "loss.hungry": "grpo_adversarial_plugins:HungryLoss",
        },
    )
    w.rival = install(root, "grpo-rival-grpo", RIVAL_GRPO, {"loss.grpo": "grpo_rival_grpo:RivalGRPO"})
    return w


@dataclass(frozen=True)
class Case:
    """One command a user may type: ``args(world, tmp)`` builds it, ``line`` is the ``error:`` line
    it must end with (a regex); ``setup(world, tmp)`` prepares what it meets, ``after(world, tmp)``
    checks what must still hold once it ended (the user's files untouched)."""

    id: str
    args: Callable[[SimpleNamespace, Path], list[str]]
    line: str
    code: int = USER_ERROR
    setup: Callable[[SimpleNamespace, Path], None] | None = None
    after: Callable[[SimpleNamespace, Path], None] | None = None
    env: Callable[[SimpleNamespace], dict[str, str]] | None = None
    cwd: Callable[[Path], Path] | None = None


def small(w, run_dir, *extra):
    return small_run_args(w.model, w.data, run_dir, *extra)


def project(w, tmp):
    """A user's project folder: data, notes and code, no run."""
    (tmp / "proj" / "src").mkdir(parents=True)
    (tmp / "proj" / "notes.txt").write_text("mine")
    (tmp / "proj" / "src" / "main.py").write_text("print('mine')")


def project_untouched(w, tmp):
    assert sorted(str(p.relative_to(tmp / "proj")) for p in (tmp / "proj").rglob("*")) == ["notes.txt", "src", "src/main.py"]


def copy_done(w, tmp):
    shutil.copytree(w.done, tmp / "run")


def cut_config(w, tmp):
    copy_done(w, tmp)
    config = tmp / "run" / "config.json"
    config.write_text(config.read_text()[:120])


def toml(text):
    def setup(w, tmp):
        (tmp / "run.toml").write_text(text)

    return setup


def plugins_site(w):
    return {"PYTHONPATH": w.plugins}


CASES = [
    # -- a user's files are never deleted ----------------------------------------------------
    Case(
        "overwrite-the-working-directory",
        lambda w, tmp: small(w, ".", "--overwrite"),
        r"--overwrite never empties the working directory or a folder above it \(\.\); choose another --run-dir",
        setup=project,
        after=project_untouched,
        cwd=lambda tmp: tmp / "proj",
    ),
    Case(
        "overwrite-a-folder-above-the-working-directory",
        lambda w, tmp: small(w, "..", "--overwrite"),
        r"--overwrite never empties the working directory or a folder above it \(\.\.\); choose another --run-dir",
        setup=project,
        after=project_untouched,
        cwd=lambda tmp: tmp / "proj" / "src",
    ),
    Case(
        "overwrite-a-folder-that-holds-no-run",
        lambda w, tmp: small(w, tmp / "proj", "--overwrite"),
        r"--overwrite only replaces a grpo-core run, and \S+/proj holds no run's config.json \(it holds notes.txt, src\); "
        r"choose another --run-dir",
        setup=project,
        after=project_untouched,
    ),
    Case(
        "overwrite-a-model-folder",
        lambda w, tmp: small(w, w.model, "--overwrite"),
        r"--overwrite only replaces a grpo-core run, and \S+ holds no run's config.json \(it holds config.json, .*",
    ),
    # -- meaningless values, refused where given --------------------------------------------
    Case(
        "reward-weight-nan",
        lambda w, tmp: small(w, tmp / "r", "--reward", "gsm8k:nan"),
        r"reward 'gsm8k': weight must be a finite number, got nan",
    ),
    Case(
        "reward-weight-inf-in-toml",
        lambda w, tmp: [*small(w, tmp / "r"), "--config", str(tmp / "run.toml")],
        r"reward 'gsm8k': weight must be a finite number, got inf",
        setup=toml("[reward.gsm8k]\nweight = inf\n"),
    ),
    Case(
        "grad-clip-norm-nan",
        lambda w, tmp: small(w, tmp / "r", "--grad-clip-norm", "nan"),
        r"config 'grad_clip_norm': expected a finite number, got nan",
    ),
    Case(
        "learning-rate-inf",
        lambda w, tmp: small(w, tmp / "r", "--learning-rate", "inf"),
        r"config 'learning_rate': expected a finite number, got inf",
    ),
    Case(
        "loss-option-nan",
        lambda w, tmp: small(w, tmp / "r", "--loss-opt", "kl_beta=nan"),
        r"option 'kl_beta' of loss.grpo: expected a finite number, got 'nan'",
    ),
    Case(
        "empty-stop-string",
        lambda w, tmp: small(w, tmp / "r", "--stop", ""),
        r"config: stop: an empty string is no stop string \(every completion would end at once\)",
    ),
    Case(
        "async-setting-under-the-sync-loop",
        lambda w, tmp: small(w, tmp / "r", "--max-head-offpolicy-versions", "2"),
        r"--max-head-offpolicy-versions belongs to the asynchronous loop \(--loop async\); under --loop sync it would do nothing",
    ),
    Case(
        "lora-alpha-without-a-rank",
        lambda w, tmp: small(w, tmp / "r", "--lora-alpha", "16"),
        r"--lora-alpha sets LoRA adapters, which only --lora-rank > 0 trains; without it, it would do nothing",
    ),
    Case(
        "backend-and-trainer-both-given",
        lambda w, tmp: small(w, tmp / "r", "--backend", "local", "--trainer", "tinker"),
        r"--backend and --trainer name one setting: give one of them",
        code=USAGE_ERROR,
    ),
    Case(
        "two-distributions-claim-one-plugin-name",
        lambda w, tmp: small(w, tmp / "r"),
        r"loss 'grpo' is declared by several installed plugins: (grpo-core|grpo-rival-grpo) .*; uninstall all but one",
        env=lambda w: {"PYTHONPATH": w.rival},
    ),
    Case(
        "a-run-whose-reward-always-fails-trains-nothing",
        lambda w, tmp: small(w, tmp / "r", "--reward", "broken"),
        r"nothing was trained: every group was dropped, 4 of them because their reward failed "
        r"\(last: reward 'broken' raised ConnectionError: the grading service is down\); fix the reward and start again",
        env=plugins_site,
    ),
    Case(
        "a-run-whose-groups-all-have-equal-rewards-trains-nothing",
        lambda w, tmp: small(w, tmp / "r", "--drop-zero-variance-groups"),
        r"nothing was trained: all 2 steps dropped every group \(4 had equal rewards: no signal\); make the rewards within "
        r"a group differ \(more --completions-per-prompt, a higher --temperature, easier prompts, a reward with partial credit\)",
        after=lambda w, tmp: json.loads((tmp / "r" / "summary.json").read_text())["steps"] == 2 or pytest.fail("no summary"),
    ),
    # -- a secret stays *** in an error --------------------------------------------------------
    Case(
        "secret-in-an-option-error",
        lambda w, tmp: small(w, tmp / "r", "--reward", "gsm8k", "--reward", "format", "--reward-opt", "api_key=sk-live-123"),
        r"--reward-opt 'api_key=\*\*\*': several reward plugins are selected \(gsm8k, format\); write NAME.api_key=\*\*\*",
    ),
    # -- a user's mistake is exit 1, saying what to do -------------------------------------------
    Case(
        "empty-weights",
        lambda w, tmp: small_run_args(w.empty_weights, w.data, tmp / "r"),
        r"model folder \S+: model.safetensors is empty; copy or download it again",
    ),
    Case(
        "weights-cut-short",
        lambda w, tmp: small_run_args(w.cut_weights, w.data, tmp / "r"),
        r"model folder \S+: model.safetensors is cut short \(5000 of \d+ bytes\); copy or download it again",
    ),
    Case(
        "model-folder-without-a-tokenizer",
        lambda w, tmp: small_run_args(w.no_tokenizer, w.data, tmp / "r"),
        r"model folder \S+ holds no tokenizer \(tokenizer.json, .*\): save the model's tokenizer beside its weights .*",
    ),
    Case(
        "a-run-folder-as-the-model",
        lambda w, tmp: small_run_args(w.done, w.data, tmp / "r"),
        r"--model \S+/done is a grpo-core run folder, not a model: its trained policy is \S+/done/final",
    ),
    Case(
        "eval-a-run-folder-as-the-model",
        lambda w, tmp: ["eval", "--model", w.done, "--dataset", w.data],
        r"--model \S+/done is a grpo-core run folder, not a model: its trained policy is \S+/done/final",
    ),
    Case(
        "eval-weights-cut-short",
        lambda w, tmp: ["eval", "--model", w.cut_weights, "--dataset", w.data],
        r"model folder \S+: model.safetensors is cut short \(5000 of \d+ bytes\); copy or download it again",
    ),
    Case(
        "a-text-file-named-parquet",
        lambda w, tmp: small_run_args(w.model, w.fake_parquet, tmp / "r"),
        r"\S+rows.parquet: not a readable Parquet file \(.*\); JSONL rows go in a .jsonl file",
    ),
    Case(
        "config-json-cut-short-on-resume",
        lambda w, tmp: ["run", "--resume", str(tmp / "run")],
        r"\S+/run/config.json cannot be read \(.*\): it was cut short or edited; restore it from a copy",
        setup=cut_config,
    ),
    Case(
        "plugin-options-as-a-value-in-toml",
        lambda w, tmp: [*small(w, tmp / "r"), "--config", str(tmp / "run.toml")],
        r"\S+run.toml: \[loss\] cispo = 1: a plugin's options go in a table of their own, \[loss.cispo\] .*",
        setup=toml("[loss]\ncispo = 1\n"),
    ),
    Case(
        "a-reward-returning-strings-is-named-with-its-distribution",
        lambda w, tmp: small(w, tmp / "r", "--reward", "wordy"),
        r"reward plugin 'wordy' from grpo-adversarial-plugins 1.2.3 returned '0.5' \(str\) as a score: "
        r"a reward returns a number per sample \(None when it cannot score one\)",
        env=plugins_site,
    ),
    Case(
        "a-loss-returning-a-float-is-named-with-its-distribution",
        lambda w, tmp: small(w, tmp / "r", "--loss", "float", "--no-drop-zero-variance-groups"),
        r"loss plugin 'float' from grpo-adversarial-plugins 1.2.3 returned float [-\d.e]+: "
        r"a loss returns LossOutput\(loss=<0-d tensor>, metrics=\{...\}\)",
        env=plugins_site,
    ),
    Case(
        "out-of-memory",
        lambda w, tmp: small(w, tmp / "r", "--loss", "hungry", "--no-drop-zero-variance-groups"),
        r"out of memory \(.*can't allocate memory.*\); make a step smaller \(--max-samples-per-fwd-bwd N .*",
        env=plugins_site,
    ),
    Case(
        "resume-a-finished-run-changes-nothing",
        lambda w, tmp: ["run", "--resume", str(tmp / "run"), "--max-steps", "1"],
        r"the run in \S+ is complete at step 2 of 1; pass --max-steps > 2 to train further",
        setup=copy_done,
        after=lambda w, tmp: [
            (tmp / "run" / name).read_bytes() == (w.done / name).read_bytes() or pytest.fail(f"{name} changed")
            for name in ("config.json", "metrics.jsonl", "summary.json")
        ],
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_input_ends_in_its_class_with_one_readable_line(world, tmp_path, case):
    if case.setup:
        case.setup(world, tmp_path)
    env, cwd = case.env(world) if case.env else None, case.cwd(tmp_path) if case.cwd else None
    out = grpo_core(*map(str, case.args(world, tmp_path)), env=env, cwd=cwd, timeout=300)
    assert "Traceback" not in out.stderr
    assert out.returncode == case.code, out.stderr
    lines = out.stderr.strip().splitlines()
    prefix = "Error: " if case.code == USAGE_ERROR else "error: "
    (at,) = [i for i, line in enumerate(lines) if line.startswith(prefix)]
    assert all(line.startswith("  ") for line in lines[at + 1 :]), out.stderr  # what follows it: indented details
    assert re.fullmatch(prefix + case.line, lines[at]), lines[at]
    if case.after:
        case.after(world, tmp_path)


@pytest.mark.slow
def test_a_conflicting_plugin_name_is_listed_with_both_distributions(world):
    out = grpo_core("plugins", "--json", env={"PYTHONPATH": world.rival})
    assert out.returncode == 0, out.stderr
    grpo = [i for i in json.loads(out.stdout) if (i["kind"], i["name"]) == ("loss", "grpo")]
    assert sorted(i["distribution"] for i in grpo) == ["grpo-core", "grpo-rival-grpo"]
    assert all("grpo-core run refuses 'grpo' until one is uninstalled" in i["conflict"] for i in grpo)
    text = grpo_core("plugins", env={"PYTHONPATH": world.rival}).stdout
    assert text.count("loss grpo  (") == 2 and "CONFLICT" in text


@pytest.mark.slow
def test_a_run_in_which_one_group_trained_ends_well(world, tmp_path):
    out = grpo_core(*small(world, tmp_path / "r", "--drop-zero-variance-groups", "--reward", "once"), env=plugins_site(world))
    assert out.returncode == 0, out.stderr
    metrics = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["groups/kept"], m["groups/dropped_zero_variance"]) for m in metrics] == [(1, 1), (0, 2)]
    assert "nothing was trained" not in out.stderr


def test_nothing_trained_names_every_reason_and_spares_a_resumed_or_interrupted_run():
    import signal

    from grpo_core.outcome import nothing_trained
    from grpo_core.types import RunState

    def run(step=3, start_step=0, trained=0.0, interrupted=False, **dropped):
        # A trained group here had tokens trained (test_a_run_that_trains_no_token_* covers kept groups with none).
        state = RunState(
            run_dir=Path("."), step=step, start_step=start_step, signal=signal.SIGINT if interrupted else None,
            groups_trained=trained, tokens_trained=trained * 10, groups_dropped=dropped,
        )  # fmt: skip
        return SimpleNamespace(state=state)

    assert nothing_trained(run(zero_variance=4.0, no_threes=2.0, skipped=1.0, failed=0.0)) == (
        "nothing was trained: all 3 steps dropped every group (4 had equal rewards: no signal, 2 by the group filter "
        "'no_threes', 1 had no samples); make the rewards within a group differ (more --completions-per-prompt, "
        "a higher --temperature, easier prompts, a reward with partial credit)"
    )
    assert nothing_trained(run(step=1, zero_variance=2.0)).startswith("nothing was trained: its one step dropped every group (2 had")
    assert nothing_trained(run(failed=2.0, zero_variance=1.0)).startswith(
        "nothing was trained: every group was dropped, 2 of them because their reward failed (last: a reward returned None/NaN)"
    )
    assert nothing_trained(run(start_step=2, failed=1.0)).startswith("nothing was trained: every group was dropped, 1 of them")
    for fine in (run(trained=1.0, zero_variance=5.0), run(start_step=2, zero_variance=1.0), run(interrupted=True, zero_variance=3.0)):
        assert nothing_trained(fine) is None
    assert nothing_trained(run(step=2, start_step=2)) is None  # resumed at its last step: no step ran


@pytest.mark.slow
def test_resume_refuses_a_dataset_that_changed_and_continues_on_the_same_one(world, tmp_path):
    data, run_dir = tmp_path / "mine.jsonl", tmp_path / "run"
    shutil.copy(world.data, data)
    assert grpo_core(*small(world, run_dir, "--max-steps", "1"), "--dataset", str(data)).returncode == 0
    recorded = json.loads((run_dir / "data.json").read_text())
    assert (recorded["dataset"], recorded["prompts"]) == (str(data), 36) and len(recorded["sha256"]) == 64
    original = data.read_bytes()
    data.write_bytes(original.replace(b"what is 0 plus 0?", b"what is 0 plus 9?", 1))
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}
    out = grpo_core("run", "--resume", str(run_dir), "--max-steps", "2")
    assert out.returncode == USER_ERROR and "Traceback" not in out.stderr
    assert re.fullmatch(
        rf"error: --resume {run_dir}: the dataset {data} changed since the run started \(the same 36 prompts in number, their "
        rf"content differs; sha256 of its rows {recorded['sha256'][:12]}\.\.\. then, [0-9a-f]{{12}}\.\.\. now\); resume with "
        r"the data the run started on, or start a new run with this data \(another --run-dir\)",
        out.stderr.strip().splitlines()[-1],
    )
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"} == before
    data.write_bytes(original)
    out = grpo_core("run", "--resume", str(run_dir), "--max-steps", "2")
    assert out.returncode == 0, out.stderr
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_changed_row_count_is_named_and_a_run_without_a_record_resumes(tmp_path):
    from grpo_core.errors import PluginError
    from grpo_core.run_dir import DATA_FILE, check_same_data, record_data

    check_same_data(tmp_path, "d.jsonl", 3, "a" * 64)  # a run from before data.json: nothing to compare
    record_data(tmp_path, "d.jsonl", 3, "a" * 64)
    check_same_data(tmp_path, "d.jsonl", 3, "a" * 64)
    with pytest.raises(PluginError, match=r"the dataset d.jsonl changed since the run started \(3 prompts then, 2 now; "):
        check_same_data(tmp_path, "d.jsonl", 2, "b" * 64)
    (tmp_path / DATA_FILE).write_text('{"dataset": "d.jsonl"')
    with pytest.raises(PluginError, match=rf"{DATA_FILE} cannot be read \(JSONDecodeError: .*\): it was cut short or edited"):
        check_same_data(tmp_path, "d.jsonl", 3, "a" * 64)


def test_the_rows_fingerprint_sees_every_field_and_the_order():
    from grpo_core.data import rows_fingerprint
    from grpo_core.types import Prompt

    rows = [Prompt("a:1", text="1+1?", answer="2"), Prompt("a:2", messages=[{"role": "user", "content": "2+2?"}], answer="4")]
    base = rows_fingerprint(rows)
    assert base == rows_fingerprint([Prompt("a:1", text="1+1?", answer="2"), rows[1]])
    changed = [
        [Prompt("a:1", text="1+1?", answer="3"), rows[1]],
        [Prompt("a:1", text="1+2?", answer="2"), rows[1]],
        [Prompt("a:9", text="1+1?", answer="2"), rows[1]],
        [Prompt("a:1", text="1+1?", answer="2", metadata={"level": 1}), rows[1]],
        [rows[1], rows[0]],
        rows[:1],
    ]
    assert len({base, *map(rows_fingerprint, changed)}) == len(changed) + 1


# -- every wait has a deadline ---------------------------------------------------------------------


class SilentServer:
    """Accepts connections on 127.0.0.1 and never answers (a server stuck before its first reply)."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self.accept, daemon=True)
        self.thread.start()

    def accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.listener.close()
        for conn in self.held:
            conn.close()


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed once the block ends: connections are refused


DEADLINE = 4.0
STARTUP = 40.0
"""Seconds a run may take to reach its first contact (imports, the tiny model) on a busy machine."""


@pytest.mark.slow
@pytest.mark.parametrize("server", ["closed-port", "never-answers"])
def test_a_sampler_server_that_is_down_or_silent_stops_the_run_within_its_deadline(world, tmp_path, server):
    silent = SilentServer() if server == "never-answers" else None
    url = silent.url if silent else closed_port()
    try:
        started = time.monotonic()
        out = grpo_core(*small(world, tmp_path / "r", "--sampler", "openai", "--sampler-opt", f"base_url={url}",
                               "--sampler-opt", f"connect_deadline={DEADLINE:g}"), timeout=300)  # fmt: skip
        elapsed = time.monotonic() - started
    finally:
        if silent:
            silent.close()
    assert out.returncode == 1, out.stderr
    reason = "ReadTimeout" if silent else "ConnectError: All connection attempts failed"
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: the sampler server at {url} did not answer GET /v1/models within {DEADLINE:g}s (--sampler-opt connect_deadline): "
        f"{reason}; check that the server is running and ready, and that base_url is its address and port"
    )
    assert DEADLINE <= elapsed < DEADLINE + STARTUP
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_tinker_service_that_cannot_be_reached_stops_the_run_within_its_deadline(world, tmp_path):
    pytest.importorskip("tinker")
    url = closed_port()
    started = time.monotonic()
    out = grpo_core(*small(world, tmp_path / "r", "--trainer", "tinker", "--trainer-opt", f"base_url={url}",
                           "--trainer-opt", f"connect_deadline={DEADLINE:g}"), env={"TINKER_API_KEY": "tml-test"}, timeout=300)  # fmt: skip
    elapsed = time.monotonic() - started
    assert out.returncode == 1, out.stderr
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: the Tinker service at {url} did not answer within {DEADLINE:g}s (--trainer-opt connect_deadline); check that")
    )
    assert elapsed < DEADLINE + STARTUP


def test_the_default_first_contact_deadlines_are_well_under_a_minute():
    from grpo_core import make_plugin

    assert make_plugin("openai", kind="sampler").connect_deadline == 30.0
    pytest.importorskip("tinker")
    assert make_plugin("tinker", kind="backend").connect_deadline == 30.0


# -- a run folder in use -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("command", ["run", "resume", "export"])
def test_a_run_folder_held_by_another_process_is_refused_naming_it(world, tmp_path, command):
    from grpo_core.run_dir import locked

    run_dir = tmp_path / "run"
    shutil.copytree(world.done, run_dir)
    args = {
        "run": small(world, run_dir, "--overwrite"),
        "resume": ["run", "--resume", str(run_dir), "--max-steps", "3"],
        "export": ["export", str(run_dir), str(tmp_path / "out")],
    }[command]
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}
    with locked(run_dir):  # this test's process holds it, as a running run would
        out = grpo_core(*map(str, args))
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: run directory {run_dir} is in use by process {os.getpid()} (a grpo-core run holds its lock); "
        "wait for it to end, or stop it first"
    )
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"} == before
    assert not (tmp_path / "out").exists()


def test_run_help_describes_the_lock_the_deadlines_and_the_exit_codes():
    from tests.helpers import grpo_core_in_process

    text = " ".join(grpo_core_in_process("run", "--help").stdout.split())
    assert "A run holds a lock on its folder (RUN_DIR/.lock, with its PID) while it runs" in text
    assert "A server's first contact must succeed within its connect_deadline (openai sampler, tinker trainer: 30 s)" in text
    assert "--resume refuses a dataset whose rows changed since the run started (RUN_DIR/data.json" in text
    assert "A run that trained nothing (every group of every step dropped: its reward failed, or equal rewards" in text
    assert "Exit codes: 0 done; 1 an error you can fix" in text and "3 internal error of grpo-core" in text


def test_eval_refuses_a_pass_threshold_that_is_no_number():
    from tests.helpers import grpo_core_in_process

    out = grpo_core_in_process("eval", "--pass-threshold", "nan")
    assert out.returncode == USAGE_ERROR
    assert out.stderr.strip().splitlines()[-1] == "Error: Invalid value for '--pass-threshold': expected a finite number, got nan"
