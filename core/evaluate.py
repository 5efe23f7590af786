"""``grpo-core eval``: mean reward and pass@k of a model on a dataset, to measure before and after.

A policy trained here carries its run's prompt settings (``grpo_core_prompt.json``: template,
fields, chat template on/off, stop strings, max tokens); eval uses them unless a flag says
otherwise, so a policy is measured on prompts shaped as it was trained on.
"""

from __future__ import annotations

import sys
from typing import Any

import attrs

from grpo_core.backend import without_training_lines
from grpo_core.config import RunConfig, cli_fields, typed_value
from grpo_core.config import load as load_config
from grpo_core.data import PROMPT_SETTINGS_FILE, check_prompt_lengths, load_dataset, read_prompt_settings
from grpo_core.errors import PluginError
from grpo_core.hookspecs import declared
from grpo_core.lifecycle import sampling_params, seed_everything
from grpo_core.measure import EVAL_DATASET, measure
from grpo_core.preflight import check_model_folder
from grpo_core.selection import select_plugins

SAVED_SETTINGS = ("prompt_field", "answer_field", "prompt_template", "stop", "max_completion_tokens")


def eval_config(flags: dict[str, Any], plugin_opts: dict[str, list[str]]) -> tuple[RunConfig, str]:
    """The config of an eval: flags first, then the prompt settings saved beside the model, then defaults.

    Returns the config and a phrase saying where its prompt settings came from.
    """
    values = dict(flags)
    model = str(values.get("model", "default"))
    settings = read_prompt_settings(model)
    if "dataset" not in values and not values.get("mix"):
        if settings is not None and not settings.get("embedded_task", False):
            raise PluginError(
                f"{model} was trained on {settings.get('dataset')}; pass --dataset with the rows to evaluate it on (a held-out split)"
            )
        values["dataset"] = EVAL_DATASET
    if settings is None:
        return load_config(None, values, plugin_opts), "prompt settings: flags and defaults (none saved with the model)"
    if "rollout" not in values and settings.get("rollout") is not None:
        values["rollout"] = settings["rollout"]
    config = load_config(None, values, plugin_opts)
    origin = f"prompt settings from {model}/{PROMPT_SETTINGS_FILE}"
    # The saved settings are values as the run used them, not text typed by a user: they are set
    # as they are, where a flag does not give them.
    fields = {f.name: f for f in cli_fields()}
    try:
        saved = {key: typed_value(fields[key], settings[key]) for key in SAVED_SETTINGS if key not in flags and key in settings}
        config = attrs.evolve(config, **saved)
    except (TypeError, ValueError) as exc:
        raise PluginError(f"{origin}: {exc}") from None
    if config.rollout == settings.get("rollout"):
        # Saved first, so a --rollout-opt given for the same option wins.
        options = {**settings.get("rollout_options", {}), **config.options_for("rollout", config.rollout)}
        if options:
            config.plugin_options = {**config.plugin_options, "rollout": {config.rollout: options}}
    given = sorted(key for key in SAVED_SETTINGS if key in flags)
    if given:
        origin += f" (flags win: {', '.join('--' + key.replace('_', '-') for key in given)})"
    return config, origin


def evaluate(
    config: RunConfig, num_samples: int, batch_size: int, threshold: float, progress: Any = None, settings_origin: str = ""
) -> dict[str, float]:
    seed_everything(config.seed, config.threads)
    check_model_folder(config.model)  # as run does, before anything loads it
    selection = select_plugins(config)
    dataset = load_dataset(config, selection.rewards_needing_answer)
    pm = selection.manager
    rollout = selection.plugins["rollout"][0]
    tokenizer, max_context = pm.hook.load_tokenizer(config=config)
    check_prompt_lengths(dataset, rollout, tokenizer, max_context, config.max_completion_tokens)
    with without_training_lines():
        trainer = pm.hook.make_trainer(config=config, needs_reference=False)  # evaluation makes no reference
    sampler = pm.hook.make_sampler(config=config, trainer=trainer)
    prompts = dataset.prompts
    chat = declared(rollout, "rollout", "chat_template")
    if chat is None:
        chat_text = ""
    elif getattr(sampler.tokenizer, "chat_template", None) is None:
        chat_text = ", no chat template (the tokenizer has none)"
    else:
        chat_text = f", chat template {'on' if chat else 'off'}"
    stop = f", stop {config.stop!r}" if config.stop else ""
    sampling = "greedy" if config.temperature == 0 else f"temperature {config.temperature:g}, {num_samples} samples per prompt"
    model = "the embedded model" if config.is_default_model() else config.model
    print(
        f"eval: {model} on {dataset.name} ({len(prompts)} prompts), template {dataset.template!r}{chat_text}, "
        f"max {config.max_completion_tokens} tokens{stop}, {sampling}; {settings_origin or 'prompt settings: flags and defaults'}",
        file=sys.stderr,
        flush=True,
    )
    measured = measure(
        selection, sampler, prompts, num_samples, sampling_params(config), batch_size, threshold, config.reward_timeout, progress
    )
    return {
        "prompts": float(len(prompts)),
        "samples_per_prompt": float(num_samples),
        "reward/mean": measured["reward/mean"],
        "reward/failed": measured["reward/failed"],
        "data/skipped_bad_rows": float(len(dataset.skipped_bad_rows)),
        "data/skipped_long_prompts": float(len(dataset.skipped_long_prompts)),
        **{k: v for k, v in measured.items() if k.startswith("pass@")},
        **{k: v for k, v in measured.items() if k.startswith("data/")},  # a mixture's sources, each apart
    }
