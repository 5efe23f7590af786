"""Final answers (plain or LaTeX) to sympy syntax, in pure Python (no sympy import).

``to_sympy_text(r"2\\frac{\\sqrt{3}}{2}")`` gives ``"2((sqrt(3))/(2))"``, which sympy's
``parse_expr`` reads with implicit multiplication. The output uses only digits, operators,
parentheses, single-letter variables and a few known names, so evaluating it is safe; anything
else (prose, units, tuples, unsupported LaTeX) raises :class:`NotMath`.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["FUNCTIONS", "NotMath", "plain_number", "to_sympy_text"]


class NotMath(ValueError):
    """The text is not an expression this package can compare (prose, units, a list, ...)."""


FUNCTIONS = frozenset({"sqrt", "log", "ln", "exp", "sin", "cos", "tan", "sec", "csc", "cot", "asin", "acos", "atan", "abs", "pi", "oo"})
"""Multi-letter names allowed in an expression; every other name must be a single letter."""

_CMD_RE = re.compile(r"\\([A-Za-z]+|.)", re.DOTALL)
_FRACS = {"frac", "dfrac", "tfrac", "cfrac"}
_DROP_WITH_ARG = {"text", "textrm", "textit", "textbf", "textsf", "mbox", "hbox", "mathrm", "unit", "operatorname"}
_KEEP_ARG = {"mathbf", "mathit", "boldsymbol", "bm", "mathbb", "mathcal"}
_DROP = {
    "left",
    "right",
    "big",
    "Big",
    "bigg",
    "Bigg",
    "bigl",
    "bigr",
    "Bigl",
    "Bigr",
    "displaystyle",
    "textstyle",
    "quad",
    "qquad",
    ",",
    "!",
    ";",
    ":",
    " ",
    "%",
    "$",
    "circ",
    "degree",
}
_SIMPLE = {
    "cdot": "*",
    "times": "*",
    "ast": "*",
    "div": "/",
    "pi": " pi ",
    "infty": " oo ",
    "ln": " ln ",
    "log": " log ",
    "exp": " exp ",
    "sin": " sin ",
    "cos": " cos ",
    "tan": " tan ",
    "sec": " sec ",
    "csc": " csc ",
    "cot": " cot ",
    "arcsin": " asin ",
    "arccos": " acos ",
    "arctan": " atan ",
    "{": "(",
    "}": ")",
}
_UNICODE = str.maketrans({"−": "-", "×": "*", "÷": "/", "·": "*", "π": " pi ", "√": " sqrt ", "∞": " oo "})
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_ALLOWED_RE = re.compile(r"[0-9A-Za-z\s+\-*/^().]*")
_WORD_RE = re.compile(r"[A-Za-z]+")
_PLAIN_RE = re.compile(r"\s*(-?)\s*(\d+(?:\.\d+)?|\.\d+)(?:\s*/\s*(\d+(?:\.\d+)?))?\s*")


def _group_end(s: str, i: int) -> int:
    """Index of the ``}`` closing the ``{`` at ``s[i]``."""
    depth = 0
    for k in range(i, len(s)):
        if s[k] == "{":
            depth += 1
        elif s[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    raise NotMath("unbalanced braces")


def _arg(s: str, i: int) -> tuple[str, int]:
    """The converted argument starting at ``s[i]`` ({...}, a command, or one character)."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        raise NotMath("missing argument")
    if s[i] == "{":
        end = _group_end(s, i)
        return _convert(s[i + 1 : end]), end + 1
    if s[i] == "\\":
        m = _CMD_RE.match(s, i)
        assert m is not None
        return _convert(m.group()), m.end()
    return s[i], i + 1


def _raw_arg_end(s: str, i: int) -> int:
    while i < len(s) and s[i] == " ":
        i += 1
    if i < len(s) and s[i] == "{":
        return _group_end(s, i) + 1
    return i


def _convert(s: str) -> str:
    out: list[str] = []
    i = 0
    n = len(s)
    while i < n:
        c = s[i]
        if c == "\\":
            m = _CMD_RE.match(s, i)
            if m is None:
                raise NotMath("dangling backslash")
            name, i = m.group(1), m.end()
            if name in _FRACS:
                a, i = _arg(s, i)
                b, i = _arg(s, i)
                out.append(f"(({a})/({b}))")
            elif name == "sqrt":
                while i < n and s[i] == " ":
                    i += 1
                if i < n and s[i] == "[":
                    close = s.find("]", i)
                    if close < 0:
                        raise NotMath("unclosed root index")
                    index = _convert(s[i + 1 : close])
                    a, i = _arg(s, close + 1)
                    out.append(f"(({a})**(1/({index})))")
                else:
                    a, i = _arg(s, i)
                    out.append(f"sqrt({a})")
            elif name in _DROP_WITH_ARG:
                i = _raw_arg_end(s, i)
            elif name in _KEEP_ARG:
                a, i = _arg(s, i)
                out.append(f"({a})")
            elif name in _DROP:
                pass
            elif name in _SIMPLE:
                out.append(_SIMPLE[name])
            else:
                raise NotMath(f"unsupported LaTeX command \\{name}")
        elif c == "{":
            end = _group_end(s, i)
            out.append(f"({_convert(s[i + 1 : end])})")
            i = end + 1
        elif c == "}":
            raise NotMath("unbalanced braces")
        elif c == "^":
            a, i = _arg(s, i + 1)
            if a.strip():  # ^\circ (degrees) converts to nothing
                out.append(f"**({a})")
        elif c == "_":
            raise NotMath("subscripts are not supported")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def to_sympy_text(answer: str) -> str:
    """Convert a final answer (plain or LaTeX) to sympy syntax; raise :class:`NotMath`.

    ``x = 5`` keeps the right-hand side; ``1,000`` drops the separator; a trailing period,
    ``$`` delimiters, ``\\text{...}`` units, ``\\%`` and degrees are dropped.
    """
    s = answer.strip().translate(_UNICODE)
    s = s.replace("\\$", "").replace("$", "").replace("\\(", "").replace("\\)", "").replace("\\[", "").replace("\\]", "")
    s = s.strip().rstrip(".").strip()
    if "\\" in s or "{" in s or "^" in s or "_" in s:
        s = _convert(s)
    if "=" in s:
        s = s.rsplit("=", 1)[1]
    s = _THOUSANDS_RE.sub("", s).replace("%", "").strip().rstrip(".")
    if not s or _ALLOWED_RE.fullmatch(s) is None:
        raise NotMath(f"not an expression: {answer[:80]!r}")
    for word in _WORD_RE.findall(s):
        if len(word) > 1 and word not in FUNCTIONS:
            raise NotMath(f"not an expression (word {word!r}): {answer[:80]!r}")
    if s.count("(") != s.count(")"):
        raise NotMath(f"unbalanced parentheses: {answer[:80]!r}")
    return s.replace("^", "**")


def plain_number(text: str) -> Fraction | None:
    """The exact value of sympy text that is a plain number ("-3", "0.75", "3/4"), else None."""
    m = _PLAIN_RE.fullmatch(text)
    if m is None:
        return None
    try:
        value = Fraction(m.group(2))
        if m.group(3) is not None:
            den = Fraction(m.group(3))
            if den == 0:
                return None
            value /= den
    except (ValueError, ZeroDivisionError):
        return None
    return -value if m.group(1) else value
