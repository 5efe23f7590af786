"""Against a real Tinker-API server: skyrl 0.3.0 (JAX on the CPU) on 127.0.0.1, reached with
tinker==0.24.1, the SDK whose protocol it speaks.

The first run builds two cached virtualenvs (tests/integration/tinker_server.py); each server
start takes seconds. This process (whatever tinker SDK the project venv has) starts the server;
every check that talks to it runs in the client venv, as ``python this_file.py CHECK ARGS`` (a
function below) or as the real ``grpo-core`` CLI, and reports back as JSON.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# After the insert: run as `python test_tinker.py CHECK` in the client venv, the repository root is not on sys.path.
from tests.integration.tinker_server import TinkerServer, client_env, ensure_client_venv, ensure_server_venv  # noqa: E402

pytestmark = [pytest.mark.tinker, pytest.mark.slow]

RANK = 8
"""skyrl takes LoRA ranks up to the server's max_lora_rank (8 here)."""
ASSETS = ROOT / "core" / "assets" / "default"
MAPPED = {"importance_sampling": {}, "dapo": {}, "grpo": {"kl_beta": 0.0}, "cispo": {}}
"""Each loss the backend maps to a service built-in (importance_sampling, ppo, ppo, cispo), with the options that allow it."""


# ------------------------------------------------------------------------------------------------
# Server side (this process)


@pytest.fixture(scope="session")
def client_python():
    return ensure_client_venv()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ensure_server_venv()
    # Each training and sampling client holds an adapter slot until its session times out
    # (slot 0 is the base model's): room for every client this module opens.
    # A fixed sampling batch: JAX compiles the sampler once per length instead of once per batch size.
    server = TinkerServer(ASSETS, tmp_path_factory.mktemp("skyrl"), max_lora_adapters=32, max_lora_rank=RANK, sample_max_num_sequences=32)
    print(f"skyrl started in {server.start():.1f}s")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(client_python, server, tmp_path_factory):
    env = client_env(tmp_path_factory.mktemp("client-path"))

    def call(check: str, **kwargs) -> dict:
        out = subprocess.run(
            [str(client_python), __file__, check, json.dumps({"url": server.url, **kwargs})],
            capture_output=True, text=True, env=env, timeout=900, check=False,
        )  # fmt: skip
        assert out.returncode == 0, f"{check} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}\nserver log: {server.log}"
        return json.loads(out.stdout.strip().splitlines()[-1])

    def cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(client_python), "-m", "grpo_core.cli", *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
        )

    call.cli = cli
    call.url = server.url
    return call


def test_client_runs_the_sdk_skyrl_speaks(client):
    assert client("sdk_version") == {"tinker": "0.24.1", "adapter": [0, 24]}


