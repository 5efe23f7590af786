"""The docs site builds with warnings as errors, and its reference pages follow the code."""

from __future__ import annotations

import html
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import attrs
import pytest

from grpo_core import hookimpl, option
from grpo_core.plugins.loggers.console import ConsoleLogger
from tests.conftest import REPO
from tests.helpers import grpo_core, grpo_core_in_process


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site_dir = tmp_path_factory.mktemp("site")
    build_in_process(site_dir)  # strict: any warning aborts the build (test_a_broken_link_fails_the_build)
    return site_dir


def text_of(html_file) -> str:
    """A page's visible text, roughly: tags dropped, entities left."""
    return re.sub(r"<[^>]+>", "", html_file.read_text())


def test_every_page_of_the_nav_is_built(site):
    for page in ("index", "quickstart/index", "concepts/index", "reference/plugins/index", "reference/hooks/index",
                 "writing-plugins/index", "datasets/index", "benchmarks/index", "losses/index", "async/index", "scaling-out/index",
                 "performance/index", "coming-from-cookbook/index"):  # fmt: skip
        assert (site / f"{page}.html").is_file(), page


def test_the_plugin_reference_shows_what_grpo_core_plugins_lists(site):
    listed = json.loads(grpo_core_in_process("plugins", "--json").stdout)
    built_in = [p for p in listed if p["distribution"] == "grpo-core"]
    page = (site / "reference" / "plugins" / "index.html").read_text()
    assert len(built_in) >= 20
    for plugin in built_in:
        section = page.split(f'id="{plugin["kind"]}-{plugin["name"]}"', 1)[1].split("<h3", 1)[0]
        for opt in plugin["options"]:
            row = section.split(f"<td><code>{opt['name']}</code></td>", 1)[1].split("</tr>", 1)[0]
            assert f"<code>{opt['default']!r}</code>" in html.unescape(row), (plugin["name"], opt)


def test_the_hooks_page_has_every_hook_with_its_parameters(site):
    from grpo_core import hookspecs

    text = text_of(site / "reference" / "hooks" / "index.html")
    for name in ("check_config", "load_tokenizer", "make_trainer", "make_sampler", "make_reference", "weight_sync", "rollout",
                 "reward", "advantage", "loss", "on_run_start", "on_step", "on_run_end"):  # fmt: skip
        assert getattr(hookspecs, name).grpo_core_spec is not None
        assert f"def {name}(" in text
    assert "groups: the step's scored prompt groups" in text and "first result wins" in text


def test_links_to_repository_files_reach_pages_of_the_site(site):
    performance = (site / "performance" / "index.html").read_text()
    # ../benchmarks/README.md: the README of a folder is that folder's page.
    assert 'href="../repo/benchmarks/"' in performance
    readme = site / "repo" / "benchmarks" / "index.html"
    assert "What it measures" in text_of(readme)
    # A link from a repository file back into docs/ reaches the docs page.
    assert 'href="../../performance/"' in readme.read_text()
    # Any other file shows as its source.
    assert "def on_step(step: int" in html.unescape(text_of(site / "repo" / "core" / "hookspecs.py" / "index.html"))


def build_in_process(site_dir, docs_dir=None) -> None:
    from mkdocs.commands.build import build as build_site
    from mkdocs.config import load_config

    overrides = {"docs_dir": str(docs_dir)} if docs_dir else {}
    build_site(load_config(str(REPO / "mkdocs.yml"), site_dir=str(site_dir), strict=True, **overrides))


def test_a_broken_link_fails_the_build(tmp_path, caplog):
    from mkdocs.exceptions import Abort

    docs = tmp_path / "docs"
    shutil.copytree(REPO / "docs", docs)
    (docs / "quickstart.md").write_text((docs / "quickstart.md").read_text() + "\n[nowhere](no-such-page.md)\n")
    with pytest.raises(Abort, match="1 warnings in strict mode"):
        build_in_process(tmp_path / "site", docs)
    assert "contains a link 'no-such-page.md', but the target is not found" in caplog.text


@attrs.define
class ChangedConsole(ConsoleLogger):
    """The console logger as a later version might have it."""

    every: int = option(5, help="print a line every N steps off a terminal")
    color: bool = option(True, help="colored output")

    @hookimpl
    def on_step(self, step, metrics, state):
        pass


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_pages", REPO / "docs" / "gen_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def console_section(page: str) -> str:
    return page.split("### console {#logger-console}", 1)[1].split("\n### ", 1)[0]


