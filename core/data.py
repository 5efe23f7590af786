"""Datasets: rows -> Prompts, checked whole before the model loads, in a seeded order.

Rows come from a JSONL file, a Parquet file, a folder written by HF ``datasets``'
``save_to_disk``, or a Hugging Face hub dataset (``dataset_source``); the last three need the
``datasets`` extra. A URL is fetched into a cache first (``grpo_core.fetch``); several sources
make a mixture (``--mix``, ``grpo_core.mixture``). A prompt is text, a chat (``messages``) or
token ids (a list in the prompt field, sampled as given; ``check_token_prompts``).
``load_dataset`` reads and checks every row at start (UTF-8, JSON, a non-empty prompt, an answer
when a selected reward needs one), whatever its source; ``check_prompt_lengths`` then measures
every prompt with the rollout's own encoding against the model's context. A bad row is a
DataError naming its file and line (or index), or, when asked for, a skip that is counted and
reported.

The embedded task has two splits, ``default:train`` (also plain ``default``) and
``default:test``; given by name or by the path of its file, it keeps its prompt template.
``reasoning_gym:TASKS[:N][:SPLIT]`` generates rows offline with the ``reasoning-gym`` extra
(see ``reasoning_gym_rows``).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import random
import re
import sys
from collections.abc import Iterator, Sequence
from difflib import get_close_matches
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from grpo_core.embedded import EMBEDDED, embedded_split, split_path
from grpo_core.errors import DataError, PluginError
from grpo_core.fetch import Fetched, fetch, is_url
from grpo_core.hookspecs import declared
from grpo_core.images import resolve_images
from grpo_core.mixture import MixSource, mixture_batches, parse_mix
from grpo_core.options import is_secret, option_fields
from grpo_core.plugins_manager import find, provided
from grpo_core.types import Prompt

if TYPE_CHECKING:
    from grpo_core.config import RunConfig

DEFAULT_TASK_TEMPLATE = "Question: {prompt}\nAnswer:"
DEFAULT_DATASET = "default"
REASONING_GYM = "reasoning_gym"
REASONING_GYM_TEMPLATE = "{prompt}\nGive your final answer inside <answer></answer> tags."
"""The ``reasoning_gym`` reward reads the answer from those tags, as reasoning-gym's own ``extract_answer`` does."""
REASONING_GYM_ROWS = 1000
REASONING_GYM_SPLITS = ("train", "test")
PROMPT_SETTINGS_FILE = "grpo_core_prompt.json"
SHOWN_SKIPS = 3
"""How many skip reasons a notice quotes; the count covers them all."""


@attrs.define
class Dataset:
    """The checked prompts of a run and what was left out of them, with reasons."""

    prompts: list[Prompt]
    path: Path
    name: str
    """What identifies it to a user: ``default:test`` for an embedded split, else the path."""
    template: str
    """The prompt template in effect (the embedded task's when none is given)."""
    skipped_bad_rows: list[str] = attrs.field(factory=list)
    skipped_long_prompts: list[str] = attrs.field(factory=list)
    fetched: list[Fetched] = attrs.field(factory=list)
    """The URLs its rows were fetched from, and the cached files read (``data.json`` records them)."""
    mixture: dict[str, float] = attrs.field(factory=dict)
    """A mixture's sources by name, with their weights (``--mix``); empty for one dataset."""
    locations: dict[str, Path] = attrs.field(factory=dict)
    """A mixture's sources by name: the file or folder each one's rows are named after."""

    def where(self, prompt: Prompt) -> Path:
        """The file (or folder) and row a prompt came from, as errors name it."""
        if prompt.source is None:
            return self.path.parent / prompt.id
        return self.locations[prompt.source].parent / prompt.id.removeprefix(f"{prompt.source}/")

    def batches(self, batch_size: int, epochs: int, seed: int, shuffle: bool) -> Iterator[list[Prompt]]:
        """The run's order: :func:`prompt_batches`, or a mixture's (:func:`grpo_core.mixture.mixture_batches`)."""
        if self.mixture:
            return mixture_batches(self.prompts, self.mixture, batch_size, epochs, seed, shuffle)
        return prompt_batches(self.prompts, batch_size, epochs, seed, shuffle)

    @property
    def counts(self) -> dict[str, int]:
        """For the summary, metrics and config: how many prompts are used and how many were skipped."""
        return {
            "data/prompts": len(self.prompts),
            "data/skipped_bad_rows": len(self.skipped_bad_rows),
            "data/skipped_long_prompts": len(self.skipped_long_prompts),
        }


