"""``grpo-core export``: a run's policy as a plain transformers model folder.

The folder holds the weights (LoRA adapters merged in), the tokenizer and the run's prompt
settings (``grpo_core_prompt.json``), and loads with ``AutoModelForCausalLM.from_pretrained``
or in vLLM. The run's ``final/`` is such a folder already and is copied; a checkpoint holds the
trainer's state (for a LoRA run, the adapters only), so its policy is rebuilt the way a resumed
run rebuilds it: the run's backend, from the run's own config, loads the state and writes the
policy for a sampler.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from grpo_core.backend import without_training_lines
from grpo_core.checkpoint import STATE_FILE, TRAINER_STATE, checkpoint_dir, complete_checkpoints, save_policy
from grpo_core.data import PROMPT_SETTINGS_FILE, write_prompt_settings
from grpo_core.errors import PluginError
from grpo_core.options import REDACTED, coerce
from grpo_core.run_dir import not_running


def export_policy(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> tuple[Path, str]:
    """Write the policy of ``run_dir`` (its ``final/``, or the checkpoint of ``step``) to
    ``out_dir``; returns the folder and what was exported."""
    run = Path(run_dir)
    if not (run / "config.json").is_file():
        raise PluginError(f"{run}: not a grpo-core run directory (no config.json there)")
    with not_running(run):
        return _export(run, Path(out_dir), step)


def _export(run: Path, out: Path, step: int | None) -> tuple[Path, str]:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise PluginError(f"{out} already exists and is not an empty folder; choose another OUT_DIR")
    if step is None:
        source = run / "final"
        if not (source / "config.json").is_file():
            raise PluginError(
                f"{run} has no final policy (final/): the run did not finish; export a checkpoint with --step N ({_saved_steps(run)})"
            )
        save_policy(out, lambda tmp: shutil.copytree(source, tmp))
        return out, f"{source}"
    checkpoint = checkpoint_dir(run, step)
    if not (checkpoint / STATE_FILE).is_file():
        raise PluginError(f"{run} has no checkpoint of step {step} ({_saved_steps(run)})")
    config = read_run_config(run)
    options = config.options_for("backend", config.backend)
    secret = [k for k, v in options.items() if v == REDACTED]
    if secret:
        raise PluginError(
            f"the run's backend option '{secret[0]}' is a secret that config.json does not hold; export the run's final/ instead"
        )
    save_policy(out, lambda tmp: _write_checkpoint_policy(config, options, checkpoint, Path(tmp)))
    return out, f"{checkpoint}"


def _saved_steps(run: Path) -> str:
    steps = [int(p.name.removeprefix("step-")) for p in complete_checkpoints(run)]
    return f"checkpoints of steps {', '.join(map(str, steps))}" if steps else "it has no checkpoints"


def read_run_config(run: Path) -> Any:
    """The run's config.json as a RunConfig (what ``--resume`` reads, without the changes it allows)."""
    from grpo_core.config import RunConfig, cli_fields, read_stored_config

    path = run / "config.json"
    stored = read_stored_config(path)
    fields = {f.name: f for f in cli_fields()}
    try:
        config = RunConfig(**{k: coerce(v, fields[k].type) for k, v in stored.items() if k in fields})
    except (TypeError, ValueError) as exc:
        raise PluginError(f"{path}: {exc}") from None
    config.plugin_options = stored.get("plugin_options") or {}
    return config


def _write_checkpoint_policy(config: Any, backend_options: dict[str, Any], checkpoint: Path, folder: Path) -> None:
    from grpo_core.plugins_manager import make_plugin

    with without_training_lines():
        trainer = make_plugin(config.backend, "backend", **backend_options).make_trainer(config=config)
    trainer.load_state(str(checkpoint / TRAINER_STATE))
    trainer.save_weights_for_sampler(str(folder))
    if (checkpoint / PROMPT_SETTINGS_FILE).is_file():
        shutil.copy2(checkpoint / PROMPT_SETTINGS_FILE, folder / PROMPT_SETTINGS_FILE)
    else:
        write_prompt_settings(folder, config)