def test_the_plugin_reference_changes_when_a_plugin_options_change(monkeypatch, tmp_path):
    import grpo_core.plugin_info
    from grpo_core.plugins_manager import catalog

    generator = load_generator()
    before = generator.plugin_reference()
    assert "| `every` | `1` | print a line every N steps when not on a terminal |" in console_section(before)
    entries = tuple(attrs.evolve(e, target=f"{__name__}:ChangedConsole") if e.qualified_name == "logger.console" else e for e in catalog())
    monkeypatch.setattr(grpo_core.plugin_info, "catalog", lambda: entries)
    after = generator.plugin_reference()
    section = console_section(after)
    assert "| `every` | `5` | print a line every N steps off a terminal |" in section
    assert "| `color` | `True` | colored output |" in section
    assert "The console logger as a later version might have it." in section
    assert before.replace(console_section(before), section) == after  # nothing else changed
    # And so does the page of the site built from it.
    build_in_process(tmp_path / "site")
    page = (tmp_path / "site" / "reference" / "plugins" / "index.html").read_text()
    assert "<td><code>color</code></td>" in page and "print a line every N steps off a terminal" in page


# --------------------------------------------------------------------------------------------
# The commands the docs show, run as written
# --------------------------------------------------------------------------------------------

DOC_PAGES = ("README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")))
COMMAND = re.compile(r"(?:[A-Z_]+=\S+ )*(?:grpo-core [a-z]|python |pip |torchrun )")
"""A command line of a shell block: grpo-core, python, pip or torchrun after optional VAR=value
settings (a table row of grpo-core's output starts "grpo-core  138.61", so not a command)."""