def rows_fingerprint(prompts: Sequence[Prompt]) -> str:
    """sha256 of the rows a run uses, as loaded (id, prompt, answer, metadata): the same for every
    source (file, saved folder, hub, generated), and blind to what the run never reads (rows past
    ``max_rows``, a bad row it skips). ``--resume`` compares it to refuse data that changed."""
    digest = hashlib.sha256()
    for prompt in prompts:
        row = [prompt.id, prompt.text, prompt.messages, prompt.answer, prompt.metadata]
        # Only rows that have them carry tokens and a source: older runs' fingerprints stay as they were.
        row += [prompt.tokens] if prompt.tokens is not None else []
        row += [prompt.source] if prompt.source is not None else []
        digest.update(json.dumps(row, sort_keys=True, default=repr).encode() + b"\n")
    return digest.hexdigest()


def dataset_name(dataset: str) -> str:
    split = embedded_split(dataset)
    return f"{EMBEDDED}:{split}" if split else dataset


def resolve_template(config: RunConfig) -> str:
    """The prompt template in effect: ``--prompt-template``, else the dataset's own (a mixture's sources each keep theirs)."""
    if config.mix:
        return config.prompt_template if config.prompt_template is not None else "{prompt}"
    return template_for(config.dataset, config.prompt_template)


def template_for(dataset: str, prompt_template: str | None) -> str:
    if prompt_template is not None:
        return prompt_template
    if dataset.startswith(f"{REASONING_GYM}:"):
        return REASONING_GYM_TEMPLATE
    return DEFAULT_TASK_TEMPLATE if embedded_split(dataset) else "{prompt}"


def load_dataset(config: RunConfig, answer_needed_by: Sequence[str] = (), refetch: bool = False) -> Dataset:
    """Read and check every row of ``config.dataset``, or of each source of ``config.mix`` (up to
    ``max_rows`` usable ones each).

    :param answer_needed_by: names of the selected rewards that need a row's answer
        (``Selection.rewards_needing_answer``); a row without one is then bad.
    :param refetch: a dataset URL is fetched again even when cached (a new run; a resumed one
        and an evaluation read the cached copy).
    """
    if config.mix and config.dataset != DEFAULT_DATASET:
        raise DataError(f"--dataset {config.dataset} and --mix both name the prompts; make the dataset one more --mix source")
    sources = parse_mix(config.mix) if config.mix else [MixSource("", 1.0, config.dataset)]
    dataset = None
    for mixed in sources:
        fetched = fetch(mixed.dataset, config.fetch_timeout, refetch) if is_url(mixed.dataset) else None
        source = dataset_source(str(fetched.path) if fetched else mixed.dataset, config.seed)
        template = template_for(mixed.dataset, config.prompt_template)
        skipped: list[str] | None = [] if config.skip_bad_rows else None
        prompts = load_prompts(source, config.prompt_field, config.answer_field, template, config.max_rows, skipped, answer_needed_by)
        _report_skips(skipped or [], f"bad rows of {source.path}", "--skip-bad-rows")
        if prompts[0].tokens is not None and config.prompt_template not in (None, "{prompt}"):
            raise DataError(f"{source.path}: the prompts are token ids, which no template changes; drop --prompt-template")
        if mixed.name:
            for prompt in prompts:
                # Ids name rows across the run (the rollout keeps tokens by id): two sources' files may share a name.
                prompt.id, prompt.source = f"{mixed.name}/{prompt.id}", mixed.name
        if dataset is None:
            name = " ".join(config.mix) if config.mix else dataset_name(config.dataset)
            dataset = Dataset([], source.path, name, resolve_template(config))
        elif (prompts[0].tokens is None) != (dataset.prompts[0].tokens is None):
            forms = ("token ids", "text") if prompts[0].tokens is not None else ("text", "token ids")
            raise DataError(f"--mix: the source {mixed.name}'s prompts are {forms[0]}, {dataset.prompts[0].source}'s are {forms[1]}")
        dataset.prompts += prompts
        dataset.skipped_bad_rows += skipped or []
        dataset.fetched += [fetched] if fetched else []
        if mixed.name:
            dataset.mixture[mixed.name] = mixed.weight
            dataset.locations[mixed.name] = source.path
    assert dataset is not None, "a mixture has a source (parse_mix)"
    return dataset


