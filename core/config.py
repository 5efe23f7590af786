"""Run configuration: one attrs class, set from a TOML file and CLI flags (flags win).

Every field is a CLI flag (``max_steps`` -> ``--max-steps``) and a top-level TOML key.
Plugin options go to ``--<kind>-opt key=value`` (``name.key=value`` where a kind has several
plugins selected) or to TOML tables ``[loss.cispo]``. Rewards are held with their weights,
``{"gsm8k": 1.0, "format": 0.1}``, from ``--reward format:0.1`` or ``[reward.format] weight = 0.1``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import attrs
import tomllib

from grpo_core.embedded import embedded_split
from grpo_core.errors import PluginError
from grpo_core.kinds import KIND_TABLE
from grpo_core.options import DEFAULT_CHOICE, REDACTED, coerce, is_secret

DEFAULT = "default"
DEFAULT_PRESET = Path(__file__).parent / "assets" / "default" / "run.toml"
SFT_PRESET = Path(__file__).parent / "assets" / "default" / "sft.toml"


MODEL_AND_DATA = "Model and data"
PLUGINS = "Plugins (what is installed, with options and help: grpo-core plugins)"
GRPO_STEP = "The GRPO step"
OPTIMIZER = "Optimizer"
LORA = "LoRA (local backend; --lora-rank also sets the tinker trainer's rank; docs/performance.md)"
ASYNC = "Asynchronous loop (docs/async.md)"
RUN_DIRECTORY = "Run directory, checkpoints, resume"
MACHINE = "Machine"
EVALUATION = "Evaluation during training (docs/training-run.md)"
SFT = "Supervised fine-tuning (grpo-core sft, docs/sft.md)"
SECTIONS = (MODEL_AND_DATA, SFT, PLUGINS, GRPO_STEP, OPTIMIZER, LORA, ASYNC, EVALUATION, RUN_DIRECTORY, MACHINE)
"""The sections of ``grpo-core run --help`` and ``grpo-core sft --help``, in order; every setting names one."""


def _field(
    default: Any,
    help: str,
    section: str,
    *,
    resumable: bool = False,
    from_text: Callable[[str], Any] | None = None,
    **kwargs: Any,
) -> Any:
    """A setting: its default, its ``--help`` text and section, and whether ``--resume`` may change it.

    ``resumable`` settings change nothing a step computes (limits, bookkeeping). ``from_text``
    reads the value as a user typed it in a flag or a TOML file (applied once, where it enters).
    """
    if section not in SECTIONS:
        raise ValueError(f"unknown --help section {section!r}; use one of config.SECTIONS")
    metadata = {"help": help, "section": section, "resumable": resumable, "from_text": from_text}
    if isinstance(default, (list, dict)):
        return attrs.field(factory=lambda: type(default)(default), metadata=metadata, **kwargs)
    return attrs.field(default=default, metadata=metadata, **kwargs)


def _non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


def _unit_interval(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1), got {value}")


def _non_empty_strings(instance: Any, attribute: attrs.Attribute, value: list[str]) -> None:
    if any(not item for item in value):
        raise ValueError(f"{attribute.name}: an empty string is no {attribute.name} string (every completion would end at once)")


def _at_least_two(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value < 2:
        raise ValueError(f"{attribute.name} must be >= 2: a group of one has no advantage (got {value})")


def default_threads() -> int:
    """``OMP_NUM_THREADS`` when set, else half the CPUs this process may use, at least 1.

    On a shared machine all CPUs are much slower beside another busy process than half of them,
    which are never far off their best (docs/performance.md, "CPU threads").
    """
    import os

    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // 2)


def decode_escapes(template: str) -> str:
    r"""``\n``, ``\t`` and ``\\`` typed in a shell (a backslash and a letter) as the characters they name."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], template)


def parse_reward_spec(spec: str) -> tuple[str, float]:
    """``"format:0.1"`` -> ("format", 0.1); a bare name weighs 1."""
    if not isinstance(spec, str):
        raise PluginError(f"reward {spec!r}: expected NAME[:WEIGHT]")
    name, sep, weight = spec.partition(":")
    if not name:
        raise PluginError(f"reward '{spec}': no name (use NAME[:WEIGHT])")
    if not sep:
        return spec, 1.0
    try:
        return name, _weight(name, float(weight))
    except ValueError:
        raise PluginError(f"reward '{spec}': weight '{weight}' is not a number (use NAME[:WEIGHT])") from None


