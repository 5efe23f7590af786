"""The ``grpo-core`` command. Heavy imports (torch, transformers) happen inside commands."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import tempfile
import traceback
import types
import typing
from pathlib import Path
from typing import Any, Literal

import attrs
import click

from grpo_core import __version__
from grpo_core.config import MACHINE, PLUGINS, RUN_DIRECTORY, SECTIONS, cli_fields
from grpo_core.errors import EXIT_ERROR, PluginError
from grpo_core.hookspecs import KIND_TABLE

EXIT_INTERNAL = 3
"""An unexpected error (a bug in grpo-core or a plugin): the traceback is written to a file."""


class SectionedOption(click.Option):
    """An option that knows the ``--help`` section it is listed in (a setting's comes from its field)."""

    def __init__(self, *args: Any, section: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.section = section


class SectionedCommand(click.Command):
    """``--help`` in the sections of ``config.SECTIONS``, each option with its default."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Both spellings of one setting (``--backend local --trainer tinker``) are refused: one would
        win without a word. One flag repeated is the usual last-wins override."""
        given = {arg.partition("=")[0] for arg in args[: args.index("--") if "--" in args else len(args)]}
        for name, alias in FLAG_ALIASES.items():
            flags = [f"--{name.replace('_', '-')}", f"--{alias.replace('_', '-')}"]
            if all(flag in given for flag in flags):
                raise click.UsageError(f"{' and '.join(flags)} name one setting: give one of them", ctx)
        return super().parse_args(ctx, args)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows: dict[str, list[tuple[str, str]]] = {title: [] for title in SECTIONS}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record:
                rows.setdefault(param.section if isinstance(param, SectionedOption) and param.section else "Other", []).append(record)
        for title, records in rows.items():
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)


def _default_text(field: Any) -> str:
    default = field.default.factory() if isinstance(field.default, attrs.Factory) else field.default
    if default is None or default in ([], {}):
        return ""
    return f" [default: {', '.join(map(str, default)) if isinstance(default, list) else default}]"


FLAG_ALIASES = {"backend": "trainer"}
"""Second spellings of a flag: ``--trainer tinker`` reads as what it selects, the policy trainer."""


def _flags(name: str) -> list[str]:
    return [f"--{n.replace('_', '-')}" for n in (name, FLAG_ALIASES.get(name)) if n]


def _click_option(field: Any) -> Any:
    """The flag of a RunConfig field. Its value reaches ``config.load`` as typed; the field reads it."""
    flag, *aliases = _flags(field.name)
    option = functools.partial(
        click.option, cls=SectionedOption, section=field.metadata["section"], help=field.metadata["help"] + _default_text(field)
    )
    annotation = field.type
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1 else annotation
    if base is bool:
        return option(f"{flag}/--no-{flag[2:]}", default=None)
    if base == dict[str, float]:
        return option(flag, *aliases, field.name, multiple=True, metavar="NAME[:WEIGHT]")
    if typing.get_origin(base) is list:
        return option(flag, *aliases, field.name, multiple=True)
    if typing.get_origin(base) is Literal:
        return option(flag, *aliases, field.name, type=click.Choice(typing.get_args(base)), default=None)
    param_type = {int: int, float: float}.get(base, str)
    return option(flag, *aliases, field.name, type=param_type, default=None)


def _run_options(func: Any) -> Any:
    func = click.option(
        "--config",
        "config_file",
        type=click.Path(),
        cls=SectionedOption,
        section=RUN_DIRECTORY,
        help="TOML file of settings and [kind.name] option tables",
    )(func)
    for kind in reversed(KIND_TABLE):
        func = click.option(
            *(f"{flag}-opt" for flag in _flags(kind)),
            f"{kind}_opt",
            multiple=True,
            metavar="[NAME.]KEY=VALUE",
            cls=SectionedOption,
            section=PLUGINS,
            help=f"option of the selected {kind} plugin; repeatable",
        )(func)
    for field in reversed(cli_fields()):
        func = _click_option(field)(func)
    return func


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="grpo-core")
def main() -> None:
    """GRPO-family reinforcement learning of language models, every part a plugin."""