NETWORK = "downloads a model from the Hugging Face hub (no network in the tests)"
USER_FILE = "trains on the reader's own data file, which the docs do not ship"
PIP = "installs packages (network); the test environment already has the extras"
BENCHMARK = "a benchmark: minutes of timing on purpose; benchmarks/ scripts are not usage examples"
SERVER = "needs a server (an inference, reward or judge endpoint) the docs assume is running"
SKIPPED = {
    "README.md": {
        'grpo-core run --model Qwen/Qwen3-0.6B --dataset gsm8k.jsonl --prompt-template "{prompt}" --learning-rate 1e-6': NETWORK,
        "grpo-core eval --model runs/<time>/final --dataset test.jsonl --reward gsm8k -n 4": USER_FILE,
        "pip install ./packages/grpo-reward-sympy && grpo-core run --reward sympy": PIP,
    },
    "docs/benchmarks.md": {
        "python benchmarks/run.py": BENCHMARK,
        "python benchmarks/run.py --config overhead": BENCHMARK,
        "python benchmarks/run.py --config real --lock /tmp/grpo-bigmem.lock --nice 5": BENCHMARK,
        "python benchmarks/sweep.py": BENCHMARK,
        "python benchmarks/profile_step.py --config compute --contender grpo-core": BENCHMARK,
    },
    "docs/coming-from-cookbook.md": {
        "grpo-core run --config docs/examples/cookbook.toml --model Qwen/Qwen3-0.6B --dataset gsm8k.jsonl": NETWORK,
    },
    "docs/datasets.md": {
        "grpo-core run --dataset https://example.com/math/rows.jsonl --fetch-timeout 120": (
            "fetches from the network (tests/core/test_data_url.py serves rows on 127.0.0.1)"
        ),
    },
    "docs/index.md": {'pip install torch==2.13.0 -e ".[test]"': PIP},
    "docs/moe.md": {
        # The loop around it sets $seed and $mode; its model comes from the command before.
        "python scripts/build_moe_model.py --out /tmp/tiny-qwen3-moe": "writes outside the run's folder (/tmp); tests/scripts build it",
        "grpo-core run --model /tmp/tiny-qwen3-moe --dataset default --dtype bfloat16 --seed $seed --max-steps 1 "
        "--prompt-groups-per-step 8 --completions-per-prompt 8 --max-completion-tokens 24 --no-drop-zero-variance-groups "
        "--router-replay $mode --run-dir /tmp/moe-$mode-$seed --overwrite --logger jsonl": "the body of a shell loop: $seed, $mode",
    },
    "docs/multi-turn.md": {
        "grpo-core run --rollout multi_turn --tool calculator --model Qwen/Qwen2.5-0.5B-Instruct --dataset gsm8k.jsonl": NETWORK,
        "grpo-core run --rollout multi_turn --env retry_math --model Qwen/Qwen3-0.6B --rollout-opt enable_thinking=false": NETWORK,
        "grpo-core run --rollout multi_turn --env retry_math --model Qwen/Qwen3-0.6B": NETWORK,
        "grpo-core run --rollout multi_turn --tool calculator --model meta-llama/Llama-3.2-1B-Instruct --dataset gsm8k.jsonl": NETWORK,
        'pip install -e ".[reasoning-gym]"': PIP,
        "grpo-core run --model Qwen/Qwen3-0.6B --dataset reasoning_gym:basic_arithmetic=2,chain_sum=1:5000 --reward reasoning_gym "
        "--eval-every 20 --eval-dataset reasoning_gym:basic_arithmetic=2,chain_sum=1:200:test": NETWORK,
        'pip install -e ".[verifiers]"': PIP,
        "python -m grpo_core.plugins.envs.verifiers my_tasks:MathTaskset rows.jsonl": "my_tasks is the reader's own module",
        "PYTHONPATH=. grpo-core run --dataset rows.jsonl --rollout multi_turn --env verifiers --env-opt taskset=my_tasks:MathTaskset": (
            "my_tasks is the reader's own module"
        ),
    },
    "docs/agents.md": {
        'grpo-core run --rollout agent --rollout-opt command="python examples/agent.py" --prompt-groups-per-step 2 '
        "--completions-per-prompt 4 --max-steps 3": "run by tests/plugins/rollouts/test_agent.py, which checks that every step trains",
    },
    "docs/performance.md": {},  # filled below: every command there is a benchmark
    "docs/quickstart.md": {
        'pip install torch==2.13.0 -e ".[test]"': PIP,
        'grpo-core run --model Qwen/Qwen3-0.6B --dataset gsm8k.jsonl --prompt-template "{prompt}" --learning-rate 1e-6': NETWORK,
        'pip install -e ".[tensorboard]"': PIP,
        'pip install -e ".[wandb]"': PIP,
        "grpo-core run --logger console --logger jsonl --logger wandb --logger-opt wandb.project=my-project": (
            "logs to wandb.ai (network, an account)"
        ),
        "grpo-core eval --model runs/<time>/final --dataset test.jsonl --reward gsm8k -n 4": USER_FILE,
    },
    "docs/rewards.md": {
        "python examples/reward_server.py 8100 &": "starts a server for the next command (tests/plugins/rewards/test_http.py runs one)",
        "grpo-core run --reward http --reward-opt url=http://127.0.0.1:8100/score": SERVER,
        "grpo-core run --reward http --reward-opt url=https://rewards.example.com/score --reward-opt headers=env:REWARD_HEADERS": SERVER,
        "grpo-core run --reward judge --reward-opt base_url=http://127.0.0.1:8001 --reward-opt models=Qwen/Qwen3-8B": SERVER,
        "grpo-core run --reward reward_model --reward-opt model=Skywork/Skywork-Reward-V2-Qwen3-0.6B": NETWORK,
        "pip install ./packages/grpo-reward-math-verify": PIP,
        "grpo-core run --reward math_verify --dataset math.jsonl": USER_FILE,
    },
    "docs/scaling-out.md": {},  # filled below: every command there needs a server, GPUs, several hosts or a hub model
}
SHORTENED = {
    # 20 steps of CISPO show nothing two do not: the loss and its option in the run's config and line.
    "grpo-core run --loss cispo --loss-opt eps_high=0.28 --max-steps 20": (
        "grpo-core run --loss cispo --loss-opt eps_high=0.28 --max-steps 2"
    ),
    # A stopped run continued: 200 steps would train 198 more on CPU; one more shows the resume.
    "grpo-core run --resume runs/<time> --max-steps 200": "grpo-core run --resume runs/<time> --max-steps 3",
    # 50 distillation steps take minutes on two CPU cores; two show the teacher loads and trains.
    "grpo-core run --advantage distill --advantage-opt teacher=runs/distill-teacher --max-steps 50": (
        "grpo-core run --advantage distill --advantage-opt teacher=runs/distill-teacher --max-steps 2"
    ),
}
DEFAULT_STEPS = ("--max-steps", "2")
"""Added to a run that gives no --max-steps: the embedded task's 100 steps take minutes each on
two CPU cores, times ~20 commands; what a command shows is its flags working, not 100 steps."""