def _weight(name: str, weight: float) -> float:
    if not math.isfinite(weight):
        raise PluginError(f"reward '{name}': weight must be a finite number, got {weight}")
    return weight


def reward_weights(value: str | Iterable[str] | Mapping[str, Any]) -> dict[str, float]:
    """The selected rewards as {name: weight}, from ``NAME[:WEIGHT]`` specs (``--reward``, a TOML
    ``reward`` list) or from a mapping (``[reward.NAME] weight = ...`` tables, config.json)."""
    if isinstance(value, Mapping):
        pairs = []
        for name, weight in value.items():
            try:
                pairs.append((name, _weight(name, weight if isinstance(weight, float) else coerce(weight, float))))
            except (TypeError, ValueError):
                raise PluginError(f"reward '{name}': weight {weight!r} is not a number") from None
    else:
        pairs = [parse_reward_spec(spec) for spec in ([value] if isinstance(value, str) else value)]
    weights: dict[str, float] = {}
    for name, weight in pairs:
        if name in weights:
            raise PluginError(f"reward '{name}' is selected twice")
        weights[name] = weight
    return weights


@attrs.define
class RunConfig:
    """Every setting of a run. A new one is one ``_field`` line here: its flag, TOML key, ``--help``
    entry (in its section) and whether ``--resume`` may change it all follow from it."""

    command: ClassVar[str] = "run"
    """The ``grpo-core`` command that trains with this config (config.json records it: ``--resume`` checks it)."""
    preset: ClassVar[Path] = DEFAULT_PRESET
    """The settings tuned for the embedded model and task, applied under anything given."""
    given_fields: ClassVar[tuple[str, ...] | None] = None
    """The fields of this class a user sets (flags, TOML keys); None: all of them."""
    kinds: ClassVar[tuple[str, ...]] = tuple(KIND_TABLE)
    """The plugin kinds its command selects (flags ``--KIND``, ``--KIND-opt``)."""
    tracked: ClassVar[str] = "reward"
    """What a step's ``TRACKED/total`` metric is that the summary compares between the first and last steps."""
    drawn: ClassVar[str] = "prompts"
    """What a step draws from a mixture's sources: each source's count is ``data/NAME/DRAWN``, its share of them ``data/NAME/share``."""

    model: str = _field(DEFAULT, "HF model folder or hub name; 'default' = the embedded tiny model", MODEL_AND_DATA)
    dataset: str = _field(
        DEFAULT,
        (
            "prompts: a JSONL or Parquet file, a folder saved by HF datasets (FOLDER[:SPLIT]), "
            "a hub dataset (NAME, NAME:SPLIT, NAME:CONFIG:SPLIT), an http(s) URL of a JSONL or Parquet file (fetched once, cached); "
            "'default' or 'default:train' = the embedded task's train split, 'default:test' its test split"
        ),
        MODEL_AND_DATA,
    )
    mix: list[str] = _field(
        [],
        (
            "a mixture of datasets in place of --dataset, one NAME[:WEIGHT]=DATASET per source, repeated "
            "(--mix math:3=math.jsonl --mix code=code.jsonl); drawn by weight, metrics under data/NAME/ (docs/datasets.md)"
        ),
        MODEL_AND_DATA,
    )
    prompt_field: str = _field("question", "dataset field holding the prompt text (or a 'messages' list)", MODEL_AND_DATA)
    answer_field: str = _field("answer", "dataset field holding the reference answer", MODEL_AND_DATA)
    prompt_template: str | None = _field(
        None,
        (
            "format of the prompt text with {prompt} (\\n and \\t typed in a shell are a line break and a tab); "
            "default: the embedded task's, else '{prompt}'"
        ),
        MODEL_AND_DATA,
        from_text=decode_escapes,
    )
    max_rows: int | None = _field(None, "use at most this many dataset rows", MODEL_AND_DATA, validator=_positive)
    skip_bad_rows: bool = _field(False, "leave out malformed dataset rows (counted) instead of stopping", MODEL_AND_DATA)
    epochs: int = _field(1, "passes over the dataset", MODEL_AND_DATA, validator=_positive)
    max_steps: int | None = _field(None, "stop after this many optimizer steps", MODEL_AND_DATA, resumable=True, validator=_positive)
    shuffle: bool = _field(True, "shuffle the dataset (with the seed) each epoch", MODEL_AND_DATA)
    fetch_timeout: float = _field(
        600.0, "seconds a dataset URL may take to download before the run stops", MODEL_AND_DATA, resumable=True, validator=_positive
    )

    backend: str = _field("local", "trainer backend (the policy being trained, and its reference)", PLUGINS)
    sampler: str | None = _field(None, "sampler plugin that generates rollouts; default: the backend's", PLUGINS)
    rollout: str = _field("single_turn", "rollout plugin", PLUGINS)
    env: str | None = _field(
        None,
        "environment plugin the policy converses with (a multi-turn rollout, e.g. --rollout multi_turn --env retry_math)",
        PLUGINS,
    )
    tool: list[str] = _field([], "tool plugin the policy may call in a multi-turn rollout; repeat for several", PLUGINS)
    reward: dict[str, float] = _field(
        {},
        "reward plugin and its weight (1 when not given); repeat for several (default: gsm8k, or env when --env is given)",
        PLUGINS,
        converter=reward_weights,
    )
    advantage: str = _field("grpo", "advantage plugin", PLUGINS)
    loss: list[str] = _field(["grpo"], "loss plugin, plus wrappers such as tis; repeat for several", PLUGINS)
    logger: list[str] = _field(["console", "jsonl"], "on_step plugins (loggers, checkpoints); repeat for several", PLUGINS)
    weight_sync: str | None = _field(None, "weight sync plugin; default: the backend's", PLUGINS)
    plugin_options: dict[str, dict[str, dict[str, Any]]] = attrs.field(
        factory=dict, metadata={"help": "kind -> plugin -> options", "cli": False}
    )

    prompt_groups_per_step: int = _field(8, "prompts per optimizer step", GRPO_STEP, validator=_positive)
    completions_per_prompt: int = _field(8, "group size G (at least 2)", GRPO_STEP, validator=_at_least_two)
    max_completion_tokens: int = _field(32, "max generated tokens per completion", GRPO_STEP, validator=_positive)
    temperature: float = _field(1.0, "sampling temperature (0 = greedy, for eval)", GRPO_STEP, validator=_non_negative)
    top_p: float = _field(1.0, "nucleus sampling threshold (1.0 = off)", GRPO_STEP)
    top_k: int = _field(0, "top-k sampling (0 = off)", GRPO_STEP)
    stop: list[str] = _field([], "stop string; repeat for several", GRPO_STEP, validator=_non_empty_strings)
    drop_zero_variance_groups: bool = _field(
        True, "skip groups whose rewards are all equal (no signal): the built-in zero_variance group filter", GRPO_STEP
    )
    weight_sync_interval: int = _field(
        1,
        "sync weights to the sampler every N steps (0 = never: the sampler keeps the initial policy; sync loop)",
        GRPO_STEP,
        validator=_non_negative,
    )
    router_replay: Literal["off", "R2", "R3"] = _field(
        "off",
        "mixture-of-experts models: the trainer's forwards use the experts the sampler routed each token to (R3) or "
        "those of the step's pi_old forward (R2); off = the routers choose (docs/moe.md)",
        GRPO_STEP,
    )
    anchor: Literal["old_policy", "sampling"] = _field(
        "old_policy",
        "ratio anchor when samples are off-policy: old_policy (extra forward) or sampling (sampler logprobs)",
        GRPO_STEP,
    )
    max_reward_failures_in_a_row: int = _field(
        64, "stop the run after this many samples in a row whose reward failed", GRPO_STEP, resumable=True, validator=_positive
    )
    reward_timeout: float = _field(
        300.0,
        "seconds one reward call may take before its samples fail (0 = no limit)",
        GRPO_STEP,
        resumable=True,
        validator=_non_negative,
    )
    minibatches_per_step: int = _field(
        1,
        "optimizer steps per step, each on a share of its groups and against the same pi_old (both loops)",
        GRPO_STEP,
        validator=_positive,
    )
    max_samples_per_fwd_bwd: int | None = _field(
        None, "split a step into forward/backward calls of at most this many samples", GRPO_STEP, validator=_positive
    )
    min_samples_per_fwd_bwd: int = _field(
        1, "a last forward/backward call with fewer samples joins the one before", GRPO_STEP, validator=_positive
    )
    # The training run (docs/training-run.md): PPO epochs, length control, group filters, dynamic sampling, evaluation.
    ppo_epochs: int = _field(
        1,
        "passes over a step's groups, each split by --minibatches-per-step, all against the step-start pi_old (both loops)",
        GRPO_STEP,
        validator=_positive,
    )
    mask_truncated: bool = _field(
        False, "a completion cut at max_completion_tokens gets no gradient (its reward still counts in its group)", GRPO_STEP
    )
    group_filter: list[str] = _field(
        [],
        (
            "group filter plugin: a scored group is trained on only if every one keeps it; repeat for several "
            "(besides the built-in zero_variance, --drop-zero-variance-groups)"
        ),
        PLUGINS,
    )
    dynamic_sampling: bool = _field(
        False,
        "sync loop: sample more prompts until the step has prompt_groups_per_step groups that pass the filters "
        "(the async loop always does)",
        GRPO_STEP,
    )
    max_sampling_rounds: int = _field(
        4,
        "with --dynamic-sampling: rollout rounds per step at most; the async loop: a step waits for at most N times "
        "prompt_groups_per_step prompts; then the step trains the groups it has",
        GRPO_STEP,
        validator=_positive,
    )
    eval_every: int = _field(
        0,
        "evaluate on held-out prompts at step 0, every N steps and at the last step, logged under eval/ (0 = never)",
        EVALUATION,
        resumable=True,
        validator=_non_negative,
    )
    eval_dataset: str | None = _field(
        None,
        "the held-out prompts, as --dataset names them (default: default:test when training on the embedded task)",
        EVALUATION,
        resumable=True,
    )
    eval_mix: list[str] = _field(
        [],
        "held-out prompts from several sources, NAME=DATASET repeated (as --mix): each also measured apart, eval/data/NAME/...",
        EVALUATION,
        resumable=True,
    )
    eval_prompts: int | None = _field(
        None, "evaluate on at most this many prompts (default: all)", EVALUATION, resumable=True, validator=_positive
    )
    eval_samples: int = _field(
        4,
        "samples per prompt at the training temperature: eval/reward_mean and eval/pass@K",
        EVALUATION,
        resumable=True,
        validator=_positive,
    )
    eval_pass_threshold: float = _field(1.0, "a sample passes when its total reward reaches this", EVALUATION, resumable=True)

    learning_rate: float = _field(1e-5, "peak learning rate (AdamW)", OPTIMIZER, validator=_non_negative)
    lr_schedule: Literal["constant", "linear", "cosine"] = _field("constant", "decay after warmup", OPTIMIZER)
    warmup_steps: int = _field(0, "linear warmup steps", OPTIMIZER, validator=_non_negative)
    beta1: float = _field(0.9, "Adam beta1, in [0, 1)", OPTIMIZER, validator=_unit_interval)
    beta2: float = _field(0.999, "Adam beta2, in [0, 1)", OPTIMIZER, validator=_unit_interval)
    adam_eps: float = _field(1e-8, "Adam epsilon (> 0)", OPTIMIZER, validator=_positive)
    weight_decay: float = _field(0.0, "AdamW weight decay", OPTIMIZER, validator=_non_negative)
    grad_clip_norm: float = _field(1.0, "clip the gradient norm (0 = off)", OPTIMIZER, validator=_non_negative)
    optimizer_state: Literal["auto", "fp32", "bf16", "8bit", "offload"] = _field(
        "auto",
        (
            "local trainer: how AdamW's two moments are kept, per trained parameter: fp32 = 8 bytes; bf16 = 4 bytes "
            "(stochastic rounding); 8bit = 2 bytes (blockwise power-law codes, a scale per 256); offload = 8 bytes in "
            "pinned host memory, none on the GPU (CUDA only); the update is float32 math in every case; auto = the first "
            "of fp32, bf16, 8bit, offload whose memory plan fits the device's free memory with 10% to spare (the start "
            "line says which and why); other backends: fp32"
        ),
        OPTIMIZER,
    )
    max_nonfinite_steps_in_a_row: int = _field(
        3,
        "a non-finite loss or gradient skips the optimizer step; this many in a row stop the run",
        OPTIMIZER,
        resumable=True,
        validator=_positive,
    )

    lora_rank: int = _field(
        0,
        "LoRA rank: train low-rank adapters instead of every weight (0 = off, full fine-tuning)",
        LORA,
        validator=_non_negative,
    )
    lora_alpha: float = _field(32.0, "LoRA alpha: the adapters' update is scaled by alpha / rank", LORA, validator=_positive)
    lora_target_modules: list[str] = _field(
        ["auto"],
        (
            "modules that get adapters: auto = the model type's attention and MLP projections (MoE experts included), "
            "auto-no-experts = the same without the experts, all-linear = every linear layer but the output head, "
            "or names as in the model; repeat for several; a MoE router never gets adapters"
        ),
        LORA,
    )

    train_vision: bool = _field(
        False,
        (
            "a vision-language model: train its vision tower and projector too (adapters on them with --lora-rank, "
            "every weight without); off = they stay frozen and only the language model trains (docs/images.md)"
        ),
        MODEL_AND_DATA,
    )

    loop: Literal["sync", "async"] = _field(
        "sync", "sync: sample, then train; async: rollouts run while the trainer trains (docs/async.md)", ASYNC
    )
    max_head_offpolicy_versions: int = _field(
        1,
        "async: a trained sample is at most this many policy versions older than the trainer (0 = on-policy)",
        ASYNC,
        validator=_non_negative,
    )
    max_concurrent: int | None = _field(
        None,
        (
            "async: most rollout calls in flight at once (default: all the gate admits, "
            "prompt_groups_per_step x (max_head_offpolicy_versions + 1), times completions_per_prompt for a per_trajectory rollout)"
        ),
        ASYNC,
        resumable=True,
        validator=_positive,
    )
    synchronous_training: bool = _field(
        False, "async: drain every rollout before each step (the on-policy baseline; same results as --loop sync)", ASYNC
    )
    rollout_retries: int = _field(
        3,
        "async: retries of a rollout that raised a retryable error (timeouts, connection errors)",
        ASYNC,
        resumable=True,
        validator=_non_negative,
    )
    rollout_retry_backoff: float = _field(
        1.0, "async: seconds before the first retry, doubled at each next one", ASYNC, resumable=True, validator=_non_negative
    )
    max_rollout_failures_in_a_row: int = _field(
        8, "async: stop the run after this many rollouts in a row failed", ASYNC, resumable=True, validator=_positive
    )
    max_rollout_failure_rate: float = _field(
        0.5,
        "async: stop the run when more than this share of the last rollout_failure_window rollouts failed",
        ASYNC,
        resumable=True,
        validator=_non_negative,
    )
    rollout_failure_window: int = _field(
        50, "async: rollouts over which the failure rate is measured", ASYNC, resumable=True, validator=_positive
    )

    run_dir: str | None = _field(
        None, "where to write config, metrics, checkpoints and the final policy (default runs/<time>)", RUN_DIRECTORY
    )
    checkpoint_every: int = _field(
        50,
        "write a checkpoint every N steps, and always at the end (0 = only at the end)",
        RUN_DIRECTORY,
        resumable=True,
        validator=_non_negative,
    )
    keep_checkpoints: int = _field(2, "keep the newest K checkpoints", RUN_DIRECTORY, resumable=True, validator=_positive)
    allow_low_disk: bool = _field(
        False,
        "start even when the disk plan says the run directory's filesystem cannot hold the checkpoints and final/",
        RUN_DIRECTORY,
        resumable=True,
    )

    device: Literal["auto", "cpu", "cuda"] = _field("auto", "auto = CUDA when present, else CPU", MACHINE)
    dtype: Literal["auto", "float32", "bfloat16"] = _field(
        "auto", "auto = bfloat16 on CUDA, float32 on CPU; bfloat16 = bf16 weights and reference, fp32 Adam moments", MACHINE
    )
    gradient_checkpointing: bool | None = _field(
        None,
        "local and fsdp trainers: recompute each layer's activations in backward instead of keeping them (less memory, "
        "~1/3 more training compute); not given = on with CUDA, where activations are most of a step's memory, off on a CPU",
        MACHINE,
    )
    memory_check: bool = _field(
        True,
        (
            "local and fsdp trainers (fsdp: per rank): before loading, estimate the run's peak memory from the model's "
            "config.json and refuse a run that cannot fit the device's free memory (--no-memory-check runs it anyway)"
        ),
        MACHINE,
        resumable=True,
    )
    threads: int | None = _field(
        None,
        "CPU threads for torch (default: OMP_NUM_THREADS, else half the CPUs, at least 1)",
        MACHINE,
        resumable=True,
        validator=_positive,
    )
    seed: int = _field(0, "seed for data order, sampling and init (CPU runs repeat exactly)", MACHINE)

    def __attrs_post_init__(self) -> None:
        if not self.reward:
            # An environment scores its own conversations; without one the embedded task's reward.
            self.reward = {"env" if self.env else "agent" if self.rollout == "agent" else "gsm8k": 1.0}
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    def is_default_model(self) -> bool:
        return self.model == DEFAULT

    @property
    def sampling_runs_ahead(self) -> bool:
        """Sampling may run on weights older than the trainer's (a weight-sync interval over 1, or the
        async loop): an in-process sampler then samples from a copy of its own, never the trainer's.
        Core decides it, so a sampler needs to know no loop."""
        return self.weight_sync_interval != 1 or self.loop == "async"

    @property
    def sequences_per_update(self) -> int:
        """Sequences one optimizer update trains on (the memory plan sizes a step by it): a share of a step's groups."""
        return self.prompt_groups_per_step * self.completions_per_prompt // self.minibatches_per_step

    @property
    def shares_prompts(self) -> bool:
        """A step's sequences come in groups that share their prompt (a trainer may run each prompt once for its group)."""
        return True

    @property
    def samples_while_training(self) -> bool:
        """Rollouts run while the trainer trains (the async loop): an engine that shares the device
        with the trainer never idles, so it can never free its memory between steps."""
        return self.loop == "async"

    def options_for(self, kind: str, name: str) -> dict[str, Any]:
        return dict(self.plugin_options.get(kind, {}).get(name, {}))

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