@main.command(cls=SectionedCommand)
@_run_options
@click.option(
    "--resume",
    "resume",
    metavar="RUN_DIR",
    cls=SectionedOption,
    section=RUN_DIRECTORY,
    help="continue that run from its newest checkpoint, with its own config",
)
@click.option(
    "--overwrite",
    is_flag=True,
    cls=SectionedOption,
    section=RUN_DIRECTORY,
    help="replace the grpo-core run --run-dir holds (a non-empty run directory is refused otherwise; never a folder of other files)",
)
@click.option("--debug", is_flag=True, cls=SectionedOption, section=MACHINE, help="show the traceback of an error")
def run(config_file: str | None, resume: str | None, overwrite: bool, debug: bool, **values: Any) -> None:
    """Train a policy with GRPO. With no arguments: the embedded tiny model and task, on CPU (its own
    settings: core/assets/default/run.toml; any flag wins).

    \b
    Checkpoints go to RUN_DIR/checkpoints/step-N/ every --checkpoint-every steps and at the end;
    --resume RUN_DIR continues a stopped run exactly (same seed on CPU: the same weights as a run
    that never stopped). Ctrl-C or SIGTERM stops after the current step, saving a checkpoint and
    the policy (a second one stops at once, still saving). A plugin option that is a secret (an
    API key, a token) is never written; give it as env:VARIABLE to read it from the environment.

    \b
    A run holds a lock on its folder (RUN_DIR/.lock, with its PID) while it runs: a second run,
    --resume or export of that folder is refused, naming the process; a killed run's lock is taken
    over. --overwrite only replaces a grpo-core run, never the working directory or a folder of
    other files. A server's first contact must succeed within its connect_deadline (openai sampler,
    tinker trainer: 30 s); later long waits print progress.

    \b
    --resume refuses a dataset whose rows changed since the run started (RUN_DIR/data.json: their
    count and sha256). A run that trained nothing (every group of every step dropped: its reward
    failed, or equal rewards gave no signal) ends with exit 1 after writing its summary.

    \b
    Exit codes: 0 done; 1 an error you can fix (message says what), or a third-party plugin's bug
    (named with its distribution); 2 bad command line; 3 internal error of grpo-core (traceback
    written to the run directory); 130 Ctrl-C; 143 SIGTERM.
    """
    from grpo_core import config as config_module
    from grpo_core.resume import load_resumed

    plugin_opts = {kind: list(values.pop(f"{kind}_opt")) for kind in KIND_TABLE}
    overrides = {k: (list(v) if isinstance(v, tuple) else v) for k, v in values.items()}
    overrides = {k: v for k, v in overrides.items() if v is not None and v != []}
    run_dir: str | None = resume or overrides.get("run_dir")
    try:
        if resume:
            if config_file:
                raise PluginError("--resume uses the run's own config.json: --config cannot be given with it")
            config = load_resumed(resume, overrides, plugin_opts)
        else:
            config = config_module.load(config_file, overrides, plugin_opts)
        if int(os.environ.get("RANK", "0")) > 0:
            sys.exit(_serve_rank(config))
        from grpo_core.train import run as run_loop

        summary = run_loop(config, resume=bool(resume), overwrite=overwrite)
    except Exception as exc:
        _fail(exc, run_dir, debug)
    except KeyboardInterrupt:
        # Before training started (loading): nothing to save.
        click.echo("interrupted", err=True)
        sys.exit(130)
    sys.exit(summary["exit_code"])


def _serve_rank(config: Any) -> int:
    """A process torchrun started as a rank other than 0: it serves rank 0's trainer (the backend's
    ``serve_rank``) instead of running the loop."""
    from grpo_core.hookspecs import declared
    from grpo_core.plugins_manager import make_plugin

    backend = make_plugin(config.backend, "backend", **config.options_for("backend", config.backend))
    serve = declared(backend, "backend", "serve_rank")
    if serve is None:
        raise PluginError(f"torchrun started {os.environ.get('WORLD_SIZE')} processes, but --backend {config.backend} trains in one")
    return serve(config)


def _fail(exc: Exception, run_dir: str | None, debug: bool) -> typing.NoReturn:
    """One clear message and a non-zero exit; an unexpected error also leaves its traceback in a file.

    An unexpected error raised in a plugin's code names the plugin and its distribution: one of
    another distribution is that plugin's bug (exit 1, report it there), one of grpo-core's own
    is grpo-core's (exit 3, like an error in the core).
    """
    from grpo_core.lifecycle import RunFailed

    saved = exc.saved if isinstance(exc, RunFailed) else None
    cause = exc.cause if isinstance(exc, RunFailed) else exc
    if debug:
        traceback.print_exception(cause)
    if out_of_memory(cause):
        cause = PluginError(f"out of memory ({str(cause).splitlines()[0][:200]}); {MEMORY_ADVICE}")
    expected = isinstance(cause, (PluginError, OSError))
    plugin = None if expected else _raised_in_plugin(cause)
    ours = not expected and (plugin is None or plugin.distribution == "grpo-core")
    message = str(cause) if isinstance(cause, PluginError) else f"{type(cause).__name__}: {cause}"
    if plugin is not None:
        message = f"{plugin.label} raised {message}"
    click.echo(f"internal error: {message}" if ours else f"error: {message}", err=True)
    if not expected:
        where = Path(run_dir) if run_dir and Path(run_dir).is_dir() else Path(tempfile.mkdtemp(prefix="grpo-core-"))
        (where / "traceback.txt").write_text("".join(traceback.format_exception(cause)))
        report = "please report it" if ours else f"a bug of {plugin.distribution}: report it to its authors"  # type: ignore[union-attr]
        click.echo(f"  the traceback is in {where / 'traceback.txt'} (--debug shows it); {report}", err=True)
    if saved:
        click.echo(f"  {saved}", err=True)
    sys.exit(EXIT_INTERNAL if ours else EXIT_ERROR)