@attrs.frozen
class Source:
    """Where a dataset's rows come from: a JSONL or Parquet file, a folder written by HF
    ``datasets``' ``save_to_disk``, or a dataset on the Hugging Face hub.

    A row is named ``<path>:<line>`` in a JSONL file and ``<path>[<index>]`` otherwise (the
    index counts from 0, as ``dataset[index]`` does); its prompt's id is that name without the
    folders before ``path.name``.
    """

    kind: str
    """``jsonl``, ``parquet``, ``saved``, ``hub`` or ``reasoning_gym``."""
    path: Path
    """What names the rows in messages: the file or folder, with ``:SPLIT`` when one is given; the hub name."""
    location: Path | None = None
    """The file or folder on disk (None for the hub)."""
    split: str | None = None
    hub_name: str | None = None
    hub_config: str | None = None
    seed: int = 0
    """The run's seed, from which generated rows (``reasoning_gym``) are drawn."""


FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
"""A name ending so is a file: when it does not exist, it is not looked up on the hub."""
SAVED_DATASET_MARKERS = ("dataset_dict.json", "state.json")
"""What ``save_to_disk`` writes in a folder: the first for splits (a DatasetDict), the second for one Dataset."""
HUB_NAME = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def dataset_source(dataset: str, seed: int = 0) -> Source:
    """Which source ``dataset`` names: the embedded task's split; ``reasoning_gym:...`` rows
    generated from ``seed``; an existing file (``.parquet``: Parquet, else JSONL); a
    ``save_to_disk`` folder, ``FOLDER`` or ``FOLDER:SPLIT``; else a hub dataset, ``NAME``,
    ``NAME:SPLIT`` or ``NAME:CONFIG:SPLIT`` (split ``train`` by default)."""
    if dataset.startswith(f"{REASONING_GYM}:"):
        return Source(REASONING_GYM, Path(dataset), seed=seed)
    split = embedded_split(dataset)
    if split:
        return Source("jsonl", split_path(split), split_path(split))
    path = Path(dataset)
    if path.is_file():
        return Source("parquet" if path.suffix == ".parquet" else "jsonl", path, path)
    if path.is_dir():
        return Source("saved", path, path)
    folder, sep, folder_split = dataset.rpartition(":")
    if sep and Path(folder).is_dir():
        return Source("saved", path, Path(folder), split=folder_split)
    name, *parts = dataset.split(":")
    if path.suffix in FILE_SUFFIXES or not HUB_NAME.match(name) or len(parts) > 2 or not all(parts):
        raise DataError(f"dataset file not found: {dataset}")
    return Source("hub", path, split=parts[-1] if parts else "train", hub_name=name, hub_config=parts[0] if len(parts) == 2 else None)


