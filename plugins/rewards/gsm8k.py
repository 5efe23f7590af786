"""GSM8K-style exact-answer reward: the completion's final number against the reference.

:func:`score`, :func:`extract_answer`, :func:`find_answer` and :func:`parse_reference` are
plain functions on strings, for other rewards (e.g. ``grpo-reward-sympy``) to reuse.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import NamedTuple

import attrs

from grpo_core import Prompt, Sample, hookimpl, option

__all__ = ["BOX_HEADS", "GSM8KReward", "Marker", "boxed_spans", "extract_answer", "find_answer", "parse_reference", "score"]

# --------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------

# A number as policies write it: optional sign, currency sign, thousands separators, decimals,
# a simple fraction (3/4). Never starts inside a word or number: "x2" holds no number, and in
# "16-3" the "-" is a minus, so the numbers are 16 and 3. Percent and units after it are ignored.
_NUM = (
    r"(?=[-−+$€£.\d])"  # cheap first-character check (makes the scan ~2x faster)
    r"(?<![\w.])"
    r"[-−+]?"  # sign, attached: "20 - 2" is a subtraction, not -2
    r"(?:[$€£]\s?)?"  # currency
    r"[-−]?"  # sign after the currency: $-5
    r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"  # 1,000 / 1000 / 12.50 / .5
    r"(?:\s?/\s?\d+(?:\.\d+)?)?"  # / denominator
)
_NUM_RE = re.compile(_NUM)

# Characters dropped before a number is converted (currency, separators, spaces, percent).
_DROP = str.maketrans({"$": None, "€": None, "£": None, ",": None, " ": None, "\t": None, "\n": None, "%": None, "−": "-"})


def _to_value(raw: str) -> Fraction | None:
    """The exact value of a number as matched by ``_NUM`` (None when it has none, e.g. 1/0)."""
    s = raw.translate(_DROP)
    neg = False
    while s[:1] in ("-", "+"):
        neg ^= s[0] == "-"
        s = s[1:]
    try:
        if "/" in s:
            num, _, den = s.partition("/")
            d = Fraction(den)
            if d == 0:
                return None
            value = Fraction(num) / d
        else:
            value = Fraction(s)
    except (ValueError, ZeroDivisionError):  # includes ints over Python's digit limit
        return None
    return -value if neg else value


def _canonical(raw: str) -> tuple[str, Fraction] | None:
    """A number's normalized text and exact value: "$1,000.00" -> ("1000", 1000)."""
    value = _to_value(raw)
    if value is None:
        return None
    if value.denominator == 1:
        return str(value.numerator), value
    s = raw.translate(_DROP).lstrip("+-")
    if "/" in s:
        return str(value), value  # "6/8" -> "3/4"
    s = s.rstrip("0").rstrip(".") if "." in s else s
    return ("-" if value < 0 else "") + ("0" + s if s.startswith(".") else s), value


# --------------------------------------------------------------------------------------------
# Answer markers
# --------------------------------------------------------------------------------------------

# What may stand between a marker and its number: spaces, markdown emphasis, a colon, quotes,
# opening math delimiters ($, \(, \[).
_FILL = r"[\s*_:\"'`(\[\\$]*"
_THEN_NUM = _FILL + r"(" + _NUM + r")"
# Each marker regex starts with a literal so the scan is a fast substring search. "answer"
# markers are searched in the lower-cased text ("The answer is", "Final Answer:", "**Answer:**").
_HASH_RE = re.compile(r"####" + _THEN_NUM)
_ANSWER_RE = re.compile(r"answer(?:\s+is\b|[ \t]*(?:\*\*|__)?[ \t]*:)" + _THEN_NUM)
_ANSWER_RE_I = re.compile(_ANSWER_RE.pattern, re.IGNORECASE)
_A_RE = re.compile(r"A[ \t]*:" + _THEN_NUM)  # "A: 18", only at the start of a line
_TAG_RE = re.compile(r"<answer>(.*?)(?:</answer>|\Z)", re.DOTALL)
_TAG_RE_I = re.compile(_TAG_RE.pattern, re.DOTALL | re.IGNORECASE)
BOX_HEADS = ("\\boxed", "\\fbox")
_FRAC_RE = re.compile(r"\\[dtc]?frac\s*\{\s*([^{}]*?)\s*\}\s*\{\s*([^{}]*?)\s*\}")
_LATEX_FIXES = (("\\$", "$"), ("\\%", "%"), ("{,}", ","), ("\\!", ""), ("\\,", ""), ("−", "-"))
_FALLBACK_WINDOW = 256
"""The last-number fallback first scans this many characters before the text's last digit."""