MEMORY_ADVICE = (
    "make a step smaller (--max-samples-per-fwd-bwd N splits it; fewer --prompt-groups-per-step, --completions-per-prompt "
    "or --max-completion-tokens), or its memory (--gradient-checkpointing, --lora-rank R, --dtype bfloat16)"
)


def out_of_memory(exc: BaseException) -> bool:
    """A batch too large for the machine: Python's MemoryError, torch's (CUDA) OutOfMemoryError, or
    torch's CPU allocator failing (a RuntimeError of its own wording)."""
    return (
        isinstance(exc, MemoryError)
        or type(exc).__name__ == "OutOfMemoryError"
        or (isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))
    )


def _raised_in_plugin(exc: BaseException) -> Any:
    """The installed plugin (a catalog entry) whose method raised ``exc``: the deepest frame of its
    traceback in a plugin class's code; None when it was raised elsewhere."""
    from grpo_core.plugins_manager import catalog

    classes: dict[tuple[str, str], Any] = {}
    for entry in catalog():
        module_name, _, class_name = entry.target.partition(":")
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, "__file__", None):
            classes[(os.path.realpath(module.__file__), class_name)] = entry
    for frame, _ in reversed(list(traceback.walk_tb(exc.__traceback__))):
        code = frame.f_code
        entry = classes.get((os.path.realpath(code.co_filename), code.co_qualname.partition(".")[0]))
        if entry is not None:
            return entry
    return None


def _finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"expected a finite number, got {value}")
    return value


EVAL_FIELDS = (
    "model", "dataset", "mix", "fetch_timeout", "prompt_field", "answer_field", "prompt_template", "max_rows", "skip_bad_rows",
    "backend", "rollout", "reward", "max_completion_tokens", "top_p", "top_k", "stop", "reward_timeout",
    "device", "dtype", "threads", "seed",
)  # fmt: skip


def _eval_options(func: Any) -> Any:
    for field in reversed([f for f in cli_fields() if f.name in EVAL_FIELDS]):
        func = _click_option(field)(func)
    for kind in ("backend", "rollout", "reward"):
        func = click.option(
            *(f"{flag}-opt" for flag in _flags(kind)),
            f"{kind}_opt",
            multiple=True,
            metavar="[NAME.]KEY=VALUE",
            help=f"option of the {kind} plugin",
        )(func)
    return func


@main.command(name="eval")
@_eval_options
@click.option(
    "-n", "--num-samples", default=1, show_default=True, type=click.IntRange(min=1), help="samples per prompt; pass@n is reported too"
)
@click.option(
    "--temperature", type=click.FloatRange(min=0.0), default=None, callback=_finite, help="0 = greedy; default: 0 with -n 1, else 1.0"
)
@click.option("--batch-size", default=32, show_default=True, type=click.IntRange(min=1), help="prompts generated together")
@click.option(
    "--pass-threshold", default=1.0, show_default=True, callback=_finite, help="a sample passes when its total reward reaches this"
)
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
@click.option("--debug", is_flag=True, help="show the traceback of an error")
def eval_(
    num_samples: int, temperature: float | None, batch_size: int, pass_threshold: float, as_json: bool, debug: bool, **values: Any
) -> None:
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
    except Exception as exc:
        _fail(exc, None, debug)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
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


@main.command()
@click.argument("run_dir", type=click.Path())
@click.argument("out_dir", type=click.Path())
@click.option(
    "--step", type=click.IntRange(min=0), default=None, help="export the checkpoint of step N  [default: the final policy, RUN_DIR/final]"
)
@click.option("--debug", is_flag=True, help="show the traceback of an error")
def export(run_dir: str, out_dir: str, step: int | None, debug: bool) -> None:
    """Write a run's policy to OUT_DIR as a plain transformers model folder: the weights (LoRA
    adapters merged in), the tokenizer and the run's prompt settings. It loads with
    AutoModelForCausalLM.from_pretrained and in vLLM, and `grpo-core eval --model OUT_DIR`
    prompts it as it was trained. OUT_DIR must not exist or be empty.
    """
    try:
        from grpo_core.export import export_policy

        path, source = export_policy(run_dir, out_dir, step)
    except Exception as exc:
        _fail(exc, None, debug)
    click.echo(f"exported {source} to {path}")


if __name__ == "__main__":
    main()
