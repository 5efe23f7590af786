"""The plugin kinds: per kind its hooks, how many of its plugins run, and the attributes read from
its plugins besides hooks; and what is read from the trainer and sampler objects plugins make.

Part of the contract of ``grpo_core.hookspecs``, which re-exports all of it and is where plugins
read it from. It is a module of its own so that the config, which hookspecs' signatures name,
can read the table without an import circle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import attrs

from grpo_core.errors import PluginError

# Declared attributes: besides hook arguments and results, core reads these (and only these) from a
# plugin (a class attribute, an option or a property) or from the trainer and sampler the backend
# and sampler plugins make, and a plugin reads these (and only these) from another's objects.
# A plugin that does not set one gets its default; ``grpo_core.plugins_manager.plugin_problems``
# refuses a plugin class that sets one with the wrong type, and :func:`declared` an instance.

ACCEPTS: dict[str, Callable[[Any], bool]] = {
    "bool": lambda v: isinstance(v, bool),
    "bool | None": lambda v: v is None or isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "int | None": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "str": lambda v: isinstance(v, str),
    "str | None": lambda v: v is None or isinstance(v, str),
    "callable | None": lambda v: v is None or callable(v),
    "object | None": lambda v: True,
    "dict | None": lambda v: v is None or isinstance(v, dict),
    "dict[str, str]": lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()),
}


@attrs.frozen
class Attribute:
    """One declared attribute: its type, its default, and what core does with it."""

    type: str
    """A key of ``ACCEPTS``."""
    default: Any
    doc: str

    def accepts(self, value: Any) -> bool:
        return ACCEPTS[self.type](value)


@attrs.frozen
class Kind:
    """One plugin kind: the hooks its plugins implement, how many of them a run selects, and what
    core and other plugins read from them besides hooks."""

    hooks: tuple[str, ...]
    """The hooks a plugin of the kind may implement; it must implement at least one. The first is
    the kind's own: where one plugin runs, the implementations of it (wrappers aside) are counted."""
    runs: Literal["one", "at most one", "one or more", "any"]
    """How many of its plugins a run selects."""
    required: tuple[str, ...] = ()
    """Hooks every plugin of the kind implements (a run checks prompts with the backend's
    tokenizer, then trains; a tool is described to the policy, then called)."""
    wrapped: bool = False
    """Besides the one, any number of wrappers (``@hookimpl(wrapper=True)``) compose around it: the
    config names them all in one list (loss)."""
    weighted: bool = False
    """Selected with a weight each (``--reward NAME[:WEIGHT]``): the config holds name -> weight."""
    default_from: tuple[str, ...] = ()
    """Kinds (earlier in the table) whose ``default_<kind>`` attribute names the plugin a run uses
    when the config names none: the first that names one wins."""
    attributes: dict[str, Attribute] = attrs.field(factory=dict)
    """What is read from a plugin of the kind besides its hooks (see ``ATTRIBUTES``)."""

    @property
    def listed(self) -> bool:
        """The config names its plugins in a list (a TOML array, a repeatable flag)."""
        return self.wrapped or (self.runs in ("one or more", "any") and not self.weighted)


