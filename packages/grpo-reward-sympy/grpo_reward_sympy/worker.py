"""The sympy worker process: ``python -m grpo_reward_sympy.worker [memory_limit_mb]``.

Protocol: after importing sympy it writes ``ready``; then for each JSON line
``{"id": n, "pred": ..., "ref": ...}`` (sympy texts) on stdin it writes one JSON line
``{"id": n, "ok": true|false}`` (with ``"error"`` when the check failed). The parent kills it
when a check runs past its time limit and starts a fresh one. It exits at end of input.
"""

from __future__ import annotations

import json
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


def main(argv: list[str]) -> int:
    # The protocol gets its own copy of stdout; anything printed by libraries goes to stderr.
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    from grpo_reward_sympy.equivalence import equivalent_text

    equivalent_text("1", "1")  # finish sympy's lazy imports before the first timed check
    _limit_memory(int(argv[1]) if len(argv) > 1 else 0)
    channel.write("ready\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        reply: dict[str, object] = {"id": request["id"]}
        try:
            reply["ok"] = bool(equivalent_text(request["pred"], request["ref"]))
        except MemoryError:
            reply.update(ok=False, error="MemoryError")
        except Exception as exc:  # an unparsable or unsupported expression is a wrong answer
            reply.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
        channel.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
