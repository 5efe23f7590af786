"""The Math-Verify worker process: ``python -m grpo_reward_math_verify.worker [memory_limit_mb]``.

Math-Verify's own time limits use SIGALRM, which works only in a process's main thread (a
reward runs in a worker thread of the run: Math-Verify#50, #55). Here every check runs with
those limits off, in the main thread of a process of its own, and the parent kills the process
when a check runs past its time limit.

Protocol: after importing math-verify it writes ``ready``; then for each JSON line
``{"id": n, "gold": text, "pred": text}`` on stdin it writes one JSON line
``{"id": n, "gold": true|false, "ok": true|false}`` (``gold``: the reference parsed to something;
``error`` when a check raised). It exits at end of input.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from grpo_core.subprocess_worker import serve


def check(gold_text: str, pred_text: str) -> dict[str, object]:
    from math_verify import parse, verify

    try:
        gold = parse(gold_text, parsing_timeout=None)
    except Exception:  # a reference that cannot be read is reported as such, not as a wrong answer
        gold = []
    if not gold:
        return {"gold": False, "ok": False}
    return {"gold": True, "ok": bool(verify(gold, parse(pred_text, parsing_timeout=None), timeout_seconds=None))}


def _load() -> Callable[[dict[str, Any]], dict[str, object]]:
    # "Timeout is disabled ...": the parent enforces the time limit.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    check("1", "1")  # finish the lazy imports (sympy, the LaTeX parser) before the first timed check
    return lambda request: check(request["gold"], request["pred"])


def main(argv: list[str]) -> int:
    # What the model wrote cannot break the worker: a wrong answer.
    return serve(_load, memory_limit_mb=int(argv[1]) if len(argv) > 1 else 0, failure={"gold": True, "ok": False})


if __name__ == "__main__":
    sys.exit(main(sys.argv))
