"""The stages of one GRPO step between rollout and weight sync: score, advantages, train."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import pluggy

from grpo_core.backend import PolicyScorer, Reference, Trainer, routes_data, sample_to_datum
from grpo_core.config import DEFAULT, DEFAULT_PRESET, RunConfig
from grpo_core.errors import PluginError
from grpo_core.kinds import declared
from grpo_core.loss import LossInputs, LossOutput
from grpo_core.metrics import Metrics, record, scope
from grpo_core.plugins_manager import is_wrapper, make_plugin, plugin_label
from grpo_core.routes import EXPERT_COUNT_FIELDS, agreement
from grpo_core.types import RewardFailures, Sample

if TYPE_CHECKING:
    from grpo_core.selection import Selection


class RewardError(PluginError):
    """Rewards failed on too many samples in a row, or a reward broke its contract."""


class CallTimeout(Exception):
    """A call did not return in time (it goes on in a daemon thread, which is abandoned)."""


T = TypeVar("T")


def call_with_timeout(fn: Callable[[], T], timeout: float) -> T:
    """``fn()``, or CallTimeout after ``timeout`` seconds (0 = wait for ever).

    A daemon thread, not a pool: a call that never returns must not hold the process at exit.
    """
    if not timeout:
        return fn()
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed back to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name="grpo-core-reward")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise CallTimeout(f"did not return within {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def score_groups(
    selection: Selection,
    groups: Sequence[Sequence[Sample]],
    max_failures_in_a_row: float,
    timeout: float = 0.0,
    failures: RewardFailures | None = None,
) -> Metrics:
    """Weighted sum of every reward; a None/NaN, a raising or a timed-out reward marks the sample failed.

    A failed sample is not trained on; the run stops once ``max_failures_in_a_row`` samples
    in a row have failed (counted in ``failures``, which goes on across calls: the run's), with
    the last error. ``timeout`` bounds each reward call (0 = none).
    """
    failures = failures if failures is not None else RewardFailures()
    failed = errors = timeouts = 0
    per_reward: dict[str, list[float]] = {r.name: [] for r in selection.rewards}
    for group in groups:
        if not group:
            continue
        for r in selection.rewards:
            scored = True
            try:
                scores = list(call_with_timeout(lambda r=r, group=group: r.plugin.reward(prompt=group[0].prompt, samples=group), timeout))
            except CallTimeout as exc:
                scores, scored = [None] * len(group), False
                timeouts += 1
                failures.last_error = f"reward '{r.name}' {exc}"
            except Exception as exc:  # a reward's bug must not lose the run: the group is marked failed
                scores, scored = [None] * len(group), False
                errors += 1
                failures.last_error = f"reward '{r.name}' raised {type(exc).__name__}: {exc}"
            if len(scores) != len(group):
                raise RewardError(f"reward '{r.name}' returned {len(scores)} scores for {len(group)} samples")
            wrong = next((s for s in scores if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)))), None)
            if wrong is not None:
                raise RewardError(
                    f"{plugin_label(r.plugin)} returned {wrong!r} ({type(wrong).__name__}) as a score: "
                    "a reward returns a number per sample (None when it cannot score one)"
                )
            for sample, score in zip(group, scores):
                ok = score is not None and not math.isnan(score)
                if score is None and sample.finish_reason == "length" and scored:
                    failures.last_error = f"reward '{r.name}' gave no score to a completion cut at its token budget"
                    failures.last_was_cut = True
                elif not ok:
                    failures.last_was_cut = False
                sample.rewards[r.name] = float(score) if ok else None
                if ok:
                    per_reward[r.name].append(float(score))
        for sample in group:
            if any(sample.rewards[r.name] is None for r in selection.rewards):
                sample.reward = None
                failed += 1
                failures.in_a_row += 1
                if failures.in_a_row >= max_failures_in_a_row:
                    raise RewardError(
                        f"rewards failed on {failures.in_a_row} samples in a row; "
                        f"last: {failures.last_error or 'a reward returned None/NaN'}"
                    )
            else:
                sample.reward = sum(r.weight * sample.rewards[r.name] for r in selection.rewards)
                failures.in_a_row = 0
    totals = [s.reward for g in groups for s in g if s.reward is not None]
    samples = [s for g in groups for s in g]
    with scope() as metrics:
        record("reward/total", _mean(totals), "mean", weight=len(totals))
        record("reward/std", 0.0, "std", weight=0.0)
        for total in totals:
            record("reward/std", total, "std")
        record("reward/failed", failed, "sum")
        record("reward/errors", errors, "sum")
        record("reward/timeouts", timeouts, "sum")
        for name, values in per_reward.items():
            record(f"reward/{name}", _mean(values), "mean", weight=len(values))
        for group in groups:
            if group and group[0].prompt.source is not None:  # a mixture's: each source's prompts and reward
                scored = [s.reward for s in group if s.reward is not None]
                record(f"data/{group[0].prompt.source}/prompts", 1, "sum")
                record(f"data/{group[0].prompt.source}/reward", _mean(scored), "mean", weight=len(scored))
        record("tokens/completion", sum(s.num_completion_tokens for s in samples), "sum")
        record("tokens/completion_mean", _mean([s.num_completion_tokens for s in samples]), "mean", weight=len(samples))
        record("completion/truncated_frac", _mean([s.finish_reason == "length" for s in samples]), "mean", weight=len(samples))
    return metrics


def compute_advantages(
    pm: pluggy.PluginManager,
    groups: Sequence[Sequence[Sample]],
    drop_zero_variance: bool,
    trainer: Trainer | None = None,
    max_samples_per_call: int | None = None,
    trainer_lock: contextlib.AbstractContextManager[Any] | None = None,
    group_filters: Mapping[str, Any] | None = None,
) -> tuple[list[list[Sample]], Metrics]:
    """Advantages per group, then the group filters: the groups kept for training.

    A group with fewer than 2 scored samples is dropped first. An advantage plugin that needs the
    current policy (igpo) gets every group first through the ``prepare_advantages`` hook, with a
    read-only :class:`grpo_core.backend.PolicyScorer` on ``trainer`` (forwards of at most
    ``max_samples_per_call`` sequences, under ``trainer_lock`` when the trainer trains meanwhile).
    Then each group with its advantages goes through ``group_filters`` (name -> a ``group_filter``
    plugin, asked in order; ``groups/dropped_<name>`` counts the groups each one dropped), after
    the built-in ``zero_variance`` filter when ``drop_zero_variance``: it drops a group whose
    advantages are all 0 (for an outcome-only advantage: equal rewards; igpo may see signal where
    the outcome rewards are equal). A dropped group's samples keep no advantages.
    """
    # Found by name like any group filter: the core imports no plugin.
    filters = {"zero_variance": make_plugin("zero_variance", "group_filter")} if drop_zero_variance else {}
    # A filter may implement keep_prompt only (it passes over prompts before their rollout).
    asked = {id(impl.plugin) for impl in pm.hook.keep_group.get_hookimpls()}
    filters.update({name: f for name, f in (group_filters or {}).items() if id(f) in asked})
    with scope() as metrics:
        kept = _advantages(pm, groups, filters, trainer, max_samples_per_call, trainer_lock)
    return kept, metrics


def _advantages(
    pm: pluggy.PluginManager,
    groups: Sequence[Sequence[Sample]],
    filters: Mapping[str, Any],
    trainer: Trainer | None,
    max_samples_per_call: int | None,
    trainer_lock: contextlib.AbstractContextManager[Any] | None,
) -> list[list[Sample]]:
    dropped_failed = skipped = 0
    dropped_by = dict.fromkeys(filters, 0)
    candidates: list[list[Sample]] = []
    for group in groups:
        if not group:
            skipped += 1
            continue
        scored = [s for s in group if s.reward is not None]
        if len(scored) < 2:
            dropped_failed += 1
            continue
        candidates.append(scored)
    scorer = PolicyScorer(trainer, max_samples_per_call, trainer_lock) if trainer is not None else None
    pm.hook.prepare_advantages(groups=candidates, scorer=scorer)
    kept: list[list[Sample]] = []
    for scored in candidates:
        advantages = pm.hook.advantage(rewards_G=[s.reward for s in scored], samples=scored)
        for sample, adv in zip(scored, advantages):
            if isinstance(adv, (int, float)):
                sample.advantages = [float(adv)] * len(sample.tokens)
            elif len(adv) == len(sample.tokens):
                sample.advantages = [float(a) for a in adv]
            else:
                raise ValueError(f"advantage returned {len(adv)} values for a sample of {len(sample.tokens)} tokens")
        dropper = next((name for name, f in filters.items() if not keeps(name, f, scored)), None)
        if dropper is None:
            kept.append(scored)
            continue
        dropped_by[dropper] += 1
        for sample in scored:
            sample.advantages = None
    record("groups/kept", len(kept), "sum")
    for name, count in dropped_by.items():
        record(f"groups/dropped_{name}", count, "sum")
    record("groups/dropped_failed", dropped_failed, "sum")
    record("groups/skipped", skipped, "sum")
    return kept


def keeps(name: str, group_filter: Any, group: Sequence[Sample]) -> bool:
    """A group filter's ``keep_group`` answer, checked to be a bool."""
    answer = group_filter.keep_group(prompt=group[0].prompt, samples=group)
    if not isinstance(answer, bool):
        raise PluginError(f"group filter '{name}': keep_group must return True or False, got {answer!r}")
    return answer


def check_sampling_settings(config: RunConfig) -> None:
    """--max-sampling-rounds bounds --dynamic-sampling, which only the sync loop has (both loops)."""
    if config.dynamic_sampling and config.loop == "async":
        raise PluginError(
            "--dynamic-sampling is the async loop's own rule (a step trains once it has prompt_groups_per_step groups "
            "that pass the filters); --synchronous-training trains what one batch kept, as --loop sync without it"
        )
    if config.max_sampling_rounds != RunConfig().max_sampling_rounds:
        if config.loop == "sync" and not config.dynamic_sampling:
            raise PluginError("--max-sampling-rounds would do nothing: it bounds --dynamic-sampling (sync loop) and the async loop")
        if config.loop == "async" and config.synchronous_training:
            raise PluginError("--max-sampling-rounds would do nothing: --synchronous-training trains what one batch kept")


def check_router_replay_model(config: RunConfig) -> None:
    """--router-replay on a model whose config.json names no experts, refused before any model
    loads (both loops); a model whose config is not on this machine is checked once loaded."""
    if config.router_replay == "off":
        return
    path = model_config_file(config.model)
    try:
        model_config = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return  # loading the model says what is wrong with it
    if not isinstance(model_config, dict):
        return
    text_config = model_config.get("text_config") or model_config
    if any(text_config.get(name) for name in EXPERT_COUNT_FIELDS):
        return
    raise PluginError(
        f"--router-replay {config.router_replay}: model type '{text_config.get('model_type')}' has no mixture-of-experts layers "
        f"({path} names no experts), so there is no routing to replay: use --router-replay off"
    )


def model_config_file(model: str) -> Path | None:
    """The config.json of ``--model`` on this machine (the embedded model's, a folder's, a hub
    name's in the local cache), or None; asks no server."""
    if model == DEFAULT:
        return DEFAULT_PRESET.parent / "config.json"
    if Path(model).is_dir():
        return Path(model) / "config.json"
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(model, "config.json")
    except ValueError:  # not a hub name either
        return None
    return Path(cached) if isinstance(cached, str) else None


def updates_per_step(config: RunConfig) -> int:
    """Optimizer steps (policy versions) one step takes: ``ppo_epochs`` passes over its groups,
    each split into ``minibatches_per_step`` shares."""
    return config.ppo_epochs * config.minibatches_per_step


def train_step(
    pm: pluggy.PluginManager,
    trainer: Trainer,
    reference: Reference | None,
    groups: Sequence[Sequence[Sample]],
    config: RunConfig,
    learning_rate: float,
) -> Metrics:
    """A step's training, the same in both loops: ``ppo_epochs`` passes over the step's groups,
    each split into ``minibatches_per_step`` shares (the same shares, in the same order, at every
    pass), one optimizer step per share, all against π_old of the step's start (so the later ones
    have a ratio to clip). ``optim/updates`` counts the optimizer steps taken.

    With ``mask_truncated`` a completion cut at ``max_completion_tokens`` gets no gradient and
    counts in no normalizer (``completion/masked_truncated``); its reward still counted in its
    group's advantages.
    """
    if config.mask_truncated:
        groups = [[untrained_if_truncated(s) for s in g] for g in groups]
    K = config.minibatches_per_step
    shares = [s for s in (groups[len(groups) * k // K : len(groups) * (k + 1) // K] for k in range(K)) if s]
    samples = [s for g in groups for s in g]
    with scope() as metrics:
        if config.mask_truncated:
            record("completion/masked_truncated", sum(s.finish_reason == "length" for g in groups for s in g), "sum")
        recorded = old = None
        # With no token to train, the step takes no optimizer step: no pi_old forward either.
        untrained = not any(m for s in samples for m in s.loss_mask[1:])
        if config.router_replay == "R2" and samples and not untrained:
            # pi_old's forward records the routing every update of the step replays.
            old, recorded = trainer.forward_routed([sample_to_datum(s) for s in samples])
        if len(shares) * config.ppo_epochs <= 1 or untrained:
            metrics.merge(train_on_groups(pm, trainer, reference, groups, config, learning_rate, recorded))
            return metrics
        if config.anchor != "old_policy":
            old = None
        elif old is None:
            old = trainer.forward(step_datums(samples, config.router_replay))
        starts = [sum(len(g) for share in shares[:k] for g in share) for k in range(len(shares))]
        record("optim/minibatches", len(shares), "sum")
        record("optim/epochs", config.ppo_epochs, "sum")
        for epoch in range(config.ppo_epochs):
            for share, start in zip(shares, starts):
                n = sum(len(g) for g in share)
                view = trainer if old is None else StepStartPolicy(trainer, old[start : start + n])
                routes = recorded[start : start + n] if recorded is not None else None
                trained = train_on_groups(pm, view, reference, share, config, learning_rate, routes)
                if epoch:
                    for once in ("train/samples", "train/tokens"):  # the step's samples and tokens, each counted once
                        trained.entries.pop(once, None)
                metrics.merge(trained)
    return metrics


def record_perf(metrics: Metrics, trainer: Trainer) -> None:
    """The step's perf/* metrics (docs/performance.md, Metrics of a run), after its time/* ones:
    the rates of sampling and training from its tokens and seconds (any sampler and trainer), and
    perf/mfu, perf/peak_memory_gib from the trainer's ``perf_counters`` where it has them."""
    values: dict[str, float] = {}
    if metrics.get("time/sample", 0.0) > 0:
        values["perf/sample_tokens_per_s"] = metrics.get("tokens/completion", 0.0) / metrics["time/sample"]
    seconds, tokens = metrics.get("time/train", 0.0), metrics.get("train/forward_tokens", 0.0)
    counters = declared(trainer, "trainer object", "perf_counters")
    measured = counters() if counters is not None else {}
    # The tokens the trainer ran where it counts them (a group's shared prompt once), not those it was sent.
    tokens = measured.get("forward_tokens", tokens)
    if seconds > 0 and tokens:
        values["perf/train_tokens_per_s"] = tokens / seconds
    if counters is not None:
        if seconds > 0 and tokens and measured.get("parameters") and measured.get("peak_flops"):
            values["perf/mfu"] = 6.0 * measured["parameters"] * tokens / seconds / measured["peak_flops"]
        if "peak_memory_gib" in measured:
            values["perf/peak_memory_gib"] = measured["peak_memory_gib"]
    metrics.update(values, "max")


def warn_untrained(step: int, metrics: Mapping[str, float], config: RunConfig) -> None:
    """The console line of a step whose samples had no token to train: it took no optimizer step."""
    if metrics.get("optim/updates") or not metrics.get("optim/skipped_no_trained_tokens"):
        return
    samples, masked = metrics.get("train/samples", 0.0), metrics.get("completion/masked_truncated", 0.0)
    limit = config.max_completion_tokens
    why = f"{masked:g} of its {samples:g} samples were cut at --max-completion-tokens {limit} and --mask-truncated masks them"
    if not masked:
        why = f"the loss masks of its {samples:g} samples are all 0"
    print(f"warning: step {step} trained no token ({why}): it took no optimizer step", file=sys.stderr)


def untrained_if_truncated(sample: Sample) -> Sample:
    """The sample, with no trained token when it was cut at the length limit (a copy)."""
    if sample.finish_reason != "length":
        return sample
    return attrs.evolve(sample, loss_mask=[0.0] * len(sample.loss_mask))


class StepStartPolicy:
    """The trainer as a step's later minibatches see it: π_old is the policy at the step's start.

    Its version matches no sample, so ``anchor_logprobs`` asks ``forward`` for π_old, which
    returns the logprobs computed before the step's first optimizer step.
    """

    version = -1

    def __init__(self, trainer: Trainer, old_logprobs: list[Any]) -> None:
        self.trainer = trainer
        self.old_logprobs = old_logprobs

    def forward(self, datums: list[Any]) -> list[Any]:
        return self.old_logprobs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trainer, name)


def train_on_groups(
    pm: pluggy.PluginManager,
    trainer: Trainer,
    reference: Reference | None,
    groups: Sequence[Sequence[Sample]],
    config: RunConfig,
    learning_rate: float,
    recorded_routes: Sequence[Any] | None = None,
) -> Metrics:
    """Forward/backward over the kept samples (in chunks if asked), then one optimizer step; none
    when no token of theirs is trained (all masked: ``optim/skipped_no_trained_tokens``).

    A loss's metrics are token-weighted means over its calls, but for those its output declares
    summed (``LossOutput.summed``); ``loss/total`` is the sum of the calls' losses.
    ``recorded_routes``: each sample's routing as pi_old's forward recorded it (--router-replay R2).
    """
    import tinker
    import torch

    with scope() as metrics:
        samples = [s for g in groups for s in g]
        if not samples:
            record("train/skipped", 1, "sum")
            record("optim/updates", 0, "sum")
            return metrics
        mask = [torch.tensor(s.loss_mask[1:]) for s in samples]
        num_tokens = float(sum(m.sum() for m in mask))
        record("train/samples", len(samples), "sum")
        record("train/tokens", num_tokens, "sum")
        if not num_tokens:
            # A zero gradient still moves AdamW's weights (decay, momentum): no step at all.
            record("optim/skipped_no_trained_tokens", 1, "sum")
            record("optim/updates", 0, "sum")
            return metrics
        datums = step_datums(samples, config.router_replay, recorded_routes)
        # What the forward/backward calls run over (prompt and completion, every epoch): perf/* rates' tokens.
        record("train/forward_tokens", sum(d.model_input.length for d in datums), "sum")
        sampling = [torch.tensor(s.sampling_logprobs[1:]) for s in samples]
        advantages = [torch.tensor(s.advantages[1:]) for s in samples]
        ref = reference.forward(datums) if reference is not None else None
        old = anchor_logprobs(trainer, datums, samples, sampling, config.anchor)
        num_sequences = sum(int(m.sum() > 0) for m in mask)
        for idx in fwd_bwd_chunks(len(samples), config.min_samples_per_fwd_bwd, config.max_samples_per_fwd_bwd):
            loss_fn = StepLoss(
                pm=pm,
                old=[old[i] for i in idx] if old is not None else None,
                sampling=[sampling[i] for i in idx],
                mask=[mask[i] for i in idx],
                advantages=[advantages[i] for i in idx],
                ref=[ref[i] for i in idx] if ref is not None else None,
                num_sequences=num_sequences,
                num_tokens=num_tokens,
                max_tokens=config.max_completion_tokens,
            )
            result = trainer.forward_backward_custom([datums[i] for i in idx], loss_fn)
            record_router_agreement([samples[i] for i in idx], result)
            # Chunk losses carry the whole step's normalizer: they add up to the step's loss.
            record("loss/total", result.metrics.pop("loss"), "sum")
            # Every other metric is a mean over the call's trained tokens: weighted by them, the
            # step's value is that of one call with all sequences.
            call_tokens = float(sum(mask[i].sum() for i in idx))
            for key, value in result.metrics.items():
                record(key, value, "sum" if key in loss_fn.summed else "mean", weight=call_tokens)
        optim = trainer.optim_step(
            tinker.AdamParams(
                learning_rate=learning_rate,
                beta1=config.beta1,
                beta2=config.beta2,
                eps=config.adam_eps,
                weight_decay=config.weight_decay,
                grad_clip_norm=config.grad_clip_norm,
            )
        )
        skipped = optim.pop("optim/skipped_nonfinite", 0.0)
        record("optim/skipped_nonfinite", skipped, "sum")
        record("optim/updates", 0 if skipped else 1, "sum")
        metrics.update(optim, "mean")
    return metrics


@attrs.define
class StepLoss:
    """The ``loss_fn(datums, logprobs)`` of one forward/backward call (the Tinker contract's).

    It also says what the loss is computed from, so that a remote trainer can run an equivalent
    loss on its service instead: ``inputs(logprobs)`` builds the loss hook's inputs, and
    ``on_policy`` is True when the ratio anchors on the current policy's own (detached) logprobs.
    """

    pm: pluggy.PluginManager
    old: list[Any] | None
    """π_old of each sequence, or None: on-policy, the detached current logprobs."""
    sampling: list[Any]
    mask: list[Any]
    advantages: list[Any]
    ref: list[Any] | None
    num_sequences: int
    num_tokens: float
    max_tokens: int
    summed: frozenset[str] = frozenset()
    """The metrics the loss declared summed over calls (``LossOutput.summed``), once it ran."""

    @property
    def on_policy(self) -> bool:
        return self.old is None

    def inputs(self, logprobs: Sequence[Any]) -> LossInputs:
        return LossInputs(
            logprobs=list(logprobs),
            old_logprobs=self.old if self.old is not None else [lp.detach() for lp in logprobs],
            sampling_logprobs=self.sampling,
            mask=self.mask,
            advantages=self.advantages,
            ref_logprobs=self.ref,
            num_sequences=self.num_sequences,
            num_tokens=self.num_tokens,
            max_tokens=self.max_tokens,
        )

    def __call__(self, _datums: Any, logprobs: Sequence[Any]) -> tuple[Any, dict[str, float]]:
        record_mismatch(logprobs, self.sampling, self.mask)
        out = self.pm.hook.loss(inputs=self.inputs(logprobs))
        if not isinstance(out, LossOutput) or not hasattr(out.loss, "backward"):  # a tensor's
            loss = next((p for _, p in self.pm.list_name_plugin() if hasattr(p, "loss") and not is_wrapper(p, "loss")), None)
            raise PluginError(
                f"{plugin_label(loss)} returned {type(out).__name__} {out!r:.80}"
                + ("" if not isinstance(out, LossOutput) else f" with loss {type(out.loss).__name__}")
                + ": a loss returns LossOutput(loss=<0-d tensor>, metrics={...})"
            )
        self.summed = out.summed
        return out.loss, out.metrics


def record_mismatch(logprobs: Sequence[Any], sampling: Sequence[Any], mask: Sequence[Any]) -> None:
    """How far the sampler's logprobs of the trained tokens are from the trainer's: the largest
    and the mean |Δ|, and the k3 estimate of KL(sampler ‖ trainer), e^r − 1 − r with r = trainer − sampler.

    0 when both compute one policy exactly (fp32, the local sampler); a bf16 forward, another
    engine or kernel makes them differ. See docs/losses.md (TIS) for how to read them.
    """
    import torch

    with torch.no_grad():
        trained = [m > 0 for m in mask]
        diff = torch.cat([(lp.detach().float() - s.float())[t] for lp, s, t in zip(logprobs, sampling, trained)])
    if diff.numel() == 0:
        return
    tokens = float(diff.numel())
    record("mismatch/logprob_abs_max", float(diff.abs().max()), "max")
    record("mismatch/logprob_abs_mean", float(diff.abs().mean()), "mean", weight=tokens)
    record("mismatch/kl_k3", float((torch.exp(diff) - 1 - diff).mean()), "mean", weight=tokens)


def step_datums(samples: Sequence[Sample], router_replay: str, recorded: Sequence[Any] | None = None) -> list[Any]:
    """The samples' datums, carrying the routes the trainer's forward must use (``routed_experts``):
    the sampler's with --router-replay R3, pi_old's ``recorded`` ones with R2."""
    datums = [sample_to_datum(s) for s in samples]
    if router_replay == "off" or (router_replay == "R2" and recorded is None):
        return datums
    if router_replay == "R3":
        missing = next((i for i, s in enumerate(samples) if s.routed_experts is None), None)
        if missing is not None:
            raise PluginError(f"--router-replay R3: sample {missing} of prompt {samples[missing].prompt.id} carries no routed_experts")
        recorded = [s.routed_experts for s in samples]
    return [
        type(d)(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, "routed_experts": routes_data(r)})
        for d, r in zip(datums, recorded or [])
    ]


def record_router_agreement(samples: Sequence[Sample], result: Any) -> None:
    """``moe/router_agreement``: the fraction of (token, MoE layer) pairs of the samples' inputs
    where the trainer's forward used the set of experts the sampler used (1 under --router-replay
    R3); ``moe/router_agreement_chosen``: where the trainer's routers chose them themselves (what
    replay corrects). Only where the sampler recorded routing and the trainer returned its own."""
    import torch

    if all(s.routed_experts is None for s in samples):
        return
    outputs = result.loss_fn_outputs
    pairs = [(s.routed_experts, o) for s, o in zip(samples, outputs) if s.routed_experts is not None and "routed_experts" in o]
    if not pairs:
        return
    for metric, key in (("moe/router_agreement", "routed_experts"), ("moe/router_agreement_chosen", "routed_experts_chosen")):
        agree_N_L = torch.cat([agreement(o[key].to_torch(), sampled) for sampled, o in pairs])
        record(metric, float(agree_N_L.float().mean()), "mean", weight=float(agree_N_L.numel()))


def fwd_bwd_chunks(n: int, min_size: int, max_size: int | None) -> list[range]:
    """Greedy split of n samples into calls of at most max_size; a short tail joins the call before."""
    size = max_size or n
    chunks = [range(start, min(start + size, n)) for start in range(0, n, size)]
    if len(chunks) > 1 and len(chunks[-1]) < min_size:
        tail = chunks.pop()
        chunks[-1] = range(chunks[-1].start, tail.stop)
    return chunks


def anchor_logprobs(trainer: Trainer, datums: list, samples: list[Sample], sampling: list, anchor: str) -> list | None:
    """π_old for the ratio. None = on-policy: the loss reuses the detached current logprobs."""
    if anchor == "sampling":
        return sampling
    if all(s.policy_version == trainer.version for s in samples):
        return None
    return trainer.forward(datums)


def learning_rate(config: RunConfig, step_index: int, total_steps: int) -> float:
    """Linear warmup to the peak, then constant, linear or cosine decay to zero."""
    peak = config.learning_rate
    if step_index < config.warmup_steps:
        return peak * (step_index + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return peak
    decay_steps = max(total_steps - config.warmup_steps, 1)
    progress = min((step_index - config.warmup_steps) / decay_steps, 1.0)
    if config.lr_schedule == "linear":
        return peak * (1.0 - progress)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")
