"""The ``grpo-core`` command. Heavy imports (torch, transformers) happen inside commands."""

from __future__ import annotations

import json
import sys
import types
import typing
from typing import Any, Literal

import click

from grpo_core import __version__
from grpo_core.plugins_manager import KINDS, PluginError



def _click_option(field: Any) -> Any:
    flag = "--" + field.name.replace("_", "-")
    help_text = field.metadata.get("help", "")
    annotation = field.type
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1 else annotation
    if base is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", default=None, help=help_text)
    if typing.get_origin(base) is list:
        return click.option(flag, multiple=True, help=help_text)
    if typing.get_origin(base) is Literal:
        return click.option(flag, type=click.Choice(typing.get_args(base)), default=None, help=help_text)
    param_type = {int: int, float: float}.get(base, str)
    return click.option(flag, type=param_type, default=None, help=help_text)


def _run_options(func: Any) -> Any:
    from grpo_core.config import cli_fields

    for field in reversed(cli_fields()):
        func = _click_option(field)(func)
    for kind in reversed(KINDS):
        func = click.option(
            f"--{kind.replace('_', '-')}-opt",
            f"{kind}_opt",
            multiple=True,
            metavar="[NAME.]KEY=VALUE",
            help=f"option of the selected {kind} plugin; repeatable",
        )(func)
    return click.option("--config", "config_file", type=click.Path(), help="TOML file of settings and [kind.name] option tables")(func)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="grpo-core")
def main() -> None:
    """GRPO-family reinforcement learning of language models, every part a plugin."""


@main.command()
@_run_options
def run(config_file: str | None, **values: Any) -> None:
    """Train a policy with GRPO. With no arguments: the embedded tiny model and task, on CPU."""
    from grpo_core import config as config_module

    plugin_opts = {kind: list(values.pop(f"{kind}_opt")) for kind in KINDS}
    overrides = {k: (list(v) if isinstance(v, tuple) else v) for k, v in values.items()}
    overrides = {k: v for k, v in overrides.items() if v is not None and v != []}
    try:
        config = config_module.load(config_file, overrides, plugin_opts)
        from grpo_core.loop import run as run_loop

        run_loop(config)
    except PluginError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)


EVAL_FIELDS = (
    "model", "dataset", "prompt_field", "answer_field", "prompt_template", "max_rows", "skip_bad_rows",
    "backend", "rollout", "reward", "max_completion_tokens", "top_p", "top_k", "stop", "device", "dtype", "threads", "seed",
)  # fmt: skip


def _eval_options(func: Any) -> Any:
    from grpo_core.config import cli_fields

    for field in reversed([f for f in cli_fields() if f.name in EVAL_FIELDS]):
        func = _click_option(field)(func)
    for kind in ("backend", "rollout", "reward"):
        func = click.option(f"--{kind}-opt", f"{kind}_opt", multiple=True, metavar="[NAME.]KEY=VALUE", help=f"option of the {kind} plugin")(func)
    return func


@main.command(name="eval")
@_eval_options
@click.option("-n", "--num-samples", default=1, show_default=True, type=click.IntRange(min=1), help="samples per prompt; pass@n is reported too")
@click.option("--temperature", type=click.FloatRange(min=0.0), default=None, help="0 = greedy; default: 0 with -n 1, else 1.0")
@click.option("--batch-size", default=32, show_default=True, type=click.IntRange(min=1), help="prompts generated together")
@click.option("--pass-threshold", default=1.0, show_default=True, help="a sample passes when its total reward reaches this")
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
def eval_(num_samples: int, temperature: float | None, batch_size: int, pass_threshold: float, as_json: bool, **values: Any) -> None:
    """Measure a model: mean reward and pass@1 (pass@n with -n) on a dataset, with a progress bar.

    A policy trained by grpo-core is prompted as it was trained (template, fields, chat
    template, stop strings, max tokens saved beside it) unless flags say otherwise. Without
    --dataset: the embedded task's test split (default:test).
    """
    from rich.progress import Progress

    plugin_opts = {kind: list(values.pop(f"{kind}_opt")) for kind in ("backend", "rollout", "reward")}
    overrides = {k: (list(v) if isinstance(v, tuple) else v) for k, v in values.items()}
    overrides = {k: v for k, v in overrides.items() if v is not None and v != []}
    overrides["temperature"] = temperature if temperature is not None else (0.0 if num_samples == 1 else 1.0)
    try:
        from grpo_core.evaluate import eval_config, evaluate

        config, settings_origin = eval_config(overrides, plugin_opts)
        with Progress(transient=True) as bar:
            task = bar.add_task("eval", total=None)

            def advance(n: int, total: int, mean: float) -> None:
                bar.update(task, advance=n, total=total, description=f"eval  reward {mean:.3f}")

            result = evaluate(config, num_samples, batch_size, pass_threshold, advance, settings_origin)
    except PluginError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo("  ".join(f"{k} {v:.4f}" if isinstance(v, float) and not v.is_integer() else f"{k} {v:g}" for k, v in result.items()))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def plugins(as_json: bool) -> None:
    """List installed plugins: kind, name, distribution, hooks, options and help."""
    from grpo_core.plugin_info import describe_all, render

    infos = describe_all()
    if as_json:
        click.echo(json.dumps(infos, indent=2))
    else:
        render(infos)


if __name__ == "__main__":
    main()