KIND_TABLE: dict[str, Kind] = {
    "backend": Kind(
        hooks=("make_trainer", "load_tokenizer", "make_reference"),
        runs="one",
        required=("load_tokenizer", "make_trainer"),
        attributes={
            "default_sampler": Attribute("str", "local", "the sampler plugin a run uses when --sampler is not given"),
            "default_weight_sync": Attribute(
                "str", "in_process", "the weight sync a run uses when neither --weight-sync nor the sampler plugin names one"
            ),
            "local_checkpoints": Attribute(
                "bool",
                True,
                "its trainer's save_state writes the weights and optimizer state into the checkpoint folder, so the disk plan "
                "at start counts them; False: a service keeps them, and the plan counts final/ only",
            ),
            "checkpoint_weights": Attribute(
                "str | None",
                None,
                "the dtype its checkpoints hold the weights in whatever --dtype (fsdp: float32, its master weights), for "
                "the disk plan at start; None: --dtype's",
            ),
            "serve_rank": Attribute(
                "callable | None",
                None,
                "serve_rank(config) -> exit code: what a process torchrun started as a rank other than 0 runs instead of the loop; "
                "None: the backend trains in one process, and torchrun is refused",
            ),
        },
    ),
    "sampler": Kind(
        hooks=("make_sampler",),
        runs="one",
        default_from=("backend",),
        attributes={
            "default_weight_sync": Attribute(
                "str | None", None, "the weight sync that reaches this sampler (a server's: vllm); None: the backend's"
            ),
        },
    ),
    "weight_sync": Kind(hooks=("weight_sync",), runs="one", default_from=("sampler", "backend")),
    "rollout": Kind(
        hooks=("rollout",),
        runs="one",
        attributes={
            "per_trajectory": Attribute(
                "bool", False, "--loop async calls it with one prompt and num_samples=1, G calls per group (see the rollout hook)"
            ),
            "encode": Attribute(
                "callable | None", None, "encode(tokenizer, prompt) -> token ids: every prompt is measured against the context at start"
            ),
            "long_prompts": Attribute("str", "error", "'skip': a prompt too long for the context is skipped (counted), else refused"),
            "chat_template": Attribute("bool | None", None, "whether it wraps plain prompts in the chat template (eval says so)"),
            "token_prompts": Attribute("bool", False, "it samples pre-tokenized rows (Prompt.tokens) as they are; else those are refused"),
        },
    ),
    "env": Kind(
        hooks=("env_reset",),
        runs="at most one",
        attributes={"needs_answer": Attribute("bool", False, "every dataset row must carry a reference answer")},
    ),
    "tool": Kind(hooks=("tool_spec", "tool_call"), runs="any", required=("tool_spec", "tool_call")),
    "reward": Kind(
        hooks=("reward",),
        runs="one or more",
        weighted=True,
        attributes={
            "needs_answer": Attribute("bool", False, "every dataset row must carry a reference answer"),
            "needs_env": Attribute("bool", False, "it scores what an environment gave: a run refuses it without --env"),
        },
    ),
    "advantage": Kind(hooks=("advantage", "prepare_advantages"), runs="one", required=("advantage",)),
    "group_filter": Kind(
        hooks=("keep_group", "keep_prompt"),
        runs="any",
        attributes={
            "state_dict": Attribute(
                "callable | None", None, "state_dict() -> JSON of what its answers depend on: each checkpoint holds it"
            ),
            "load_state_dict": Attribute(
                "callable | None", None, "load_state_dict(state): a resumed run hands back what state_dict() gave at its checkpoint"
            ),
        },
    ),
    "loss": Kind(
        hooks=("loss",),
        runs="one",
        wrapped=True,
        attributes={
            "needs_reference": Attribute("bool", False, "the run makes the frozen reference and passes ref_logprobs (KL on)"),
            "service_loss": Attribute(
                "dict | None",
                None,
                "the Tinker service's built-in loss that computes what this loss computes, as {'loss_fn': "
                "'importance_sampling' | 'ppo' | 'cispo', 'agg': its aggregation, 'loss_fn_config': the service's options "
                "or None}: the tinker backend trains with it in one call; None: only its loss hook computes it",
            ),
        },
    ),
    "logger": Kind(hooks=("on_run_start", "on_step", "on_run_end"), runs="any"),
}
"""Every plugin kind, in the order the catalog lists them. A new kind is one entry here plus its
hookspecs in ``grpo_core.hookspecs`` (and, for a ``--KIND NAME`` flag, its setting in ``RunConfig``)."""

