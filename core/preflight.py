"""What a run checks before anything heavy loads (and, for --router-replay, once the trainer and
sampler are made): settings no step can honour, a ``--model`` folder that cannot be a model, the
number of steps, the checkpoint a resumed run continues from."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import attrs

from grpo_core.checkpoint import STATE_FILE, CheckpointError, complete_checkpoints, safetensors_header
from grpo_core.config import RunConfig
from grpo_core.data import steps_available
from grpo_core.errors import PluginError
from grpo_core.fetch import is_url
from grpo_core.hookspecs import declared
from grpo_core.options import missing_folder
from grpo_core.run_dir import is_run_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A model folder holds at least one of these (what ``save_pretrained`` of a tokenizer writes)."""


def check_settings(config: RunConfig) -> None:
    """Settings no step can honour, refused before anything loads (both loops)."""
    if config.temperature == 0:
        raise PluginError("GRPO compares several samples of a prompt: --temperature must be > 0 (0 is greedy, for eval)")
    if config.minibatches_per_step > config.prompt_groups_per_step:
        raise PluginError(
            f"--minibatches-per-step {config.minibatches_per_step} splits a step's groups: it cannot exceed "
            f"--prompt-groups-per-step {config.prompt_groups_per_step}"
        )
    if config.learning_rate == 0:
        print("warning: --learning-rate is 0: the policy will not change", file=sys.stderr)
    sources = [config.dataset, config.eval_dataset or "", *(spec.partition("=")[2] for spec in [*config.mix, *config.eval_mix])]
    if config.fetch_timeout != attrs.fields(RunConfig).fetch_timeout.default and not any(is_url(source) for source in sources):
        raise PluginError(f"--fetch-timeout {config.fetch_timeout:g} would do nothing: no dataset of the run is a URL")


def check_router_replay(config: RunConfig, trainer: Any, sampler: Any) -> None:
    """--router-replay needs a trainer that forces routes and, for R3, a sampler that returns them."""
    if config.router_replay == "off":
        return
    if config.router_replay not in ("R2", "R3"):
        raise PluginError(f"--router-replay {config.router_replay!r}: choose off, R2 or R3")
    problem = declared(trainer, "trainer object", "routing_problem")
    if problem is not None:
        raise PluginError(f"--router-replay {config.router_replay}: {problem} (--backend {config.backend})")
    problem = declared(sampler, "sampler object", "routing_problem") if config.router_replay == "R3" else None
    if problem is not None:
        raise PluginError(f"--router-replay R3: {problem} (--sampler {config.sampler or 'the backend default'})")


def check_model_folder(model: str) -> None:
    """A local ``--model`` folder that cannot be a model is refused before anything loads it, saying
    what it is: a run folder, a folder without a tokenizer, weights cut short."""
    folder = Path(model)
    if missing_folder(model):
        raise PluginError(f"--model {model}: no such folder (a model is a local folder or a hub name such as Qwen/Qwen3-0.6B)")
    if not folder.is_dir():
        return  # a hub name, or the embedded model
    if is_run_config(folder / "config.json"):
        final = folder / "final"
        raise PluginError(
            f"--model {model} is a grpo-core run folder, not a model: its trained policy is {final}"
            + ("" if final.is_dir() else ", once the run has finished (a checkpoint: grpo-core export RUN_DIR OUT_DIR --step N)")
        )
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise PluginError(
            f"model folder {model} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): "
            "save the model's tokenizer beside its weights (tokenizer.save_pretrained(folder))"
        )
    for weights in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem:
            raise PluginError(f"model folder {model}: {weights.name} {problem}; copy or download it again")


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be whole (empty, cut short, no header), read from its header alone."""
    try:
        header, data_start = safetensors_header(path)
    except ValueError as exc:
        return str(exc)
    size = path.stat().st_size
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__" and isinstance(entry, dict)]
    expected = data_start + max(ends, default=0)
    return f"is cut short ({size} of {expected} bytes)" if size < expected else None


def plan_steps(config: RunConfig, num_prompts: int) -> int:
    total = steps_available(num_prompts, config.prompt_groups_per_step, config.epochs)
    if total == 0:
        raise PluginError(f"the dataset has {num_prompts} prompts, fewer than prompt_groups_per_step={config.prompt_groups_per_step}")
    return min(total, config.max_steps) if config.max_steps is not None else total


def resume_point(run_dir: Path, total_steps: int) -> Path:
    """The checkpoint a resumed run continues from, checked before anything loads or is written."""
    found = complete_checkpoints(run_dir)
    if not found:
        raise CheckpointError(f"--resume {run_dir}: no complete checkpoint there; start again with --overwrite")
    try:
        step = json.loads((found[-1] / STATE_FILE).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot resume from {found[-1]}: its {STATE_FILE} is unreadable ({type(exc).__name__}: {exc})") from None
    # A run killed after its last checkpoint but before final/ only has final/ left to write.
    if step >= total_steps and (run_dir / "final").is_dir():
        raise PluginError(f"the run in {run_dir} is complete at step {step} of {total_steps}; pass --max-steps > {step} to train further")
    return found[-1]