class Marker(NamedTuple):
    """The explicit answer marker that decides a completion's final answer."""

    kind: str
    """"hash" (#### N), "line" (The answer is N, Answer: N, A: N), "boxed" or "tag"."""
    start: int
    """Where the marker starts in the (LaTeX-normalized) completion."""
    answer: str
    """The normalized number: "1000", "-5", "3/4", "0.75"."""
    value: Fraction


def _normalize_text(text: str) -> str:
    if "\\" in text or "{," in text or "−" in text:
        for old, new in _LATEX_FIXES:
            if old in text:
                text = text.replace(old, new)
        if "frac" in text:
            text = _FRAC_RE.sub(r"\1/\2", text)
    return text


def _last_number(text: str) -> tuple[str, Fraction] | None:
    last = max(text.rfind(d) for d in "0123456789")
    if last < 0:
        return None
    # Fast path: the number around the last digit; the lookbehind still sees text before pos.
    matches = _NUM_RE.findall(text, max(0, last - _FALLBACK_WINDOW))
    for m in reversed(matches):
        found = _canonical(m)
        if found is not None:
            return found
    if last < _FALLBACK_WINDOW:
        return None
    for m in reversed(_NUM_RE.findall(text)):  # the whole text: a number running into the window is read whole
        found = _canonical(m)
        if found is not None:
            return found
    return None


def boxed_spans(text: str) -> list[tuple[int, str]]:
    """(start, content) of every \\boxed{...} / \\fbox{...}, nested braces matched."""
    spans = []
    for head in BOX_HEADS:
        i = text.find(head)
        while i != -1:
            j = i + len(head)
            while j < len(text) and text[j] == " ":
                j += 1
            if j < len(text) and text[j] == "{":
                depth, k = 0, j
                while k < len(text):
                    ch = text[k]
                    if ch == "{":
                        depth += 1
                    elif ch == "}":
                        depth -= 1
                        if depth == 0:
                            break
                    k += 1
                if depth == 0:
                    spans.append((i, text[j + 1 : k]))
            i = text.find(head, j)
    return spans


def find_answer(completion: str) -> Marker | None:
    """The last explicit answer marker of ``completion`` that carries a number, or None.

    Markers: ``#### N``, ``The answer is N``, ``Answer: N``, ``A: N`` (line start),
    ``\\boxed{N}`` and ``<answer>N</answer>``. The number right after a line marker is the
    answer (numbers after it do not count); inside a box or tag the last number is.
    """
    return _find(_normalize_text(completion))


def _at_line_start(text: str, i: int) -> bool:
    return not text[text.rfind("\n", 0, i) + 1 : i].strip(" \t*")


def _find(text: str) -> Marker | None:
    best: Marker | None = None

    def consider(kind: str, start: int, found: tuple[str, Fraction] | None) -> None:
        nonlocal best
        if found is not None and (best is None or start > best.start):
            best = Marker(kind, start, found[0], found[1])

    low = text.lower()
    same = len(low) == len(text)  # lower() keeps positions (not for a few exotic letters)
    if "####" in text:
        for m in _HASH_RE.finditer(text):
            consider("hash", m.start(), _canonical(m.group(1)))
    for m in _ANSWER_RE.finditer(low) if same else _ANSWER_RE_I.finditer(text):
        consider("line", m.start(), _canonical(m.group(1)))
    if "A" in text:
        for m in _A_RE.finditer(text):
            if _at_line_start(text, m.start()):
                consider("line", m.start(), _canonical(m.group(1)))
    if "<" in text:
        for m in _TAG_RE.finditer(low) if same else _TAG_RE_I.finditer(text):
            if best is None or m.start() > best.start:
                consider("tag", m.start(), _last_number(text[m.start(1) : m.end(1)]))
    if "\\" in text:
        for start, content in boxed_spans(text):
            if best is None or start > best.start:
                consider("boxed", start, _last_number(content))
    return best