def load_prompts(
    dataset: str | Path | Source,
    prompt_field: str = "question",
    answer_field: str = "answer",
    template: str = "{prompt}",
    max_rows: int | None = None,
    skipped: list[str] | None = None,
    answer_needed_by: Sequence[str] = (),
) -> list[Prompt]:
    """Read the prompts of a dataset (see ``dataset_source``); a row may hold text in
    ``prompt_field`` or a ``messages`` list.

    A bad row raises DataError naming file and line (or index), unless ``skipped`` is a list:
    then the row's error is appended to it and the row left out. Rows past ``max_rows`` usable
    ones are not read. Every source's rows go through the same checks.
    """
    if "{prompt}" not in template:
        raise DataError(f"prompt template {template!r} has no {{prompt}} placeholder")
    source = dataset if isinstance(dataset, Source) else dataset_source(str(dataset))
    path = source.path
    prompts: list[Prompt] = []
    first_row = ""
    for at, raw in _raw_rows(source):
        if max_rows is not None and len(prompts) >= max_rows:
            break
        try:
            row = _row(raw, f"{path}{at}")
            if row is None:
                continue
            prompt = _prompt(row, f"{path}{at}", f"{path.name}{at}", prompt_field, answer_field, template, answer_needed_by)
            if prompts and (prompt.tokens is None) != (prompts[0].tokens is None):
                # Rows of both forms would be trained unlike each other: a template and special tokens for some only.
                this, first = ("token ids", "text") if prompt.tokens is not None else ("text", "token ids")
                raise DataError(
                    f"{path}{at}: the prompt is {this}, but {first_row}'s is {first}: a dataset is all pre-tokenized or all text"
                )
            first_row = first_row or f"{path}{at}"
            prompts.append(resolve_images(prompt, f"{path}{at}", image_folder(source)))
        except DataError as exc:
            if skipped is None:
                raise
            skipped.append(str(exc))
    if not prompts:
        if skipped:
            raise DataError(f"{path}: no usable rows; all {len(skipped)} were bad, first: {skipped[0]}")
        raise DataError(f"{path}: no rows")
    return prompts


def image_folder(source: Source) -> Path | None:
    """The folder a row's relative image paths start from: the dataset file's, a saved dataset's own."""
    if source.location is None:
        return None
    return source.location if source.location.is_dir() else source.location.parent


def _raw_rows(source: Source) -> Iterator[tuple[str, bytes | dict[str, Any]]]:
    """``(where in the source, raw row)``: a JSONL line's bytes, or a row of the other sources as a dict."""
    if source.kind == "jsonl":
        with source.location.open("rb") as f:
            for lineno, raw in enumerate(f, start=1):
                # A byte-order mark some editors write is not part of the first row's JSON.
                yield f":{lineno}", raw.removeprefix(b"\xef\xbb\xbf") if lineno == 1 else raw
        return
    if source.kind == "parquet":
        parquet = import_extra("pyarrow.parquet", "datasets", "a Parquet dataset")
        index = 0
        try:
            table = parquet.ParquetFile(source.location)
        except Exception as exc:  # noqa: BLE001 - pyarrow's errors (ArrowInvalid...): the user needs the file and the reason
            raise DataError(f"{source.location}: not a readable Parquet file ({exc}); JSONL rows go in a .jsonl file") from None
        for batch in table.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield f"[{index}]", row
                index += 1
        return
    if source.kind == REASONING_GYM:
        yield from ((f"[{index}]", row) for index, row in enumerate(reasoning_gym_rows(str(source.path), source.seed)))
        return
    table = _load_saved(source) if source.kind == "saved" else _load_hub(source)
    for index, row in enumerate(table):
        yield f"[{index}]", row


def reasoning_gym_rows(dataset: str, seed: int) -> Any:
    """The rows that ``reasoning_gym:TASKS[:N][:SPLIT]`` names, generated by reasoning-gym.

    TASKS is one task (``basic_arithmetic``) or weighted tasks (``basic_arithmetic=2,chain_sum=1``,
    drawn per row by reasoning-gym's ``composite``), each with its default configuration; N rows
    (1000 by default); SPLIT ``train`` (default) or ``test``, drawn from different seeds derived
    from ``seed``. A row is the task's own entry: ``question``, ``answer`` and ``metadata``, kept
    as generated so that the task's scorer reads it as it expects (the ``reasoning_gym`` reward).
    """
    spec, *rest = dataset.removeprefix(f"{REASONING_GYM}:").split(":")
    split = rest.pop() if rest and rest[-1] in REASONING_GYM_SPLITS else "train"
    if len(rest) > 1 or (rest and not (rest[0].isdigit() and int(rest[0]) > 0)):
        raise DataError(f"{dataset}: expected reasoning_gym:TASK[:N][:SPLIT] (N a positive row count, SPLIT train or test)")
    size = int(rest[0]) if rest else REASONING_GYM_ROWS
    weights = _reasoning_gym_weights(dataset, spec)
    reasoning_gym = import_extra("reasoning_gym", "reasoning-gym", f"the dataset {dataset}")
    # composite is reasoning-gym's mixer, which weighted TASKS name; alone it has no tasks to draw.
    known = sorted(set(reasoning_gym.factory.DATASETS) - {"composite"})
    for task in weights:
        if task not in known:
            close = get_close_matches(task, known, n=5, cutoff=0.5)
            hint = f"close names: {', '.join(close)}" if close else f"{len(known)} tasks, e.g. {', '.join(known[:5])}"
            raise DataError(f"{dataset}: reasoning-gym has no task '{task}'; {hint}")
    # A string seed is hashed with SHA-512 by random.Random: the same on every machine and run.
    split_seed = random.Random(f"{REASONING_GYM}:{split}:{seed}").getrandbits(32)
    if len(weights) == 1:
        return reasoning_gym.create_dataset(next(iter(weights)), size=size, seed=split_seed)
    tasks = [reasoning_gym.composite.DatasetSpec(task, weight, {}) for task, weight in weights.items()]
    return reasoning_gym.create_dataset("composite", size=size, seed=split_seed, datasets=tasks)