def test_unit_tests_pass_with_the_sdk_skyrl_speaks(client_python, tmp_path_factory):
    """The adapter's other branch: the fake-client tests under tinker==0.24.1 (this process has the current SDK)."""
    tests = ["tests/plugins/backends/test_tinker.py", "tests/plugins/samplers/test_tinker.py"]
    out = subprocess.run(
        # -o addopts=: not the checkout's two xdist workers (the client venv has no pytest-xdist).
        [str(client_python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *tests],
        capture_output=True, text=True, cwd=ROOT, env=client_env(tmp_path_factory.mktemp("unit-client")), timeout=600, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:]
    assert " passed" in out.stdout.splitlines()[-1] and "failed" not in out.stdout.splitlines()[-1]


def test_service_logprobs_agree_with_the_local_trainer_before_any_step(client):
    result = client("logprobs")
    print(f"service vs local trainer logprobs: max |diff| {result['max_abs_diff']:.2e} over {result['tokens']} tokens")
    assert result["tokens"] > 100
    assert result["max_abs_diff"] < 1e-3
    # The reference (base model through a sampling client) scores the same tokens alike.
    assert result["reference_max_abs_diff"] < 1e-3


@pytest.mark.parametrize("loss", sorted(MAPPED))
def test_builtin_and_custom_paths_give_the_same_update(client, loss):
    """Off-policy (an anchor apart from the current policy, so that clip ranges bind): one step
    through the service's built-in, one through forward_backward_custom, on two adapters that
    start equal; the next forward's logprobs agree."""
    result = client("paths", loss=loss, options=MAPPED[loss], on_policy=False)
    print(f"{loss}: service {result['service_losses']}, logprobs after one step differ by {result['after_max_abs_diff']:.2e} "
          f"(the step moved them by {result['moved']:.2e}); loss {result['loss_builtin']:.6f} vs {result['loss_custom']:.6f}; "
          f"{result['seconds_builtin']:.2f}s vs {result['seconds_custom']:.2f}s")  # fmt: skip
    assert result["service_losses"] == [
        {"importance_sampling": "importance_sampling", "dapo": "ppo", "grpo": "ppo", "cispo": "cispo"}[loss]
    ]
    assert result["moved"] > 0.1  # the step changed the policy, so equal logprobs after it mean equal updates
    assert result["after_max_abs_diff"] < 1e-4 * result["moved"]
    assert result["loss_builtin"] == pytest.approx(result["loss_custom"], rel=1e-5, abs=1e-7)
    assert result["calls_builtin"] == {"forward": 0, "forward_backward": 1}
    assert result["calls_custom"] == {"forward": 1, "forward_backward": 1}


def test_on_policy_on_a_sequence_mean_service_takes_the_custom_path(client):
    """skyrl's per-sequence mean scales away cross_entropy weights, and the on-policy anchor is
    known only after a forward: the step goes through the custom path (its gradient carried by
    importance_sampling)."""
    result = client("paths", loss="cispo", options={}, on_policy=True)
    assert result["service_losses"] == ["importance_sampling"]
    assert result["calls_builtin"] == {"forward": 1, "forward_backward": 1}
    assert result["after_max_abs_diff"] < 1e-4 * result["moved"]


def test_a_wrapper_takes_the_custom_path(client):
    result = client("paths", loss="cispo", options={}, wrappers=["tis"], on_policy=False)
    assert result["service_losses"] == ["importance_sampling"]
    assert result["calls_builtin"] == {"forward": 1, "forward_backward": 1}


def test_embedded_task_trains_checkpoints_and_resumes(client, tmp_path):
    """The real CLI, --backend tinker --sampler tinker, on the embedded task (the default loss:
    grpo with its KL term, so the reference runs on the service too)."""
    run_dir = tmp_path / "run"
    # The embedded model by the name the server was started with (the client's copy of the package has another path).
    base = ["--backend", "tinker", "--sampler", "tinker", "--backend-opt", f"base_url={client.url}", "--backend-opt", f"rank={RANK}",
            "--backend-opt", "loss_reduction=sequence_mean", "--backend-opt", f"base_model={ASSETS}"]  # fmt: skip
    args = ["run", *base, "--learning-rate", "3e-3", "--prompt-groups-per-step", "4", "--completions-per-prompt", "8",
            "--max-completion-tokens", "16", "--checkpoint-every", "3", "--run-dir", str(run_dir)]  # fmt: skip
    started = time.monotonic()
    out = client.cli(*args, "--max-steps", "6")
    assert out.returncode == 0, out.stderr[-5000:]
    print(f"6 steps in {time.monotonic() - started:.0f}s")
    for text in [(run_dir / "config.json").read_text(), out.stdout, out.stderr]:
        assert "tml-" not in text  # the key is never written or printed
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print("reward", [round(m["reward/total"], 3) for m in metrics], "loss", [m.get("loss/total") for m in metrics])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reward_last"] > summary["reward_first"]
    assert all(m["policy/version"] == i + 1 for i, m in enumerate(metrics))
    assert any(m.get("kl/mean", 0) > 0 for m in metrics)  # the reference (base model on the service) scored the samples
    state = json.loads((run_dir / "checkpoints" / "step-000006" / "trainer").read_text())
    assert state["tinker_path"].startswith("tinker://") and state["version"] == 6
    assert json.loads((run_dir / "final" / "tinker_weights.json").read_text())["tinker_path"].startswith("tinker://")
    assert (run_dir / "final" / "model.safetensors").exists() and (run_dir / "final" / "config.json").exists()

    out = client.cli("run", "--resume", str(run_dir), "--max-steps", "8")
    assert out.returncode == 0, out.stderr[-5000:]
    resumed = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(resumed) == 8 and resumed[:6] == metrics
    assert [m["policy/version"] for m in resumed[6:]] == [7, 8]  # the trainer went on from the saved version 6


def test_an_agent_program_trains_through_the_gateway_in_front_of_the_service(client, client_python, tmp_path):
    """``--rollout agent`` with ``--sampler tinker`` behind its gateway: the program's two calls per
    sample are sampled by the service, with their tokens trained there."""
    agent = ROOT / "tests" / "plugins" / "rollouts" / "agents" / "two_turn.py"
    run_dir = tmp_path / "run"
    args = ["run", "--backend", "tinker", "--sampler", "tinker", "--backend-opt", f"base_url={client.url}",
            "--backend-opt", f"rank={RANK}", "--backend-opt", "loss_reduction=sequence_mean", "--backend-opt", f"base_model={ASSETS}",
            "--rollout", "agent", "--rollout-opt", f"command={client_python} {agent}", "--no-drop-zero-variance-groups",
            "--learning-rate", "3e-3", "--prompt-groups-per-step", "2", "--completions-per-prompt", "4",
            "--max-completion-tokens", "8", "--max-steps", "2", "--run-dir", str(run_dir)]  # fmt: skip
    out = client.cli(*args)
    assert out.returncode == 0, out.stderr[-5000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and [m["policy/version"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["agent/calls_mean"] == 2.0 and m["agent/failed"] == 0 and m["agent/prefix_breaks"] == 0
        assert m["train/tokens"] > 0


def test_sft_trains_on_the_service_checkpoints_and_resumes(client, tmp_path):
    """``grpo-core sft --backend tinker``: the service's cross_entropy loss, weighted per target token
    of the step, lowers the loss of the embedded task's answers; a resumed run goes on from the
    service's saved state; final/ is a model."""
    run_dir = tmp_path / "sft"
    # A cold server's first answer (its model loading) may take longer than the default 30 s on a busy machine.
    base = ["--backend", "tinker", "--backend-opt", f"base_url={client.url}", "--backend-opt", f"rank={RANK}",
            "--backend-opt", f"base_model={ASSETS}", "--backend-opt", "connect_deadline=300"]  # fmt: skip
    # The same 8 rows every step (one step an epoch): the loss of a fixed batch falls.
    args = ["sft", *base, "--max-rows", "8", "--epochs", "6", "--examples-per-step", "8", "--learning-rate", "1e-2",
            "--checkpoint-every", "2", "--run-dir", str(run_dir)]  # fmt: skip
    out = client.cli(*args, "--max-steps", "4")
    assert out.returncode == 0, out.stderr[-5000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss/total"] for m in metrics]
    print("sft loss on the service", [round(x, 3) for x in losses])
    assert losses[-1] < 0.75 * losses[0] and all(m["train/examples"] == 8 for m in metrics)
    assert [m["policy/version"] for m in metrics] == [1, 2, 3, 4]
    assert (run_dir / "final" / "model.safetensors").exists() and (run_dir / "final" / "grpo_core_prompt.json").exists()

    out = client.cli("sft", "--resume", str(run_dir), "--max-steps", "6")
    assert out.returncode == 0, out.stderr[-5000:]
    resumed = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(resumed) == 6 and resumed[:4] == metrics
    assert [m["policy/version"] for m in resumed[4:]] == [5, 6]


LOSS_FALLS = [("importance_sampling", True), ("importance_sampling", False), ("reinforce", False)]
"""(loss, through the service's built-in): one built-in path, the same loss and a loss without a
built-in through the custom path."""


@pytest.mark.parametrize("loss, builtin", LOSS_FALLS, ids=["importance_sampling-builtin", "importance_sampling-custom", "reinforce-custom"])
def test_the_remote_optimizer_minimises_the_loss_on_a_fixed_batch(client, loss, builtin):
    """On-policy the GRPO surrogate is 0 at every step by construction (ratio 1) and loss/total is
    β·KL, which grows as the policy moves: a run's loss/total does not show the optimizer at work.
    Training the same batch (fixed advantages, a fixed anchor) for several steps does: the loss
    computed from each step's forward falls step after step."""
    result = client("loss_falls", loss=loss, builtin=builtin, steps=5)
    print(f"{loss} ({'built-in' if builtin else 'custom'} path): loss by step {[round(x, 4) for x in result['losses']]}, "
          f"service calls {result['calls']}, {result['seconds_per_step']:.2f}s per step")  # fmt: skip
    losses = result["losses"]
    assert all(later < earlier for earlier, later in itertools.pairwise(losses))
    assert losses[0] - losses[-1] > 0.05 * abs(losses[0]) + 1e-3
    path = {"forward": 0, "forward_backward": 5} if builtin else {"forward": 5, "forward_backward": 5}
    assert result["calls"] == path


def test_the_policy_written_for_a_sampler_is_a_model_with_the_services_logprobs(client, tmp_path):
    """After a step that moved the policy, save_weights_for_sampler (what final/ and the vllm sync
    write) downloads the service's adapter and merges it into --model: transformers loads the
    folder, and its logprobs are the service's."""
    result = client("written_model", folder=str(tmp_path / "policy"))
    print(f"written model vs service: max |diff| {result['max_abs_diff']:.2e} over {result['tokens']} tokens "
          f"(the step moved logprobs by {result['moved']:.2f}); written in {result['seconds']:.1f}s")  # fmt: skip
    assert result["moved"] > 0.1
    assert result["max_abs_diff"] < 1e-3
    assert result["tinker_path"].startswith("tinker://")


def test_a_tinker_trainer_samples_on_a_vllm_server_synced_after_every_step(client, tmp_path):
    """--trainer tinker --sampler openai --weight-sync vllm against skyrl and a real vLLM server:
    each sync sends the service's adapter alone (method=auto), vLLM loads it as a LoRA adapter of
    a new name, and the sync's own check (the server's logprobs vs the service's) holds; final/ is a
    model with the service's logprobs, and exports."""
    from tests.integration.vllm_server import LORA_RANK, LORA_SERVER, VLLMServer, ensure_vllm_venv

    ensure_vllm_venv()
    assert RANK <= LORA_RANK
    server = VLLMServer(ASSETS, tmp_path / "vllm.log", **LORA_SERVER)
    print(f"vLLM server started in {server.start():.0f}s")
    try:
        run_dir = tmp_path / "run"
        # --lora-rank, not the backend option: skyrl refuses ranks above 8, the default (32) among them.
        args = ["run", "--trainer", "tinker", "--backend-opt", f"base_url={client.url}", "--lora-rank", str(RANK),
                "--backend-opt", "loss_reduction=sequence_mean", "--backend-opt", f"base_model={ASSETS}",
                "--sampler", "openai", "--sampler-opt", f"base_url={server.url}", "--weight-sync", "vllm",
                "--learning-rate", "3e-3", "--prompt-groups-per-step", "4", "--completions-per-prompt", "8",
                "--max-completion-tokens", "16", "--checkpoint-every", "2", "--max-steps", "3", "--run-dir", str(run_dir)]  # fmt: skip
        started = time.monotonic()
        out = client.cli(*args)
        assert out.returncode == 0, out.stderr[-5000:]
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        synced = [m for m in metrics if "sync/logprob_max_abs_diff" in m]
        print(f"3 steps in {time.monotonic() - started:.0f}s; sync logprob diffs", [m["sync/logprob_max_abs_diff"] for m in synced],
              "seconds", [round(m["time/weight_sync"], 1) for m in synced])  # fmt: skip
        assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["tokens/completion"] > 0 for m in metrics)
        # One sync right after each step, the last one too (the server goes on serving the final policy).
        assert len(synced) == 3 and all(m["sync/logprob_max_abs_diff"] < 1e-3 for m in synced)
        full_bytes = (ASSETS / "model.safetensors").stat().st_size
        print("sync bytes", [m["sync/bytes"] for m in synced], "of the model's", full_bytes)
        assert all(m["sync/method"] == 1.0 and 0 < m["sync/bytes"] < full_bytes / 4 for m in synced)
        assert [p.name for p in (run_dir / "sampler-weights").iterdir()] == ["adapter-v3"]
        final = client("model_vs_service", folder=str(run_dir / "final"))
        print(f"final/ vs the service's weights: max |diff| {final['max_abs_diff']:.2e} over {final['tokens']} tokens; "
              f"vs the base model {final['base_max_abs_diff']:.2e}")  # fmt: skip
        assert final["base_max_abs_diff"] > 1e-2  # the policy moved (groups with a reward signal trained it)
        assert final["max_abs_diff"] < 1e-3
        assert final["tinker_path"].startswith("tinker://") and final["version"] == 3

        # export: final/ as it is; a checkpoint through the service (its state loaded, the policy written).
        out = client.cli("export", str(run_dir), str(tmp_path / "exported"))
        assert out.returncode == 0, out.stderr[-3000:]
        assert client("model_vs_service", folder=str(tmp_path / "exported"))["max_abs_diff"] < 1e-3
        out = client.cli("export", str(run_dir), str(tmp_path / "exported-2"), "--step", "2")
        assert out.returncode == 0, out.stderr[-3000:]
        step2 = client("model_vs_service", folder=str(tmp_path / "exported-2"))
        assert step2["max_abs_diff"] < 1e-3 and step2["version"] == 2
    finally:
        server.stop()


# ------------------------------------------------------------------------------------------------
# Client side (the client venv, tinker==0.24.1): each function prints one JSON line


def check_sdk_version(url: str) -> dict:
    from importlib.metadata import version

    from grpo_core.remote import tinker_sdk

    return {"tinker": version("tinker"), "adapter": list(tinker_sdk.sdk_version())}


def _datums(tokenizer, n: int) -> list:
    """Sequences from the embedded task: a prompt (untrained) and its answer (trained)."""
    from grpo_core import Prompt, Sample
    from grpo_core.backend import sample_to_datum

    rows = [json.loads(line) for line in (ASSETS / "task" / "train.jsonl").read_text().splitlines()[:n]]
    datums = []
    for i, row in enumerate(rows):
        prompt = tokenizer.encode(row.get("question", row.get("prompt", "")))
        answer = tokenizer.encode(" " + row.get("answer", ""))[:24]
        tokens = prompt + answer
        mask = [0.0] * len(prompt) + [1.0] * len(answer)
        sample = Sample(Prompt(id=str(i), text=""), tokens, [0.0] * len(tokens), mask, "", "length", 0)
        datums.append((sample, sample_to_datum(sample)))
    return datums


def _trainer(url: str, **config_fields):
    from grpo_core.config import RunConfig
    from grpo_core.plugins.backends.tinker import TinkerBackend

    config = RunConfig(**config_fields)
    backend = TinkerBackend(base_url=url, rank=RANK, base_model=str(ASSETS), loss_reduction="sequence_mean")
    return backend.make_trainer(config=config), config


def check_logprobs(url: str) -> dict:
    from grpo_core.config import RunConfig
    from grpo_core.plugins.backends.local import LocalBackend
    from grpo_core.plugins.backends.tinker import TinkerBackend

    trainer, config = _trainer(url)
    local = LocalBackend().make_trainer(config=RunConfig())
    pairs = _datums(trainer.tokenizer, 8)
    datums = [d for _, d in pairs]
    remote = trainer.forward(datums)
    ours = local.forward(datums)
    reference = (
        TinkerBackend(base_url=url, rank=RANK, base_model=str(ASSETS)).make_reference(config=config, trainer=trainer).forward(datums)
    )
    diffs, ref_diffs, tokens = [], [], 0
    for (sample, _), r, o, ref in zip(pairs, remote, ours, reference):
        trained = [t for t, w in enumerate(sample.loss_mask[1:]) if w > 0]
        diffs += [abs(float(r[t]) - float(o[t])) for t in trained]
        ref_diffs += [abs(float(ref[t]) - float(o[t])) for t in trained]
        tokens += len(trained)
    return {"max_abs_diff": max(diffs), "reference_max_abs_diff": max(ref_diffs), "tokens": tokens}


def check_paths(url: str, loss: str, options: dict, on_policy: bool, wrappers: list | None = None) -> dict:
    """The same step through the built-in path and the custom path, on two adapters with the same
    initial weights; the logprobs of the next forward after it, and each path's time per step."""
    import tinker
    import torch

    from tests.plugins.backends.tinker_losses import step_loss as make_step_loss

    names = [loss, *(wrappers or [])]
    plugin_options = {"loss": {loss: options}}
    builtin_trainer, _ = _trainer(url, loss=names, plugin_options=plugin_options, seed=3)
    custom_trainer, _ = _trainer(url, loss=names, plugin_options=plugin_options, seed=3)
    custom_trainer.builtin = None
    pairs = _datums(builtin_trainer.tokenizer, 8)
    datums = [d for _, d in pairs]
    before = builtin_trainer.forward(datums)
    generator = torch.Generator().manual_seed(0)
    advantages = [torch.randn(1, generator=generator).expand(len(lp)).clone() for lp in before]
    # Off-policy: an anchor far enough from the current policy that the clip ranges bind.
    old = None if on_policy else [lp + 0.3 * torch.randn(len(lp), generator=generator) for lp in before]
    # eps far above every |gradient|: the step is lr·g/eps, linear in the gradient (with a small eps
    # Adam's first step is lr·sign(g), which turns float noise in near-zero gradients into full steps).
    adam = tinker.AdamParams(learning_rate=0.1, beta1=0.9, beta2=0.999, eps=1.0, weight_decay=0.0, grad_clip_norm=0.0)
    service_losses = []
    send = builtin_trainer.training.forward_backward
    builtin_trainer.training.forward_backward = lambda data, loss_fn, config=None: (
        service_losses.append(loss_fn) or send(data, loss_fn, config)
    )
    results = {}
    for label, trainer in (("builtin", builtin_trainer), ("custom", custom_trainer)):
        trainer.counts = {"forward": 0, "forward_backward": 0}
        step_loss = make_step_loss(names, plugin_options, pairs, advantages, old)
        started = time.perf_counter()
        output = trainer.forward_backward_custom(datums, step_loss)
        trainer.optim_step(adam)
        results[label] = {"seconds": time.perf_counter() - started, "loss": output.metrics["loss"], "calls": dict(trainer.counts)}
    after_builtin = builtin_trainer.forward(datums)
    after_custom = custom_trainer.forward(datums)
    masks = [torch.tensor(s.loss_mask[1:]) > 0 for s, _ in pairs]
    return {
        "service_losses": service_losses,
        "after_max_abs_diff": max(float((a - c)[m].abs().max()) for a, c, m in zip(after_builtin, after_custom, masks)),
        "moved": max(float((a - b)[m].abs().max()) for a, b, m in zip(after_custom, before, masks)),
        "loss_builtin": results["builtin"]["loss"],
        "loss_custom": results["custom"]["loss"],
        "calls_builtin": results["builtin"]["calls"],
        "calls_custom": results["custom"]["calls"],
        "seconds_builtin": results["builtin"]["seconds"],
        "seconds_custom": results["custom"]["seconds"],
    }


def check_loss_falls(url: str, loss: str, builtin: bool, steps: int) -> dict:
    import tinker
    import torch

    from tests.plugins.backends.tinker_losses import step_loss as make_step_loss

    trainer, _ = _trainer(url, loss=[loss], seed=5)
    if not builtin:
        trainer.builtin = None
    pairs = _datums(trainer.tokenizer, 8)
    datums = [d for _, d in pairs]
    first = trainer.forward(datums)
    generator = torch.Generator().manual_seed(0)
    advantages = [torch.randn(1, generator=generator).expand(len(lp)).clone() for lp in first]
    # A fixed anchor (the logprobs before any step) makes every step off-policy after the first,
    # so that the built-in path is taken (skyrl's per-sequence mean leaves on-policy to the custom path).
    anchor = [lp.clone() for lp in first]
    adam = tinker.AdamParams(learning_rate=5e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)
    trainer.counts = {"forward": 0, "forward_backward": 0}
    losses = []
    started = time.perf_counter()
    for _ in range(steps):
        output = trainer.forward_backward_custom(datums, make_step_loss([loss], {}, pairs, advantages, anchor))
        trainer.optim_step(adam)
        losses.append(output.metrics["loss"])
    return {"losses": losses, "calls": dict(trainer.counts), "seconds_per_step": (time.perf_counter() - started) / steps}


def _model_logprobs(folder: str, datums: list) -> list:
    """Each datum's target-token logprobs under the transformers model in ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for d in datums:
            logits = model(torch.tensor([d.model_input.to_ints()])).logits[0]
            targets = torch.tensor(d.loss_fn_inputs["target_tokens"].data)
            out.append(torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0])
    return out


def _max_diff(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def check_written_model(url: str, folder: str) -> dict:
    import tinker
    import torch

    from tests.plugins.backends.tinker_losses import step_loss as make_step_loss

    trainer, _ = _trainer(url, loss=["importance_sampling"])
    pairs = _datums(trainer.tokenizer, 8)
    datums = [d for _, d in pairs]
    before = trainer.forward(datums)
    generator = torch.Generator().manual_seed(0)
    advantages = [torch.randn(1, generator=generator).expand(len(lp)).clone() for lp in before]
    trainer.forward_backward_custom(datums, make_step_loss(["importance_sampling"], {}, pairs, advantages, None))
    trainer.optim_step(tinker.AdamParams(learning_rate=0.1, beta1=0.9, beta2=0.999, eps=1.0, weight_decay=0.0, grad_clip_norm=0.0))
    service = trainer.forward(datums)
    started = time.perf_counter()
    trainer.save_weights_for_sampler(folder)
    seconds = time.perf_counter() - started
    ours = _model_logprobs(folder, datums)
    return {
        "max_abs_diff": _max_diff(ours, service),
        "moved": _max_diff(service, before),
        "tokens": sum(len(lp) for lp in service),
        "seconds": seconds,
        "tinker_path": json.loads((Path(folder) / "tinker_weights.json").read_text())["tinker_path"],
    }


def check_model_vs_service(url: str, folder: str) -> dict:
    """A written policy's logprobs against the service's sampling client of the weights it names
    (its tinker:// path), and against the base model."""
    import os

    import tinker
    from transformers import AutoTokenizer

    from grpo_core.plugins.backends.tinker import TinkerReference
    from grpo_core.remote import tinker_sdk

    pointer = json.loads((Path(folder) / "tinker_weights.json").read_text())
    service = tinker.ServiceClient(base_url=url, api_key=os.environ["TINKER_API_KEY"])

    datums = [d for _, d in _datums(AutoTokenizer.from_pretrained(folder), 8)]
    remote = TinkerReference(tinker_sdk.sampling_client(service, model_path=pointer["tinker_path"])).forward(datums)
    ours = _model_logprobs(folder, datums)
    return {
        "max_abs_diff": _max_diff(ours, remote),
        "base_max_abs_diff": _max_diff(ours, _model_logprobs(str(ASSETS), datums)),
        "tokens": sum(len(r) for r in remote),
        "tinker_path": pointer["tinker_path"],
        "version": pointer["version"],
    }


if __name__ == "__main__":
    result = globals()[f"check_{sys.argv[1]}"](**json.loads(sys.argv[2]))
    print(json.dumps(result))