def _analyze(completion: str, strict: bool) -> tuple[Fraction | None, str | None, Marker | None, str]:
    """(value, normalized answer, deciding marker, LaTeX-normalized text)."""
    text = _normalize_text(completion)
    marker = _find(text)
    if marker is not None:
        return marker.value, marker.answer, marker, text
    found = None if strict else _last_number(text)
    if found is None:
        return None, None, None, text
    return found[1], found[0], None, text


def extract_answer(completion: str, strict: bool = False) -> str | None:
    """The completion's final answer as a normalized number string, or None.

    The last explicit marker wins (see :func:`find_answer`); without one, the last number in
    the text, unless ``strict``. Normalized: "$1,000.00" -> "1000", "-$5" -> "-5",
    "25%" -> "25", "18 dollars" -> "18", "0.750" -> "0.75", "3/4" stays "3/4".
    """
    return _analyze(completion, strict)[1]


def _reference(reference: str) -> tuple[str, Fraction]:
    if "####" in reference:
        m = _NUM_RE.search(_normalize_text(reference.rsplit("####", 1)[-1]))
        found = _canonical(m.group()) if m else None
    else:
        _, answer, _, _ = _analyze(reference, strict=False)
        found = _canonical(answer) if answer is not None else None
    if found is None:
        raise ValueError(f"reference answer has no number: {reference[-80:]!r}")
    return found


def parse_reference(reference: str) -> str:
    """The normalized number of a reference answer: a GSM8K answer field (the number after its
    last "####") or a bare number ("18", "$1,000", "3/4"; other text is read like a completion).

    Raises ValueError when there is no number to compare against.
    """
    return _reference(reference)[0]


def score(completion: str, reference: str, strict: bool = False) -> float:
    """1.0 when the completion's final answer equals the reference by value, else 0.0.

    ``0.75`` equals ``3/4`` and ``18.00`` equals ``18`` (exact fractions, no float rounding).
    """
    value = _analyze(completion, strict)[0]
    return 1.0 if value is not None and value == _reference(reference)[1] else 0.0


# --------------------------------------------------------------------------------------------
# Plugin
# --------------------------------------------------------------------------------------------


def _non_negative(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0 (it is a magnitude), got {value}")


@attrs.define
class GSM8KReward:
    """Exact-answer reward for GSM8K-style math: 1.0 if the final number equals the reference.

    The final answer is the number after the last explicit marker -- "#### 18", "The answer
    is 18", "Answer: 18", "A: 18", \\boxed{18}, <answer>18</answer> -- or, without a marker,
    the last number in the completion (strict=true: no marker scores 0). Numbers compare by
    exact value after normalizing $, €, £, 1,000, 25%, 18.00, units ("18 dollars"), negatives,
    fractions and decimals (3/4 == 0.75). The reference is the prompt's answer: a GSM8K
    answer field ending in "#### N" or a bare number; a prompt without one is an error.

    Format shaping, both 0 by default and both non-negative, applied whether or not the
    answer is right: reward = correctness + format_bonus if the completion has a "#### N"
    line, - format_penalty if it has no explicit answer marker at all.

    ``needs_answer = True``: every prompt must carry a reference answer (the data loader
    checks this before training starts).
    """

    needs_answer = True

    strict: bool = option(False, help="require an explicit answer marker; no last-number fallback")
    format_bonus: float = option(0.0, help='added when the completion contains a "#### N" answer line', validator=_non_negative)
    format_penalty: float = option(0.0, help="subtracted when the completion has no explicit answer marker", validator=_non_negative)

    def _score_one(self, completion: str, reference: Fraction) -> float:
        value, _, marker, text = _analyze(completion, self.strict)
        total = 1.0 if value is not None and value == reference else 0.0
        if self.format_bonus and _HASH_RE.search(text):
            total += self.format_bonus
        if self.format_penalty and marker is None:
            total -= self.format_penalty
        return total

    @hookimpl
    def reward(self, prompt: Prompt, samples: Sequence[Sample]) -> list[float | None]:
        if prompt.answer is None or not str(prompt.answer).strip():
            raise ValueError(
                f"gsm8k reward: prompt {prompt.id!r} has no reference answer; "
                "give every dataset row an 'answer' (e.g. a GSM8K answer ending in '#### N')"
            )
        try:
            reference = _reference(str(prompt.answer))[1]
        except ValueError as exc:
            raise ValueError(f"gsm8k reward: prompt {prompt.id!r}: {exc}") from None
        return [self._score_one(sample.text, reference) for sample in samples]