def _reasoning_gym_weights(dataset: str, spec: str) -> dict[str, float]:
    weights: dict[str, float] = {}
    for item in spec.split(","):
        task, sep, weight = item.partition("=")
        try:
            value = float(weight) if sep else 1.0
        except ValueError:
            value = -1.0
        if not task or not 0 < value < float("inf") or task in weights:
            raise DataError(f"{dataset}: '{item}' is not TASK or TASK=WEIGHT (a positive number, each task once)")
        weights[task] = value
    return weights


def _load_saved(source: Source) -> Any:
    datasets = import_extra("datasets", "datasets", "a dataset folder")
    folder = source.location
    if not any((folder / marker).is_file() for marker in SAVED_DATASET_MARKERS):
        raise DataError(f"{folder}: not a dataset folder (save_to_disk of HF datasets writes {' or '.join(SAVED_DATASET_MARKERS)} in one)")
    try:
        saved = datasets.load_from_disk(str(folder))
    except Exception as exc:  # noqa: BLE001 - whatever datasets raises, the user needs the folder and the reason
        raise DataError(f"{folder}: cannot read the saved dataset: {exc}") from None
    if not isinstance(saved, datasets.DatasetDict):
        if source.split is not None:
            raise DataError(f"{folder} holds one dataset, not splits; drop ':{source.split}'")
        return saved
    split = source.split or "train"
    if split not in saved:
        raise DataError(f"{folder} has no split '{split}'; splits: {', '.join(saved)} (choose one with {folder}:SPLIT)")
    return saved[split]


def _load_hub(source: Source) -> Any:
    datasets = import_extra("datasets", "datasets", f"the hub dataset {source.path}")
    try:
        return datasets.load_dataset(source.hub_name, source.hub_config, split=source.split)
    except Exception as exc:  # noqa: BLE001 - the hub, the network and the dataset's own script fail in many ways
        offline = [
            v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
        ]
        why = f" (offline: {' and '.join(offline)} set)" if offline else ""
        raise DataError(
            f"{source.path}: no such file or folder, and loading it from the Hugging Face hub failed{why}: {exc}; "
            "for a hub dataset give NAME, NAME:SPLIT or NAME:CONFIG:SPLIT"
        ) from None


