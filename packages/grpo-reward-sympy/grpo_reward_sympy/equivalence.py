"""Symbolic equivalence with sympy. No time limit here: the reward runs this in a worker process."""

from __future__ import annotations

import string
from functools import lru_cache

import sympy
from sympy.parsing.sympy_parser import (
    implicit_multiplication_application,
    parse_expr,
    rationalize,
    standard_transformations,
)

from grpo_reward_sympy.parse import NotMath, to_sympy_text

__all__ = ["equivalent_text", "is_equivalent", "parse"]

_TRANSFORMS = standard_transformations + (implicit_multiplication_application, rationalize)
# Every name an expression may use (to_sympy_text allows nothing else): single letters are
# variables, except e (Euler's number) and i (the imaginary unit).
_NAMES: dict[str, object] = {c: sympy.Symbol(c) for c in string.ascii_letters}
_NAMES.update(
    e=sympy.E,
    i=sympy.I,
    pi=sympy.pi,
    oo=sympy.oo,
    sqrt=sympy.sqrt,
    log=sympy.log,
    ln=sympy.log,
    exp=sympy.exp,
    sin=sympy.sin,
    cos=sympy.cos,
    tan=sympy.tan,
    sec=sympy.sec,
    csc=sympy.csc,
    cot=sympy.cot,
    asin=sympy.asin,
    acos=sympy.acos,
    atan=sympy.atan,
    abs=sympy.Abs,
)


@lru_cache(maxsize=4096)
def parse(text: str) -> sympy.Expr:
    """Parse sympy text made by :func:`grpo_reward_sympy.parse.to_sympy_text`."""
    expr = parse_expr(text, local_dict=dict(_NAMES), transformations=_TRANSFORMS, evaluate=True)
    if not isinstance(expr, sympy.Expr):
        raise NotMath(f"not an expression: {text!r}")
    return expr


@lru_cache(maxsize=4096)
def equivalent_text(pred: str, ref: str) -> bool:
    """Whether two sympy texts denote the same value (exact: 0.5 == 1/2, 2*x+1 == 1+2x)."""
    a, b = parse(pred), parse(ref)
    if a == b:
        return True
    if a.has(sympy.zoo, sympy.nan) or b.has(sympy.zoo, sympy.nan):
        return False
    diff = sympy.simplify(a - b)
    if diff == 0:
        return True
    return a.equals(b) is True


def is_equivalent(pred: str, ref: str) -> bool:
    """Whether two final answers (plain or LaTeX) are symbolically equal; False if unparsable."""
    try:
        return equivalent_text(to_sympy_text(pred), to_sympy_text(ref))
    except (NotMath, SyntaxError, TypeError, ValueError, ZeroDivisionError, sympy.SympifyError):
        return False
