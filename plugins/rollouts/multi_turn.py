"""The ``multi_turn`` rollout: conversations between the policy, an environment and tools."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs

from grpo_core import Completion, Prompt, Sample, SamplingParams, hookimpl, option
from grpo_core.backend import Sampler
from grpo_core.errors import PluginError
from grpo_core.hookspecs import declared
from grpo_core.images import has_images
from grpo_core.metrics import record
from grpo_core.plugins.rollouts.tool_formats import FORMATS, ToolCall, ToolFormat, detect
from grpo_core.stages import CallTimeout, call_with_timeout
from grpo_core.types import Episode, Turn

PLAIN_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{{ message['content'] + (eos_token or '') }}"
    "{%- else -%}{{ ('' if loop.first else '\\n') + message['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
"""For a tokenizer without a chat template (the embedded model's): the messages' contents one
after the other, each answer closed by the eos token, each other message on a new line, and no
assistant header, so a prompt ending in the task's cue ("Answer:") is continued as the embedded
model was trained."""


PLACEHOLDER = "grpo_core_turn_{}_placeholder"
"""Stands for a policy turn's text when the template renders the conversation's skeleton: no
template strips, trims, splits or escapes it (letters, digits and underscores only)."""


class PrefixMismatch(PluginError):
    """The chat template renders a conversation that does not extend its tokens."""


def _positive(instance: Any, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


def _non_negative(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


@attrs.define(eq=False)
class Conversation:
    """One trajectory being rolled out: its messages as text and its tokens as sampled."""

    prompt: Prompt
    episode: Episode | None
    messages: list[dict[str, Any]]
    tokens: list[int]
    logprobs: list[float]
    mask: list[float]
    rendered: str
    """The template's text of the conversation so far, the policy's turns as their decoded text."""
    segments: list[tuple[int, int, str]] = attrs.field(factory=list)
    """(first character in ``rendered``, first token, what it is) of each piece: for error messages."""
    generation_prompt: str = ""
    """What the template writes to open an assistant turn (its header, perhaps an opened or empty
    ``<think>`` block): a template may drop or rewrite it once the turn is history."""
    template_pieces: list[str] = attrs.field(factory=list)
    """What the template wrote between the policy's turns: the opening, then after each turn."""
    policy_messages: list[int] = attrs.field(factory=list)
    """Where the policy's turns are in ``messages``."""
    turns: list[Turn] = attrs.field(factory=list)
    """Every policy turn so far; with per_turn_samples, each at its place in its own sample."""
    earlier_samples: list[tuple[list[int], list[float], list[float], list[Turn], Any]] = attrs.field(factory=list)
    """With per_turn_samples: (tokens, logprobs, loss mask, turn, routes) of each turn before the current context."""
    routes: Any = None
    """A mixture-of-experts sampler's routing of ``tokens[: len(routes)]``: each token's as the
    sampler call that first forwarded it recorded it (see ``Sample.routed_experts``); None where
    the sampler records none."""
    env_reward: float | None = None
    env_done: bool = False
    """Whether the episode answered done=True (the environment ended the conversation)."""
    text: str = ""
    """The policy's last turn."""
    finish_reason: str | None = None
    """Set when the conversation has ended."""
    policy_version: int | None = None

    @property
    def live(self) -> bool:
        return self.finish_reason is None


@attrs.define
class MultiTurnRollout:
    """A conversation between the policy and the selected environment (--env) and tools (--tool),
    rendered with the tokenizer's chat template, flattened into one sample per trajectory.

    Token-in/token-out: the policy's tokens are kept as sampled and never re-tokenized; what
    the template adds after a turn (end of turn, the observation, the next assistant header) is
    the only text tokenized, and only once the template's rendering of the whole conversation is
    checked to extend the tokens so far (or, for a template that rewrites past turns, such as a
    thinking model's, its rendering with every turn a placeholder is checked instead). The loss
    mask is 1 on the policy's own tokens only; Sample.turns records each turn's span and
    Sample.env_reward the sum of the environment's rewards. A turn holding tool calls, in the
    format of the model family (tool_format), is answered by those tools; any other turn goes to
    the environment (without one, it ends the conversation). One sampler call per round generates
    the next turn of every live conversation. With per_turn_samples, each turn is a sample of its own.
    """

    max_turns: int = option(4, help="most policy turns per conversation (tool turns included)", validator=_positive)
    max_total_tokens: int | None = option(
        None, help="most tokens per conversation, prompt, turns and observations together (default: the model's context)",
        validator=_positive,
    )  # fmt: skip
    template: Literal["auto", "tokenizer", "plain"] = option(
        "auto",
        help=(
            "chat template: the tokenizer's (an error if it has none), plain (contents in a row, answers closed by eos), "
            "or auto: the tokenizer's when it has one, else plain"
        ),
    )
    tool_timeout: float = option(10.0, help="seconds a tool call may take before it fails (0 = no limit)", validator=_non_negative)
    on_prefix_mismatch: Literal["error", "end", "append"] = option(
        "append",
        help=(
            "a chat template that does not extend the conversation's tokens: append, if the template rewrote only the "
            "policy's turns and their generation prompts (dropped reasoning, trimmed text), just what it writes after the "
            "new turn (multi_turn/history_rewrites), else stop with an error; stop with an error naming the position; "
            "or end that conversation there (multi_turn/prefix_failures)"
        ),
    )
    tool_format: Literal["auto", "hermes", "llama3", "mistral", "deepseek", "harmony"] = option(
        "auto",
        help=(
            "how the policy writes tool calls: hermes (<tool_call>{json}</tool_call>, Qwen), llama3 (JSON, or after "
            "<|python_tag|>), mistral ([TOOL_CALLS]), deepseek (its tool-call markers, V3 and R1), harmony (gpt-oss: "
            "<|channel|>commentary to=functions.NAME ... <|call|>), or auto: the one the chat template "
            "or the tokenizer's special tokens show, else hermes"
        ),
    )
    enable_thinking: bool | None = option(
        None,
        help=(
            "passed to a hybrid thinking template (Qwen3's) as enable_thinking: false opens each turn with an empty "
            "<think></think> block; unset: the template's default"
        ),
    )
    per_turn_samples: bool = option(
        False,
        help=(
            "train each turn as its own sample, prompted with the template's own rendering of the conversation so far "
            "(past turns as the template rewrites them, as a served model sees them); a group then holds one sample per "
            "turn, each with its trajectory's reward (docs/multi-turn.md: the trade-off)"
        ),
    )
    per_trajectory: bool = option(
        False,
        help=(
            "--loop async: roll out each conversation as its own task (one prompt, one sample per call), "
            "so one waiting on its environment or tools holds up no other; "
            "best with a server sampler, while the in-process sampler generates faster in batched rounds"
        ),
    )

    def __attrs_post_init__(self) -> None:
        if self.per_turn_samples and self.on_prefix_mismatch != "append":
            raise ValueError(
                f"on_prefix_mismatch={self.on_prefix_mismatch} does nothing with per_turn_samples: each turn is prompted with "
                "the template's own rendering, so no prefix is checked"
            )

    @hookimpl
    def rollout(
        self,
        prompts: Sequence[Prompt],
        num_samples: int,
        sampler: Sampler,
        params: SamplingParams,
        env: Callable[[Prompt], Episode] | None,
        tools: Mapping[str, Any],
    ) -> list[list[Sample]]:
        tokenizer = sampler.tokenizer
        tool_format = FORMATS[self._tool_format(tokenizer)] if tools else None
        if not tools and self.tool_format != "auto":
            raise PluginError(f"--rollout-opt tool_format={self.tool_format} is given but no tool is selected (--tool NAME)")
        chat = ChatFormat(
            tokenizer, self._template(tokenizer), [{"type": "function", "function": tool.tool_spec()} for tool in tools.values()],
            {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking},
        )  # fmt: skip
        limit = self.max_total_tokens or sampler.max_context
        counts = {"tool/calls": 0, "tool/errors": 0, "tool/timeouts": 0, "multi_turn/prefix_failures": 0, "multi_turn/history_rewrites": 0}
        groups = [[self._open(p, env, chat) for _ in range(num_samples)] for p in prompts]
        for group in groups:
            for conv in group:
                if limit is not None and len(conv.tokens) >= limit:
                    raise PluginError(
                        f"prompt {conv.prompt.id}: its conversation opens with {len(conv.tokens)} tokens, which leaves no room "
                        f"within {limit} (max_total_tokens, or the model's context)"
                    )
        if tool_format is not None:
            params = attrs.evolve(params, stop=[*params.stop, *tool_format.stop])
        first_round = True
        while live := [c for g in groups for c in g if c.live]:
            completions = self._sample(sampler, groups if first_round else None, live, params, limit)
            first_round = False
            for conv, completion in zip(live, completions):
                self._take_turn(conv, completion, chat, tool_format, tools, limit, counts)
        samples = [[s for c in group for s in self._samples_of(c)] for group in groups]
        trajectories = [c for g in groups for c in g]
        n = max(len(trajectories), 1)
        record("multi_turn/turns_mean", sum(len(c.turns) for c in trajectories) / n, "mean", weight=len(trajectories))
        record("multi_turn/max_turns_frac", sum(c.finish_reason == "max_turns" for c in trajectories) / n, "mean", weight=len(trajectories))
        for key, value in counts.items():
            record(key, value, "sum")
        return samples

    def _tool_format(self, tokenizer: Any) -> str:
        return tool_format_name(tokenizer, self._template(tokenizer), self.tool_format)

    def _template(self, tokenizer: Any) -> str | None:
        """The plain template, or None for the tokenizer's own (which may be several, by name)."""
        template = chat_template(tokenizer, self.template)
        if self.enable_thinking is not None and "enable_thinking" not in str(template or getattr(tokenizer, "chat_template", None)):
            raise PluginError(
                "--rollout-opt enable_thinking is given but the chat template does not read enable_thinking (only hybrid "
                "thinking templates such as Qwen3's do)"
            )
        return template

    def _open(self, prompt: Prompt, env: Callable[[Prompt], Episode] | None, chat: ChatFormat) -> Conversation:
        if has_images(prompt):
            raise PluginError(f"prompt {prompt.id} has images, which the multi_turn rollout does not take (single_turn does)")
        episode = env(prompt) if env is not None else None
        if env is not None and (
            episode is None or not isinstance(getattr(episode, "messages", None), list) or not hasattr(episode, "step")
        ):
            raise PluginError(
                f"the environment's env_reset returned {episode!r} for prompt {prompt.id}, not an episode (messages and step)"
            )
        if episode is not None:
            messages = [dict(m) for m in episode.messages]
        else:
            messages = [dict(m) for m in prompt.messages] if prompt.messages is not None else [{"role": "user", "content": prompt.text}]
        if not messages:
            raise PluginError(f"prompt {prompt.id}: the conversation opens with no messages")
        rendered = chat.render(messages)
        without_header = chat.render(messages, add_generation_prompt=False)
        tokens = encode(chat.tokenizer, rendered)
        return Conversation(
            prompt, episode, messages, tokens, [0.0] * len(tokens), [0.0] * len(tokens), rendered,
            segments=[(0, 0, "the opening messages")], env_reward=0.0 if episode else None,
            generation_prompt=rendered.removeprefix(without_header) if rendered.startswith(without_header) else "",
            template_pieces=[rendered],
        )  # fmt: skip

    def _sample(
        self, sampler: Sampler, groups: list[list[Conversation]] | None, live: list[Conversation], params: SamplingParams, limit: int | None
    ) -> list[Completion]:
        """The next turn of every live conversation, in one sampler call.

        In the first round a group whose conversations open alike is one prompt with the group's
        size, so the sampler prefills it once; later rounds send each conversation alone.
        """
        room = max(limit - len(c.tokens) for c in live) if limit is not None else params.max_tokens
        round_params = attrs.evolve(params, max_tokens=min(params.max_tokens, room))
        version = sampler.version
        for conv in live:
            conv.policy_version = version if conv.policy_version is None else min(conv.policy_version, version)
        if groups is not None and all(all(c.tokens == g[0].tokens for c in g) for g in groups):
            completions = sampler.sample([g[0].tokens for g in groups], len(groups[0]), round_params)
            return [c for group in completions for c in group]
        return [group[0] for group in sampler.sample([c.tokens for c in live], 1, round_params)]

    def _take_turn(
        self,
        conv: Conversation,
        completion: Completion,
        chat: ChatFormat,
        tool_format: ToolFormat | None,
        tools: Mapping[str, Any],
        limit: int | None,
        counts: dict[str, int],
    ) -> None:
        tokens, logprobs, finish = list(completion.tokens), list(completion.logprobs), completion.finish_reason
        if limit is not None and len(conv.tokens) + len(tokens) > limit:
            # The round sampled up to the roomiest conversation's budget; this one has less.
            keep = limit - len(conv.tokens)
            tokens, logprobs, finish = tokens[:keep], logprobs[:keep], "length"
        conv.routes = extended_routes(conv.routes, completion.routed_experts, len(conv.tokens) + len(tokens) - 1)
        start = len(conv.tokens)
        conv.tokens += tokens
        conv.logprobs += logprobs
        conv.mask += [1.0] * len(tokens)
        conv.text = chat.tokenizer.decode(tokens, skip_special_tokens=True)
        turn = Turn(start=start, end=len(conv.tokens), context_end=len(conv.tokens))
        conv.turns.append(turn)
        conv.segments.append((len(conv.rendered), start, f"the policy's turn {len(conv.turns)}"))
        conv.rendered += conv.text

        calls = tool_format.calls(decode(chat.tokenizer, without_end_of_turn(tokens, chat.tokenizer))) if tool_format else []
        if calls:
            observation = [self._call_tool(call, tools, counts) for call in calls]
            done = False
        elif conv.episode is not None:
            step = conv.episode.step(conv.text, tokens)
            conv.env_reward = (conv.env_reward or 0.0) + float(step.reward)
            observation, done = [dict(m) for m in step.messages], step.done
            if done and step.cut_at_max_turns:
                finish = "max_turns"  # as a conversation the rollout itself ends there (below)
        else:
            observation, done = [], True
        if done:
            conv.finish_reason, conv.env_done = finish, conv.episode is not None
            return
        if len(conv.turns) >= self.max_turns:
            conv.finish_reason = "max_turns"
            return
        if limit is not None and len(conv.tokens) >= limit:
            conv.finish_reason = "length"
            return
        conv.policy_messages.append(len(conv.messages))
        conv.messages += [{"role": "assistant", "content": conv.text}, *observation]
        if self.per_turn_samples:
            self._next_context(conv, chat, limit)
            return
        try:
            added = self._extension(conv, tokens if finish == "stop" else [], chat, counts)
        except PrefixMismatch:
            counts["multi_turn/prefix_failures"] += 1
            if self.on_prefix_mismatch != "end":
                raise
            conv.finish_reason = "prefix_mismatch"
            return
        if limit is not None and len(conv.tokens) + len(added) >= limit:
            conv.finish_reason = "length"  # no room left to answer the observation
            return
        conv.tokens += added
        conv.logprobs += [0.0] * len(added)
        conv.mask += [0.0] * len(added)
        turn.context_end = len(conv.tokens)

    def _next_context(self, conv: Conversation, chat: ChatFormat, limit: int | None) -> None:
        """Per turn samples: the turn just taken becomes a sample of its own; the next turn is
        prompted with the template's rendering of the whole conversation."""
        rendered = chat.render(conv.messages)
        tokens = encode(chat.tokenizer, rendered)
        if limit is not None and len(tokens) >= limit:
            conv.finish_reason = "length"  # no room left to answer the observation
            return
        conv.earlier_samples.append((conv.tokens, conv.logprobs, conv.mask, conv.turns[-1:], conv.routes))
        conv.tokens, conv.logprobs, conv.mask, conv.rendered = tokens, [0.0] * len(tokens), [0.0] * len(tokens), rendered
        conv.routes = None

    def _extension(self, conv: Conversation, stopped: list[int], chat: ChatFormat, counts: dict[str, int]) -> list[int]:
        """The tokens of what the template writes after the policy's new turn, up to the next assistant header.

        The policy's tokens are never re-encoded: the template's rendering of the whole conversation
        must begin with the text of the conversation so far (its turns as the policy's decoded text),
        and only the rest is encoded. A template that rewrites history fails that; with ``append``,
        the conversation's skeleton (every policy turn a placeholder) must then render as before but
        for the generation prompts, and what follows the new turn's placeholder is appended. When the
        policy ended its turn with a special token that the template writes next anyway (its end of
        turn), that token is not written twice.
        """
        tokenizer = chat.tokenizer
        rendered = chat.render(conv.messages)
        if rendered.startswith(conv.rendered):
            added = rendered[len(conv.rendered) :]
        elif self.on_prefix_mismatch == "append":
            added = self._after_new_turn(conv, chat, rendered)
            counts["multi_turn/history_rewrites"] += 1
        else:
            raise self._mismatch(conv, rendered)
        conv.segments.append((len(conv.rendered), len(conv.tokens), f"what the template adds after turn {len(conv.turns)}"))
        conv.rendered += added
        conv.template_pieces.append(added)
        if stopped and stopped[-1] in tokenizer.all_special_ids:
            stop_text = decode(tokenizer, stopped[-1:])
            added = added.removeprefix(stop_text)
        return encode(tokenizer, added)

    def _after_new_turn(self, conv: Conversation, chat: ChatFormat, rendered: str) -> str:
        """What the template writes after the new turn, read from the skeleton's rendering; a
        PrefixMismatch where the template changed anything but the policy's turns and their
        generation prompts."""
        skeleton = [dict(m) for m in conv.messages]
        for turn, index in enumerate(conv.policy_messages):
            skeleton[index]["content"] = PLACEHOLDER.format(turn)
        text = chat.render(skeleton)
        pieces = []
        for turn in range(len(conv.policy_messages)):
            before, found, text = text.partition(PLACEHOLDER.format(turn))
            if not found or PLACEHOLDER.format(turn) in text:
                raise self._mismatch(conv, rendered)
            pieces.append(before)
        for before, written in zip(pieces, conv.template_pieces):
            same = len(os.path.commonprefix([before, written]))
            # What differs may only be the end of the piece: whitespace at the policy's turn, or the
            # generation prompt of that turn (an opened or empty <think> block).
            for tail in (written[same:], before[same:]):
                if tail.strip() and not conv.generation_prompt.endswith(tail):
                    raise self._mismatch(conv, rendered)
        return text

    def _mismatch(self, conv: Conversation, rendered: str) -> PrefixMismatch:
        before = conv.rendered
        at = next((i for i, (a, b) in enumerate(zip(before, rendered)) if a != b), min(len(before), len(rendered)))
        _, first_token, piece = next(seg for seg in reversed(conv.segments) if seg[0] <= at)
        return PrefixMismatch(
            f"prompt {conv.prompt.id}, after turn {len(conv.turns)}: the chat template does not extend the conversation. "
            f"At character {at} of its text, in {piece} (from token {first_token}), the conversation reads {before[at : at + 40]!r} "
            f"but the template now renders {rendered[at : at + 40]!r}. A template that rewrites earlier turns (dropping "
            "reasoning, trimming the policy's text) is followed with --rollout-opt on_prefix_mismatch=append only where it "
            "rewrites nothing but the policy's turns and their generation prompts; use one that only appends "
            "(--rollout-opt template=plain), or --rollout-opt on_prefix_mismatch=end to end such conversations there "
            "(counted in multi_turn/prefix_failures)"
        )

    def _call_tool(self, call: ToolCall, tools: Mapping[str, Any], counts: dict[str, int]) -> dict[str, Any]:
        """One tool call's answer as a ``tool`` message; a bad call, a raising or slow tool answer with an error."""
        counts["tool/calls"] += 1
        try:
            if call.error is not None:
                raise ValueError(call.error)
            tool = tools.get(call.name)
            if tool is None:
                raise ValueError(f"unknown tool {call.name!r}; tools: {', '.join(tools)}")
            result = call_with_timeout(lambda: tool.tool_call(arguments=call.arguments), self.tool_timeout)
            content = result if isinstance(result, str) else json.dumps(result)
        except CallTimeout as exc:
            counts["tool/errors"] += 1
            counts["tool/timeouts"] += 1
            content = f"error: {call.name} {exc}"
        except Exception as exc:  # the policy reads what went wrong and may try again
            counts["tool/errors"] += 1
            content = f"error: {exc}"
        return {"role": "tool", "name": call.name or "", "content": content}

    @staticmethod
    def _env_score(conv: Conversation) -> float | None:
        """The environment's score of the conversation; None where it scores only at the end and
        the rollout ended the conversation first (unscored: counted as failed, never a silent 0)."""
        if conv.episode is not None and not conv.env_done and declared(conv.episode, "episode object", "scored_at_end"):
            return None
        return conv.env_reward

    def _samples_of(self, conv: Conversation) -> list[Sample]:
        """The trajectory as one sample; with per_turn_samples, one per turn, each with the trajectory's outcome."""
        current = (conv.tokens, conv.logprobs, conv.mask, conv.turns[len(conv.earlier_samples) :], conv.routes)
        return [
            Sample(
                prompt=conv.prompt,
                tokens=tokens,
                sampling_logprobs=logprobs,
                loss_mask=mask,
                text=conv.text,
                finish_reason=str(conv.finish_reason),
                policy_version=int(conv.policy_version or 0),
                turns=turns,
                env_reward=self._env_score(conv),
                routed_experts=routes,
            )
            for tokens, logprobs, mask, turns, routes in [*conv.earlier_samples, current]
        ]


def chat_template(tokenizer: Any, choice: str) -> str | None:
    """The chat template a rollout's ``template`` option chooses: grpo-core's plain one, or None for
    the tokenizer's own (auto: the tokenizer's when it has one)."""
    own = getattr(tokenizer, "chat_template", None)
    if choice == "tokenizer" and own is None:
        raise PluginError("the tokenizer has no chat template: pass --rollout-opt template=plain (or auto) to use grpo-core's plain one")
    return PLAIN_TEMPLATE if choice == "plain" or own is None else None


def tool_format_name(tokenizer: Any, template: str | None, choice: str) -> str:
    """The tool-call format a rollout's ``tool_format`` option chooses: auto reads the one the chat
    template or the tokenizer's special tokens show, else hermes."""
    if choice != "auto":
        return choice
    return detect(str(template or getattr(tokenizer, "chat_template", None)), tokenizer.get_added_vocab()) or "hermes"


def extended_routes(known: Any, new: Any, upto: int) -> Any:
    """The routing of a conversation's first ``upto`` tokens once a sampler call returned ``new``
    (its routing of the conversation so far and of the turn it drew): the tokens routed before keep
    their routes (those their logprobs were drawn with), the rest take the new call's."""
    if new is None:
        return None
    import torch

    return new[:upto] if known is None else torch.cat([known, new[len(known) : upto]])


@attrs.frozen
class ChatFormat:
    """How one rollout writes conversations: the tokenizer, its chat template, the tools' specs."""

    tokenizer: Any
    template: str | None
    """grpo-core's plain template, or None for the tokenizer's own."""
    tool_specs: list[dict[str, Any]]
    template_kwargs: dict[str, Any]
    """Passed to the template as variables (``enable_thinking``)."""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return render(self.tokenizer, self.template, messages, self.tool_specs, add_generation_prompt, **self.template_kwargs)


def render(
    tokenizer: Any,
    template: str | None,
    messages: list[dict[str, Any]],
    tool_specs: list,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> str:
    """The conversation as the template writes it, ending with the next assistant header."""
    extra = {"tools": tool_specs} if tool_specs else {}
    return tokenizer.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False, **extra, **template_kwargs
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    # The template writes every special token itself (bos included): none is added here.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def without_end_of_turn(tokens: list[int], tokenizer: Any) -> list[int]:
    """A turn's tokens less the special token that ended it (a tool-call format reads what precedes it)."""
    return tokens[:-1] if tokens and tokens[-1] in tokenizer.all_special_ids else tokens


def decode(tokenizer: Any, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
