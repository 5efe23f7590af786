"""The hook specifications: the contract between the core and every plugin.

A plugin is a class. Its attrs fields are its options, its docstring is its help, and each
method marked ``@hookimpl`` implements the hook of the same name below. A run instantiates
only the plugins its config names and registers those instances on a fresh plugin manager.

``KIND_TABLE`` says, per plugin kind, which hooks its plugins implement, how many a run
selects and what core reads from them besides hooks; the catalog, the checks at start-up
(``grpo_core.plugins_manager``), the selection, the config and the Python API all derive from it:
- single-choice stages (backend, sampler, weight_sync, rollout, advantage, loss) have exactly one
  implementation; their hooks are ``firstresult``.
- ``env`` (``--env NAME``) is at most one environment; ``tool`` (``--tool NAME``, repeatable) any
  number of tools, each called by the rollout when the policy names it.
- ``check_config`` (any kind may implement it), ``reward`` and ``on_step``, ``on_run_start``,
  ``on_run_end`` are called on every active plugin;
  ``keep_group`` on every selected group filter, in order, until one drops the group;
  ``keep_prompt`` on every group filter that implements it, before a prompt is rolled out.
- ``loss`` wrappers (``@hookimpl(wrapper=True)``, such as TIS) compose around the one loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

# The kind table and the declared attributes are part of this contract, and read from here; they
# live in grpo_core.kinds so that the config, which the signatures below name, can read the table.
from grpo_core.kinds import (  # noqa: F401
    ACCEPTS,
    ATTRIBUTES,
    KIND_TABLE,
    OBJECT_ATTRIBUTES,
    Attribute,
    Kind,
    attributes_of,
    declared,
)

if TYPE_CHECKING:
    from grpo_core.backend import PolicyScorer, Reference, Sampler, Trainer
    from grpo_core.config import RunConfig
    from grpo_core.loss import LossInputs, LossOutput
    from grpo_core.types import Episode, Prompt, RunState, Sample, SamplingParams

PROJECT = "grpo_core"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec(firstresult=True)
def load_tokenizer(config: RunConfig) -> tuple[Any, int | None]:
    """The tokenizer of ``config.model`` and its longest context, without loading the weights
    (first result wins; kind ``backend``). Lets a run check every prompt before the model loads.

    :param config: the resolved run configuration.
    :returns: ``(tokenizer, max_context)``; max_context is None when the model does not say.
    """


@hookspec
def check_config(config: RunConfig, plugins: dict[str, list[Any]]) -> None:
    """Refuse what this plugin cannot do with ``config``, before anything loads: called on every
    selected plugin of any kind once the plugins are chosen, before the data, the tokenizer and
    the models (a model load or an engine start can take minutes, a refusal should not wait for
    them). Raise ``grpo_core.errors.PluginError`` naming the input and the fix.

    :param config: the resolved run configuration.
    :param plugins: the selected plugins by kind, defaults resolved (a weight sync reads the sampler
        plugin it must reach, a backend the sampler it must share a process with); read their
        declared attributes, as everywhere.
    """


@hookspec(firstresult=True)
def make_trainer(config: RunConfig, needs_reference: bool) -> Trainer:
    """Create the policy trainer for ``config.model`` (first result wins; kind ``backend``).

    :param config: the resolved run configuration (model, device, dtype, seed, ...).
    :param needs_reference: the loss uses a frozen reference (``make_reference`` follows): a
        memory plan counts one only then.
    :returns: an object implementing :class:`grpo_core.backend.Trainer`.
    """


@hookspec(firstresult=True)
def make_sampler(config: RunConfig, trainer: Trainer) -> Sampler:
    """Create the sampler that generates rollouts (first result wins; kind ``sampler``, chosen
    with ``--sampler`` or by the backend's ``default_sampler``).

    :param config: the resolved run configuration.
    :param trainer: the trainer made by ``make_trainer``; a local sampler may share its weights.
    :returns: an object implementing :class:`grpo_core.backend.Sampler`.
    """


@hookspec(firstresult=True)
def make_reference(config: RunConfig, trainer: Trainer) -> Reference:
    """Create the frozen reference policy; called only when the loss needs one (KL on).

    :param config: the resolved run configuration.
    :param trainer: the trainer; the reference starts from its initial weights.
    :returns: an object implementing :class:`grpo_core.backend.Reference`.
    """


@hookspec(firstresult=True)
def weight_sync(trainer: Trainer, sampler: Sampler, step: int) -> int:
    """Bring the trainer's current weights to the sampler (first result wins).

    Called after an optimizer step when ``step % weight_sync_interval == 0`` (never with 0, but
    for a server sampler at the start and at the end of a run).

    :param trainer: the policy trainer holding the new weights.
    :param sampler: the sampler to update.
    :param step: the number of optimizer steps taken so far.
    :returns: the policy version the sampler now samples from (the trainer's version).
    """


@hookspec(firstresult=True)
def rollout(
    prompts: Sequence[Prompt],
    num_samples: int,
    sampler: Sampler,
    params: SamplingParams,
    env: Callable[[Prompt], Episode] | None,
    tools: Mapping[str, Any],
) -> list[list[Sample]]:
    """Produce ``num_samples`` samples for each prompt (first result wins; kind ``rollout``).

    The synchronous loop calls it with a whole step's batch of prompt groups so a sampler can
    generate them together; the async loop calls it with one prompt per call (with
    ``--synchronous-training``, the step's batch). A rollout whose ``per_trajectory`` attribute
    (a class attribute or an option) is true makes each trajectory on its own: the async loop
    then calls it with one prompt and ``num_samples=1``, G calls per group from as many worker
    threads, so a trajectory waiting on its environment holds up no other. It must still answer
    any call, as the synchronous loop makes them.

    :param prompts: the prompts of this step's groups.
    :param num_samples: completions per prompt (the group size G).
    :param sampler: generates tokens; ``sampler.tokenizer`` encodes and decodes text.
    :param params: generation knobs (max tokens, temperature, top-p/k, stops).
    :param env: the selected environment (``--env``): ``env(prompt)`` starts one episode
        (:class:`grpo_core.types.Episode`) through its ``env_reset`` hook; None when no
        environment is selected. A rollout that takes no environment omits this argument, and a
        run refuses ``--env`` with it.
    :param tools: the selected tools (``--tool``) by the name the policy calls them
        (``tool_spec()["name"]``); empty when none. A rollout that calls no tools omits it.
    :returns: one list of samples per prompt, in the order of ``prompts``. A multi-turn rollout
        fills ``Sample.turns`` and, with an environment, ``Sample.env_reward``; one that trains
        each turn as its own sample (``multi_turn``'s ``per_turn_samples``) returns a sample per
        turn of each of the ``num_samples`` trajectories, so a group may hold more than G.
    """


@hookspec(firstresult=True)
def env_reset(prompt: Prompt) -> Episode:
    """Start one episode of the environment for a dataset row (kind ``env``, at most one
    selected with ``--env NAME``; first result wins).

    Called once per trajectory (G times per prompt group), so an episode may keep the state of
    its own conversation. The episode's ``messages`` open the conversation; its
    ``step(text, tokens)`` answers each policy turn with an :class:`grpo_core.types.EnvStep`
    (observation messages, a reward, done). The rollout sums the rewards into
    ``Sample.env_reward``, which the ``env`` reward plugin hands to the run.

    :param prompt: the dataset row (its ``text`` or ``messages``, its ``answer``, ``metadata``).
    :returns: an object with ``messages: list[dict]`` and ``step(text, tokens) -> EnvStep``.
    """


@hookspec
def tool_spec() -> dict[str, Any]:
    """The tool as the policy sees it (kind ``tool``, any number selected with ``--tool NAME``).

    :returns: a JSON-schema function description, ``{"name", "description", "parameters"}``
        (the ``function`` part of an OpenAI tool), handed to the chat template as ``tools``.
        Its ``name`` is what the policy writes in a tool call.
    """


@hookspec
def tool_call(arguments: dict[str, Any]) -> str:
    """Run the tool on the arguments of one call the policy made (called on that tool only).

    The rollout enforces its own time limit around the call and turns an exception into an
    error observation (``tool/errors``), so a tool raises on bad arguments with a message the
    policy can read.

    :param arguments: the call's ``arguments`` object, as parsed from the policy's JSON.
    :returns: the text returned to the policy as a ``tool`` message.
    """


@hookspec
def reward(prompt: Prompt, samples: Sequence[Sample]) -> list[float | None]:
    """Score the samples of one prompt group (every selected reward is called; kind ``reward``).

    The run combines the scores of all rewards as a weighted sum (``--reward NAME[:weight]``).
    A ``None`` or NaN score marks a failed scoring: that sample is not trained on.

    :param prompt: the prompt (with its reference ``answer``) the group was sampled for.
    :param samples: the group's samples; read ``sample.text`` for the completion.
    :returns: one score per sample, in order.
    """


@hookspec
def prepare_advantages(groups: Sequence[Sequence[Sample]], scorer: PolicyScorer | None) -> None:
    """Called once before the ``advantage`` calls of a batch of groups (kind ``advantage``; an
    advantage that needs nothing but rewards omits it).

    For an advantage that needs the current policy's view of the samples: IGPO scores the answer
    after every turn of every group here, in one forward, and keeps the scores for the
    ``advantage`` call of each group (one call per group of ``groups``, on the same samples).

    :param groups: the groups whose advantages come next (each with at least two scored samples).
    :param scorer: a read-only handle on the policy being trained: ``scorer.tokenizer`` and
        ``scorer.forward(datums)`` (teacher-forced logprobs; one call sees one policy version,
        also while the async loop trains). None where no trainer is at hand.
    """


@hookspec(firstresult=True)
def advantage(rewards_G: Sequence[float], samples: Sequence[Sample]) -> list[float | list[float]]:
    """Turn a group's total rewards into advantages (first result wins; kind ``advantage``).

    :param rewards_G: the total reward of each sample of the group.
    :param samples: the group's samples (for per-token or turn-level advantages).
    :returns: per sample either one float (broadcast over its trained tokens) or a list of
        floats aligned with ``sample.tokens``.
    """


@hookspec
def keep_group(prompt: Prompt, samples: Sequence[Sample]) -> bool:
    """Whether a scored group is trained on (kind ``group_filter``, any number selected with
    ``--group-filter NAME``; each is asked in order and the first that says no drops the group).

    Called after the group's advantages, in both loops; a dropped group's prompt is not sampled
    again, and with ``--dynamic-sampling`` the step samples more prompts in its place. The
    built-in ``zero_variance`` filter (``--drop-zero-variance-groups``, on by default) drops a
    group whose advantages are all 0.

    :param prompt: the prompt the group was sampled for.
    :param samples: the group's scored samples, with ``reward``, ``rewards`` and ``advantages``.
    :returns: True to train on the group, False to drop it (counted in ``groups/dropped_<name>``).
    """


@hookspec
def keep_prompt(prompt: Prompt) -> bool:
    """Whether a prompt is rolled out when the run's order comes to it (kind ``group_filter``):
    False passes over it, and the run takes the next prompt in its place (counted in
    ``sampling/passed_over``). Called in the order's sequence, between steps of the synchronous loop
    (after the ``on_step`` of the step before), so that a filter that learns from the steps'
    groups (the ``curriculum``) decides the same way when a resumed run repeats it. A filter whose
    decisions depend on what it saw gives it to checkpoints with ``state_dict()`` and takes it back
    on resume with ``load_state_dict(state)`` (declared attributes of the kind).

    :param prompt: the prompt the order comes to.
    :returns: True to roll it out, False to pass over it.
    """


@hookspec(firstresult=True)
def loss(inputs: LossInputs) -> LossOutput:
    """Compute the training loss of one forward/backward batch (kind ``loss``).

    Exactly one loss implements this; wrappers (``@hookimpl(wrapper=True)``) such as TIS may
    adjust ``inputs`` before it and the output after it.

    :param inputs: per-sequence logprob tensors, masks, advantages and the step's normalizers;
        see :class:`grpo_core.loss.LossInputs`.
    :returns: the scalar loss (differentiable in ``inputs.logprobs``) and namespaced metrics.
    """


@hookspec
def on_run_start(config: RunConfig, run_dir: Path, total_steps: int | None, start_step: int) -> None:
    """Called once before the first step on every active plugin (loggers open their outputs).

    Plugins other than loggers start first, before the run folder changes (a refusal there leaves
    it untouched); loggers once config.json is written. A start refused later is undone.

    :param config: the resolved run configuration.
    :param run_dir: where the run writes its config, metrics and final policy.
    :param total_steps: the number of steps the run will take, when known.
    :param start_step: 0 for a new run; for a resumed one, the checkpoint's step: the run goes on
        at ``start_step + 1``, and a logger that appends drops what it wrote for later steps.
    """


@hookspec
def on_step(step: int, metrics: dict[str, float], state: RunState, groups: Sequence[Sequence[Sample]]) -> None:
    """Called after each optimizer step on every active plugin (loggers, checkpoints, early stop).

    :param step: the number of optimizer steps taken so far (1 after the first). With
        ``--eval-every``, a new run first calls it with step 0 and only the ``eval/`` metrics of
        the initial policy (no groups).
    :param metrics: this step's namespaced metrics (``reward/total``, ``loss/policy``, ...).
    :param state: the run's state; ``state.request_stop(reason)`` ends the run after this step.
    :param groups: the step's scored prompt groups (samples with text, rewards and advantages),
        for loggers that show samples; an implementation that does not need them omits it.
    """


@hookspec
def on_run_end(summary: dict[str, Any], run_dir: Path) -> None:
    """Called once after the last step on every active plugin.

    :param summary: start and end reward, steps, wall time, where the final policy is.
    :param run_dir: the run directory.
    """