SFT_RUN_FIELDS = (
    "model", "dataset", "mix", "prompt_field", "prompt_template", "max_rows", "skip_bad_rows", "epochs", "max_steps", "shuffle",
    "fetch_timeout",
    "backend", "rollout", "logger", "max_samples_per_fwd_bwd", "min_samples_per_fwd_bwd",
    "eval_every", "eval_dataset", "eval_mix", "eval_prompts",
    "learning_rate", "lr_schedule", "warmup_steps", "beta1", "beta2", "adam_eps", "weight_decay", "grad_clip_norm",
    "optimizer_state", "max_nonfinite_steps_in_a_row", "lora_rank", "lora_alpha", "lora_target_modules",
    "run_dir", "checkpoint_every", "keep_checkpoints", "allow_low_disk",
    "device", "dtype", "gradient_checkpointing", "memory_check", "threads", "seed",
)  # fmt: skip
"""The settings of ``grpo-core run`` that mean the same in ``grpo-core sft`` (the rollout: how a
prompt is encoded; the eval ones: the held-out rows whose loss is measured)."""


@attrs.define
class SFTConfig(RunConfig):
    """Every setting of ``grpo-core sft``: the run settings of :data:`SFT_RUN_FIELDS` (the trainer
    reads the others at their defaults) and those of supervised fine-tuning."""

    command: ClassVar[str] = "sft"
    preset: ClassVar[Path] = SFT_PRESET
    tracked: ClassVar[str] = "loss"
    drawn: ClassVar[str] = "examples"
    kinds: ClassVar[tuple[str, ...]] = ("backend", "rollout", "logger")

    completion_field: str = _field(
        "completion",
        "dataset field holding the target that follows the prompt: text, or token ids taken as they are (rows with 'messages' need none)",
        SFT,
    )
    completion_template: str = _field(
        "{completion}",
        "format of the target text with {completion} (\\n and \\t typed in a shell are a line break and a tab)",
        SFT,
        from_text=decode_escapes,
    )
    examples_per_step: int = _field(8, "examples per optimizer step", SFT, validator=_positive)
    max_seq_len: int | None = _field(
        None, "longest example in tokens, prompt and target (default: the model's context)", SFT, validator=_positive
    )
    long_examples: Literal["error", "truncate", "skip"] = _field(
        "error",
        "an example over --max-seq-len: stop with an error naming it, cut its target to fit (counted: data/truncated_examples), "
        "or leave it out (counted: data/skipped_long_examples)",
        SFT,
    )

    @property
    def sequences_per_update(self) -> int:
        return self.examples_per_step

    @property
    def shares_prompts(self) -> bool:
        return False