def documented_commands() -> list[tuple[str, str]]:
    """(page, command) for every command line of the docs' shell blocks, in order: continuation
    lines joined, the trailing comment dropped, spaces collapsed."""
    found = []
    for page in DOC_PAGES:
        text = (REPO / page).read_text()
        for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
            if lang not in ("bash", "sh", ""):
                continue
            for line in re.sub(r"\\\n\s*", " ", body).splitlines():
                line = re.sub(r"\s+#\s.*$", "", line.strip())
                if COMMAND.match(line):
                    found.append((page, " ".join(line.split())))
    return found


def skip_reason(page: str, command: str) -> str | None:
    if page == "docs/performance.md":
        return BENCHMARK
    if page == "docs/scaling-out.md":
        return "a server, GPUs, several hosts or a hub model (fsdp on gloo: tests/plugins/backends)"
    return SKIPPED.get(page, {}).get(command)


def test_every_documented_command_is_run_or_skipped_with_a_reason():
    documented = documented_commands()
    assert len(documented) > 60
    for page, commands in SKIPPED.items():
        for command in commands:
            assert (page, command) in documented, f"{page}: the skip list names a command the page no longer shows: {command}"
    runnable = [c for c in documented if skip_reason(*c) is None]
    assert len(runnable) >= 20, runnable


def run_command(command: str, cwd) -> subprocess.CompletedProcess:
    """``command`` as a shell would run it in ``cwd``: grpo-core in process, python in a new one."""
    settings, args = {}, shlex.split(command)
    while "=" in args[0]:
        name, _, value = args.pop(0).partition("=")
        settings[name] = value
    if args[0] == "python":
        return subprocess.run([sys.executable, *args[1:]], cwd=cwd, env={**os.environ, **settings}, capture_output=True, text=True)
    assert args[0] == "grpo-core", command
    if args[1] == "run" and "--max-steps" not in args:
        args += DEFAULT_STEPS
    if "fsdp" in args or "--resume" in args:
        # fsdp's process group lives as long as its process, as in a shell where each command is
        # one; a resumed run may be an fsdp one.
        return grpo_core(*args[1:], env=settings, cwd=cwd)
    return grpo_core_in_process(*args[1:], env=settings, cwd=cwd)


def pages_with_runnable_commands() -> list[str]:
    return sorted({page for page, command in documented_commands() if skip_reason(page, command) is None})


@pytest.mark.slow
@pytest.mark.parametrize("page", pages_with_runnable_commands())
def test_the_commands_of_a_page_run_as_written(page, tmp_path):
    """The page's commands in order, in a folder that holds the repository's files (the docs run
    from a clone) and what the commands before wrote (a run's folder, rows.jsonl, a teacher);
    runs/<time> is the last run the page's commands wrote on the embedded task, run.toml and async.toml the presets
    the page shows."""
    for entry in REPO.iterdir():
        if entry.name not in ("runs", ".git", ".venv"):
            (tmp_path / entry.name).symlink_to(entry)
    write_presets(page, tmp_path)
    ran = 0
    for command in [c for p, c in documented_commands() if p == page and skip_reason(p, c) is None]:
        command = SHORTENED.get(command, command)
        if "<time>" in command:
            # The docs' runs/<time> is a run of the embedded task ("embedded task: its test split"), not
            # the wandb one: resuming that needs the WANDB_MODE=offline its command line set.
            configs = {r: json.loads((r / "config.json").read_text()) for r in (tmp_path / "runs").iterdir()}
            embedded = [r for r, c in configs.items() if c["dataset"] == "default" and "wandb" not in c["logger"]]
            latest = max(embedded, key=lambda run: run.stat().st_mtime)
            command = command.replace("runs/<time>", f"runs/{latest.name}")
        out = run_command(command, tmp_path)
        assert out.returncode == 0, f"{page}: {command}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        assert out.stdout.strip() or out.stderr.strip(), command  # it says something
        if command.startswith("grpo-core run"):
            assert "run directory:" in out.stdout, (command, out.stdout[-1000:])
        ran += 1
    assert ran


def write_presets(page: str, folder) -> None:
    """The TOML files the page's commands name (``--config run.toml``), from the page's blocks."""
    text = (REPO / page).read_text()
    for name in re.findall(r"--config (\S+\.toml)", text):
        if (folder / name).exists():
            continue
        blocks = re.findall(r"^```toml\n(.*?)^```", text, flags=re.S | re.M)
        preset = [b for b in blocks if re.match(r"\s*(#.*\n)?\s*\w+ = ", b) and "[project" not in b]
        assert preset, f"{page} names --config {name} but shows no TOML block for it"
        (folder / name).write_text(preset[0])
