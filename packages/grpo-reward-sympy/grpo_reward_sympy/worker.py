"""The sympy worker process: ``python -m grpo_reward_sympy.worker [memory_limit_mb]``.

Protocol: after importing sympy it writes ``ready``; then for each JSON line
``{"id": n, "pred": ..., "ref": ...}`` (sympy texts) on stdin it writes one JSON line
``{"id": n, "ok": true|false}`` (with ``"error"`` when the check failed). The parent kills it
when a check runs past its time limit and starts a fresh one. It exits at end of input.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from grpo_core.subprocess_worker import serve


def _load() -> Callable[[dict[str, Any]], dict[str, bool]]:
    from grpo_reward_sympy.equivalence import equivalent_text

    equivalent_text("1", "1")  # finish sympy's lazy imports before the first timed check
    return lambda request: {"ok": bool(equivalent_text(request["pred"], request["ref"]))}


def main(argv: list[str]) -> int:
    # An unparsable or unsupported expression is a wrong answer.
    return serve(_load, memory_limit_mb=int(argv[1]) if len(argv) > 1 else 0, failure={"ok": False})


if __name__ == "__main__":
    sys.exit(main(sys.argv))