SFTConfig.given_fields = (*SFT_RUN_FIELDS, *(f.name for f in attrs.fields(SFTConfig) if f.metadata.get("section") == SFT))


def cli_fields(config_class: type[RunConfig] = RunConfig) -> list[attrs.Attribute]:
    """The settings a user gives ``config_class``'s command (flags, TOML keys)."""
    attrs.resolve_types(config_class)
    names = config_class.given_fields
    return [f for f in attrs.fields(config_class) if f.metadata.get("cli", True) and (names is None or f.name in names)]


def check_given(config: RunConfig, given: Iterable[str]) -> None:
    """Settings a user gave that would do nothing with the rest of the config are refused, naming
    what they belong to: the async loop's settings under ``--loop sync``, LoRA's without a rank."""
    sections = {f.name: f.metadata["section"] for f in cli_fields(type(config))}
    for key in given:
        flag = f"--{key.replace('_', '-')}"
        if sections.get(key) == ASYNC and key != "loop" and config.loop != "async":
            raise PluginError(f"{flag} belongs to the asynchronous loop (--loop async); under --loop {config.loop} it would do nothing")
        if key in ("max_concurrent", "max_head_offpolicy_versions") and config.synchronous_training:
            raise PluginError(
                f"{flag} bounds the rollouts that overlap training; --synchronous-training runs one batch at a time, "
                "none while a step trains, so it would do nothing"
            )
        if key == "min_samples_per_fwd_bwd" and config.max_samples_per_fwd_bwd is None:
            raise PluginError(
                f"{flag} joins a short last forward/backward call to the one before; without --max-samples-per-fwd-bwd "
                "a step is one call, so it would do nothing"
            )
        if sections.get(key) == LORA and key != "lora_rank" and config.lora_rank == 0:
            raise PluginError(f"{flag} sets LoRA adapters, which only --lora-rank > 0 trains; without it, it would do nothing")


