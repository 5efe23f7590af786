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

import json
import logging
import os
import sys


def _limit_memory(megabytes: int) -> None:
    if megabytes <= 0:
        return
    try:
        import resource

        limit = megabytes * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):  # not on this platform: the time limit still holds
        pass


def check(gold_text: str, pred_text: str) -> dict[str, object]:
    from math_verify import parse, verify

    try:
        gold = parse(gold_text, parsing_timeout=None)
    except Exception:  # a reference that cannot be read is reported as such, not as a wrong answer
        gold = []
    if not gold:
        return {"gold": False, "ok": False}
    return {"gold": True, "ok": bool(verify(gold, parse(pred_text, parsing_timeout=None), timeout_seconds=None))}


def main(argv: list[str]) -> int:
    # The protocol gets its own copy of stdout; anything printed by libraries goes to stderr.
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    # "Timeout is disabled ...": the parent enforces the time limit.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    check("1", "1")  # finish the lazy imports (sympy, the LaTeX parser) before the first timed check
    _limit_memory(int(argv[1]) if len(argv) > 1 else 0)
    channel.write("ready\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        reply: dict[str, object] = {"id": request["id"]}
        try:
            reply.update(check(request["gold"], request["pred"]))
        except MemoryError:
            reply.update(gold=True, ok=False, error="MemoryError")
        except Exception as exc:  # what the model wrote cannot break the worker: a wrong answer
            reply.update(gold=True, ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
        channel.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