def import_extra(module: str, extra: str, needed_for: str) -> Any:
    """Import ``module`` of an optional extra; missing, a PluginError tells how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise PluginError(f"{needed_for} needs the optional extra '{extra}': pip install 'grpo-core[{extra}]'") from None


def _row(raw: bytes | dict[str, Any], where: str) -> dict[str, Any] | None:
    """A row as a dict, or None for a blank JSONL line."""
    if isinstance(raw, dict):
        return raw
    line = _decode_line(raw, where)
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: malformed JSON: {exc.msg}") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return row


def _decode_line(raw: bytes, where: str) -> str:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{where}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})") from None
    return line


def _prompt(
    row: dict[str, Any], where: str, prompt_id: str, prompt_field: str, answer_field: str, template: str, answer_needed_by: Sequence[str]
) -> Prompt:
    messages = row.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise DataError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        if not messages:
            raise DataError(f"{where}: 'messages' is empty")
        for i, message in enumerate(messages, start=1):
            content = message["content"]
            if not content or (isinstance(content, str) and not content.strip()):
                raise DataError(f"{where}: message {i} ({message['role']}) has empty content")
        return Prompt(id=prompt_id, messages=messages, answer=_answer(row, where, answer_field, answer_needed_by), metadata=row)
    if prompt_field not in row:
        raise DataError(f"{where}: missing field '{prompt_field}' (fields: {', '.join(row) or 'none'}); set --prompt-field")
    text = row[prompt_field]
    if isinstance(text, list):
        tokens = _token_ids(text, where, prompt_field)
        return Prompt(id=prompt_id, tokens=tokens, answer=_answer(row, where, answer_field, answer_needed_by), metadata=row)
    if text is not None and not isinstance(text, str):
        raise DataError(f"{where}: field '{prompt_field}' must be a string (or a list of token ids)")
    if not text or not text.strip():
        raise DataError(f"{where}: the prompt (field '{prompt_field}') is empty")
    answer = _answer(row, where, answer_field, answer_needed_by)
    return Prompt(id=prompt_id, text=template.replace("{prompt}", text), answer=answer, metadata=row)


def _token_ids(value: list[Any], where: str, prompt_field: str) -> list[int]:
    if not value:
        raise DataError(f"{where}: the prompt (field '{prompt_field}') is an empty list of token ids")
    for position, token in enumerate(value):
        # JSON's true/false are ints to Python, and no token id.
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise DataError(
                f"{where}: field '{prompt_field}' is a list, so token ids, but item {position} ({token!r}) is not a non-negative integer"
            )
    return value


def _answer(row: dict[str, Any], where: str, answer_field: str, answer_needed_by: Sequence[str]) -> str | None:
    answer = row.get(answer_field)
    if answer is not None and not isinstance(answer, str):
        answer = str(answer)
    if answer_needed_by and (answer is None or not answer.strip()):
        needs = ", ".join(answer_needed_by)
        state = "is empty" if answer is not None else f"is missing (fields: {', '.join(row) or 'none'})"
        raise DataError(f"{where}: the answer field '{answer_field}' {state}; the {needs} reward needs it (set --answer-field)")
    return answer


def check_prompt_lengths(dataset: Dataset, rollout: Any, tokenizer: Any, max_context: int | None, max_completion_tokens: int) -> None:
    """Measure every prompt as ``rollout`` will encode it; too long for ``max_context`` with
    ``max_completion_tokens`` is an error, or a counted skip when the rollout's
    ``long_prompts`` option is ``skip``.

    A rollout without an ``encode(tokenizer, prompt)`` method, or a model of unknown context,
    is not checked here. Pre-tokenized prompts are checked first (:func:`check_token_prompts`).
    """
    check_token_prompts(dataset, rollout, tokenizer)
    encode = declared(rollout, "rollout", "encode")
    if encode is None or max_context is None:
        return
    kept, long = [], []
    for prompt in dataset.prompts:
        tokens = len(encode(tokenizer, prompt))
        if tokens + max_completion_tokens <= max_context:
            kept.append(prompt)
        else:
            long.append(f"{dataset.where(prompt)}: {tokens} prompt tokens + {max_completion_tokens} completion tokens > {max_context}")
    if not long:
        return
    if declared(rollout, "rollout", "long_prompts") != "skip":
        more = f" (and {len(long) - 1} more)" if len(long) > 1 else ""
        raise DataError(
            f"{long[0]}, the model's context{more}: shorten the prompts, lower --max-completion-tokens, "
            "or pass --rollout-opt long_prompts=skip"
        )
    if not kept:
        raise DataError(f"{dataset.path}: every prompt is too long for the model's context of {max_context} tokens; first: {long[0]}")
    emptied = [name for name in dataset.mixture if not any(prompt.source == name for prompt in kept)]
    if emptied:
        raise DataError(f"--mix: every prompt of the source {emptied[0]} is too long for the model's context of {max_context} tokens")
    dataset.prompts = kept
    dataset.skipped_long_prompts = long
    _report_skips(long, f"prompts too long for the model's context ({dataset.path})", "long_prompts=skip")


def check_token_prompts(dataset: Dataset, rollout: Any, tokenizer: Any) -> None:
    """Pre-tokenized prompts go to a rollout that takes them, and hold only ids of the tokenizer's
    vocabulary; each is decoded for the rewards and loggers that read text (:attr:`Prompt.decoded`)."""
    tokenized = [prompt for prompt in dataset.prompts if prompt.tokens is not None]
    if not tokenized:
        return
    if not declared(rollout, "rollout", "token_prompts"):
        raise DataError(
            f"{dataset.path}: the prompts are token ids, which the {type(rollout).__name__} rollout does not take "
            "(it builds its prompts from text); use --rollout single_turn or text prompts"
        )
    vocabulary = len(tokenizer)
    for prompt in tokenized:
        outside = next(((i, t) for i, t in enumerate(prompt.tokens) if t >= vocabulary), None)
        if outside is not None:
            raise DataError(
                f"{dataset.where(prompt)}: token id {outside[1]} (item {outside[0]}) is outside the tokenizer's "
                f"vocabulary of {vocabulary} ids; were these rows tokenized for another model?"
            )
        prompt.decoded = tokenizer.decode(prompt.tokens)


def _report_skips(reasons: list[str], what: str, why: str) -> None:
    if reasons:
        shown = "; ".join(reasons[:SHOWN_SKIPS])
        print(f"skipped {len(reasons)} {what} ({why}); first: {shown}", file=sys.stderr)


def prompt_settings(config: RunConfig) -> dict[str, Any]:
    """How a run turned rows into prompt tokens, for an eval of its policy to do the same."""
    split = embedded_split(config.dataset)
    instance = provided("rollout", config.rollout)  # a rollout passed to grpo_core.run: its own values
    rollout_fields = option_fields(type(instance) if instance is not None else find(config.rollout, "rollout").load())
    rollout_options = {
        name: getattr(instance, name) if instance is not None else field.default
        for name, field in rollout_fields.items()
        if instance is not None or (field.default is not attrs.NOTHING and not isinstance(field.default, attrs.Factory))  # type: ignore[arg-type]
    }
    rollout_options.update(config.options_for("rollout", config.rollout))
    return {
        "dataset": " ".join(config.mix) if config.mix else dataset_name(config.dataset),
        "embedded_task": split is not None and not config.mix,
        "trained_from": config.model,
        "prompt_field": config.prompt_field,
        "answer_field": config.answer_field,
        "prompt_template": resolve_template(config),
        "rollout": config.rollout,
        "rollout_options": {k: v for k, v in rollout_options.items() if not is_secret(k, rollout_fields.get(k))},
        "stop": list(config.stop),
        "max_completion_tokens": config.max_completion_tokens,
    }


def write_prompt_settings(directory: str | Path, config: RunConfig) -> Path:
    """Write the run's prompt settings beside a policy (``final/``, each checkpoint)."""
    path = Path(directory) / PROMPT_SETTINGS_FILE
    path.write_text(json.dumps(prompt_settings(config), indent=2, default=str) + "\n")
    return path


def read_prompt_settings(model: str | Path) -> dict[str, Any] | None:
    """The prompt settings saved beside a policy, or None (a hub name, a model not trained here)."""
    path = Path(model) / PROMPT_SETTINGS_FILE
    if not path.is_file():
        return None
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: unreadable prompt settings ({exc}); delete the file or pass the prompt flags") from None
    if not isinstance(settings, dict):
        raise DataError(f"{path}: unreadable prompt settings (not a JSON object)")
    return settings


def prompt_batches(prompts: list[Prompt], batch_size: int, epochs: int, seed: int, shuffle: bool) -> Iterator[list[Prompt]]:
    """Full batches of prompts, reshuffled each epoch; a last partial batch is dropped."""
    rng = random.Random(seed)
    for _ in range(epochs):
        order = list(range(len(prompts)))
        if shuffle:
            rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield [prompts[i] for i in order[start : start + batch_size]]


def steps_available(num_prompts: int, batch_size: int, epochs: int) -> int:
    return (num_prompts // batch_size) * epochs