def resumable_fields(config_class: type[RunConfig] = RunConfig) -> list[str]:
    """Settings a resumed run may change: none of them changes what a step computes."""
    return [f.name for f in cli_fields(config_class) if f.metadata["resumable"]]


def typed_value(field: attrs.Attribute, value: Any) -> Any:
    """A value (a flag's text, a TOML or JSON value) as ``field`` holds it."""
    value = coerce([value] if field.type == list[str] and isinstance(value, str) else value, field.type)
    return field.converter(value) if field.converter is not None else value


def given_value(field: attrs.Attribute, value: Any) -> Any:
    """A value a user gave (a flag, a TOML key) as ``field`` holds it: its text is read here, once."""
    from_text = field.metadata.get("from_text")
    return typed_value(field, from_text(value) if from_text is not None and isinstance(value, str) else value)


def parse_plugin_opts(kind: str, items: list[str], selected: list[str] | None) -> dict[str, dict[str, Any]]:
    """``["eps_high=0.28"]`` or ``["gsm8k.strict=true"]`` -> {plugin: {option: value}}.

    ``selected`` None: the kind's default plugin, named later (``DEFAULT_CHOICE`` holds its options).
    """
    result: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise PluginError(f"--{kind}-opt: expected key=value, got a value without '=' (not shown: it may be a secret)")
        plugin, dot, option = key.partition(".")
        # An error quotes what was typed, with a secret's value as *** (config.json's rule).
        shown = f"{key}={REDACTED if is_secret(option or plugin) else value}"
        if selected == []:
            flag = "--group-filter" if kind == "group_filter" else f"--{kind.replace('_', '-')}"
            raise PluginError(f"--{kind}-opt '{shown}': no {kind} plugin is selected, so it would do nothing; select one with {flag} NAME")
        if not dot:
            if selected is not None and len(selected) != 1:
                raise PluginError(
                    f"--{kind}-opt '{shown}': several {kind} plugins are selected ({', '.join(selected)}); write NAME.{shown}"
                )
            plugin, option = DEFAULT_CHOICE if selected is None else selected[0], key
        elif selected is not None and plugin not in selected:
            raise PluginError(f"--{kind}-opt '{shown}': {kind} '{plugin}' is not selected ({', '.join(selected)})")
        result.setdefault(plugin, {})[option] = value
    return result