OBJECT_ATTRIBUTES: dict[str, dict[str, Attribute]] = {
    "trainer object": {
        "run_info": Attribute(
            "dict[str, str]", {}, "how it trains (its forward, padding...), in words: written to config.json's run_info.trainer"
        ),
        "routing_problem": Attribute(
            "str | None",
            "the backend does not force or return mixture-of-experts routing",
            "why --router-replay is refused (None: forward_backward_custom forces the routes a datum carries in "
            "loss_fn_inputs['routed_experts'] and returns each datum's routing, used and chosen, in its outputs; "
            "forward_routed(datums) -> (logprobs, routes) records)",
        ),
        "local_policy": Attribute(
            "callable | None",
            None,
            "local_policy() -> the local trainer whose model an in-process sampler (local) generates with, when the trainer "
            "is not that one itself (fsdp: the whole copy rank 0 keeps); None: the trainer itself",
        ),
        "perf_counters": Attribute(
            "callable | None",
            None,
            "perf_counters() -> {'parameters': N, 'peak_flops': FLOP/s, 'peak_memory_gib': GiB, 'forward_tokens': T}, any of "
            "them, read at each step's end: T the tokens its forward_backward calls ran since the last call (a shared prompt "
            "once; default train/forward_tokens, the tokens it was sent), perf/train_tokens_per_s is T / time/train, perf/mfu "
            "6·N·T / time/train / peak_flops, perf/peak_memory_gib the memory at its peak since the last call; None: neither "
            "mfu nor memory is logged",
        ),
        "checkpoint_bytes": Attribute(
            "int | None",
            None,
            "the bytes its save_state writes (weights, optimizer state), for the disk plan at start; None: core's estimate "
            "from the model's safetensors headers, --dtype and --lora-rank (fp32 AdamW moments, 8 B per trained parameter)",
        ),
        "state_snapshot": Attribute(
            "callable | None",
            None,
            "state_snapshot() -> write(path): copies what save_state writes to host memory now (CPU tensors; on CPU a clone) "
            "and returns the function that writes that copy as save_state would, from another thread: periodic checkpoints "
            "are then written while training goes on; None: save_state runs on the training thread",
        ),
        "save_adapter_for_sampler": Attribute(
            "callable | None",
            None,
            "save_adapter_for_sampler(path): writes the trained LoRA adapters alone as a PEFT adapter folder "
            "(adapter_config.json, adapter_model.safetensors) that vLLM loads as a LoRA adapter (weight sync vllm "
            "method=adapter, auto's choice where it is set); None: it trains every weight",
        ),
        "sampling_client": Attribute(
            "callable | None",
            None,
            "sampling_client() -> a Tinker sampling client of its current weights, which the tinker sampler samples from; "
            "None: the tinker sampler is refused",
        ),
    },
    "episode object": {
        "scored_at_end": Attribute(
            "bool",
            False,
            "True: the environment scores a conversation only when its episode ends (step answers done=True: a rubric "
            "run at the end), so one the rollout cuts short first (its token budget, a prefix mismatch) has no score: "
            "its env_reward is None, which reward 'env' counts in reward/failed; False: the rewards its steps gave "
            "are its score wherever it ends",
        ),
    },
    "sampler object": {
        "run_info": Attribute("dict[str, str]", {}, "how it samples (its forward...), in words: written to config.json's run_info.sampler"),
        "own_weights": Attribute("bool", True, "False: it samples from the trainer's own weights (shared), which --loop async refuses"),
        "concurrent_samples": Attribute("int", 1, "how many sample calls the async loop's workers may make at once"),
        "routing_problem": Attribute(
            "str | None",
            "the sampler does not return the experts it routed each token to",
            "why --router-replay R3 is refused (None: a mixture-of-experts model's completions carry routed_experts)",
        ),
        "takes_images": Attribute(
            "bool",
            False,
            "True: sample(prompts, num_samples, params, images=...) takes each prompt's PromptImages (its images' sources, "
            "its processor's tensors and its chat; None for a text prompt) and generates with them; "
            "False: a run with image prompts refuses it",
        ),
        "stateless": Attribute(
            "bool",
            False,
            "True for a server: it checkpoints nothing, and the run sends it the weights it must sample from at start, "
            "on resume and at the end; False: it has state_dict() and load_state_dict(state) (its RNG, version, own weights)",
        ),
        "load_weights_from": Attribute(
            "callable | None",
            None,
            "load_weights_from(trainer): it takes the trainer's current weights in this process (weight sync in_process "
            "calls it); None: in_process cannot reach it",
        ),
        "client": Attribute(
            "object | None",
            None,
            "the ServerClient (grpo_core.remote.server_client) of the OpenAI-compatible server it samples from, which "
            "weight sync vllm reloads and checks; None: it samples from no such server",
        ),
        "load_weights": Attribute(
            "callable | None",
            None,
            "load_weights(weights, max_staged_bytes) -> bytes loaded: an engine in this process loads weights() (checkpoint "
            "names, tensors) in place, read by weight sync vllm_engine; None: it takes no weights from memory",
        ),
        "prompt_logprobs": Attribute(
            "callable | None",
            None,
            "prompt_logprobs(tokens) -> the engine's logprob of each token given those before (0.0 first): the check after "
            "weight sync vllm_engine; None: it scores no prompts",
        ),
    },
}
"""What core and plugins read from the objects ``make_trainer`` and ``make_sampler`` return."""

ATTRIBUTES: dict[str, dict[str, Attribute]] = {**{name: kind.attributes for name, kind in KIND_TABLE.items()}, **OBJECT_ATTRIBUTES}
"""Per plugin kind, and per ``"trainer object"``, ``"sampler object"`` (what ``make_trainer``,
``make_sampler`` return), the attributes read from it: by core, or by another plugin (a weight
sync from the sampler, a sampler from the trainer), always through :func:`declared`."""


def attributes_of(kind: str) -> dict[str, Attribute]:
    """The declared attributes of a plugin of ``kind``, or of a ``"trainer object"``, a ``"sampler object"``."""
    return KIND_TABLE[kind].attributes if kind in KIND_TABLE else OBJECT_ATTRIBUTES[kind]


def declared(obj: Any, kind: str, name: str) -> Any:
    """The declared attribute ``name`` of a plugin of ``kind`` (or of a ``"trainer object"``, a ``"sampler object"``):
    its value, or its default when ``obj`` does not set it; a PluginError when the value has
    another type than declared."""
    attribute = attributes_of(kind)[name]
    value = getattr(obj, name, attribute.default)
    if not attribute.accepts(value):
        raise PluginError(f"{type(obj).__name__}.{name} must be {attribute.type} (declared in grpo_core.hookspecs), got {value!r}")
    return value