def selected_names(config: RunConfig, kind: str) -> list[str] | None:
    """The plugins of ``kind`` the config names; None for a default yet to be named (a kind's ``default_from``)."""
    return selected_names_from(attrs.asdict(config), kind)


def read_stored_config(path: Path) -> dict[str, Any]:
    """A run's ``config.json``; a file cut short or edited into something else is the user's to fix."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PluginError(f"{path} cannot be read ({exc}): it was cut short or edited; restore it from a copy") from None
    if not isinstance(stored, dict):
        raise PluginError(f"{path} holds no run configuration (a JSON object); restore it from a copy")
    return stored


def selected_names_from(stored: dict[str, Any], kind: str) -> list[str] | None:
    value = stored.get(kind)
    if value is None:
        return None if KIND_TABLE[kind].default_from else []
    return list(value) if isinstance(value, (list, dict)) else [value]


def load(
    config_file: str | None, overrides: dict[str, Any], plugin_opts: dict[str, list[str]], config_class: type[RunConfig] = RunConfig
) -> RunConfig:
    """Merge a TOML file, CLI overrides and ``--<kind>-opt`` lists into a validated ``config_class``.

    The TOML values and ``overrides`` are read as a user gave them (see ``given_value``): the
    place where text typed in a shell or a file becomes the typed config, once.
    """
    values: dict[str, Any] = {}
    table_opts: dict[str, dict[str, dict[str, Any]]] = {}
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise PluginError(f"config file not found: {path}")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise PluginError(f"{path}: invalid TOML: {exc}") from None
        for key, value in data.items():
            if key in KIND_TABLE and isinstance(value, dict):
                # [loss.cispo] both selects a plugin and sets its options; a reward table may
                # carry its weight.
                for name, opts in value.items():
                    if not isinstance(opts, dict):
                        raise PluginError(
                            f"{path}: [{key}] {name} = {opts!r}: a plugin's options go in a table of their own, [{key}.{name}] "
                            f'(an empty one selects it); or select it with {key} = ["{name}"]'
                        )
                table_opts[key] = {name: dict(opts) for name, opts in value.items()}
                if KIND_TABLE[key].weighted:
                    values[key] = {name: opts.pop("weight", 1.0) for name, opts in table_opts[key].items()}
                else:
                    names = list(value)
                    values[key] = names if KIND_TABLE[key].listed else (names[0] if len(names) == 1 else names)
            else:
                values[key] = value
    values.update({k: v for k, v in overrides.items() if v is not None})
    if values.get("model", DEFAULT) == DEFAULT and embedded_split(str(values.get("dataset", DEFAULT))) is not None:
        # The embedded model and task come with settings tuned for them; anything given wins.
        preset = tomllib.loads(config_class.preset.read_text()) if config_class.preset.is_file() else {}
        values = {**preset, **values}
    fields = {f.name: f for f in cli_fields(config_class)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        field = fields.get(key)
        if field is None:
            raise PluginError(f"unknown config key '{key}'" + (f" in {config_file}" if config_file else ""))
        try:
            kwargs[key] = given_value(field, value)
        except (TypeError, ValueError) as exc:
            raise PluginError(f"config '{key}': {exc}") from None
    try:
        config = config_class(**kwargs)
    except (TypeError, ValueError) as exc:
        raise PluginError(f"config: {exc}") from None
    check_given(config, kwargs)
    merged: dict[str, dict[str, dict[str, Any]]] = {}
    for kind in KIND_TABLE:
        selected = selected_names(config, kind) if hasattr(config, kind) else []
        opts = {name: dict(o) for name, o in table_opts.get(kind, {}).items()}
        for name, o in parse_plugin_opts(kind, plugin_opts.get(kind, []), selected).items():
            opts.setdefault(name, {}).update(o)
        opts = {name: o for name, o in opts.items() if o}
        if opts:
            merged[kind] = opts
    config.plugin_options = merged
    return config
