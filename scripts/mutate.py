"""Mutation testing for the math and the data path: does a test notice a wrong line?

Each mutant changes one site of one source file (a comparison, an arithmetic or boolean
operator, a constant, a condition, a return value, min/max or sum/mean), is written over the
file in place, and the file's mapped tests run on it (``-x``, a timeout of a few times the
clean run). A mutant that no test fails on "survives": a line the tests would not notice if it
were wrong. The file is restored after each mutant and on any exit (Ctrl-C, SIGTERM); a
``.mutate-backup`` left by a killed run is put back at the next start.

Heavy imports (torch, transformers, pytest) are done once; each mutant's tests run in a
forked child, so a mutant costs its tests, not the interpreter start.

    python scripts/mutate.py plugins/losses/grpo.py core/stages.py:learning_rate
    python scripts/mutate.py --list plugins/samplers/local.py:_draw

``path:name,name`` limits a file to the functions (or classes) of those names. Not run in CI:
a full pass takes hours on 2 cores (CONTRIBUTING.md, "Mutation testing").
"""

from __future__ import annotations

import argparse
import ast
import copy
import glob
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parent.parent

# Source file -> its tests, the most specific first (``-x`` stops at the first failure).
TESTS: dict[str, list[str]] = {
    "core/loss.py": [
        "tests/core/test_loss.py",
        "tests/plugins/losses/test_grpo.py",
        "tests/plugins/losses/test_boundaries.py",
        "tests/core/test_loss_boundaries.py",
    ],
    "core/stages.py": [
        "tests/core/test_stages.py",
        "tests/core/test_reward_timeout.py",
        "tests/core/test_train_step.py::test_greedy_chunks",
        "tests/core/test_stages_*.py",
        "tests/core/test_config.py::test_learning_rate_warmup_then_decay",
        "tests/core/test_lr_schedule.py",
    ],
    "core/data.py": ["tests/core/test_data.py", "tests/core/test_data_*.py"],
    "core/options.py": ["tests/core/test_plugins_manager.py", "tests/core/test_plugins_manager_*.py"],
    "plugins/advantages/igpo.py": [
        "tests/plugins/advantages/test_igpo.py",
        "tests/core/test_stages_boundaries.py",
        "tests/plugins/advantages/test_boundaries.py",
    ],
    # The sampling rules (temperature, top-k, top-p, stop tokens and strings) are tested through the backend.
    "plugins/samplers/local.py": [
        "tests/plugins/backends/test_local.py::test_sampler_logprobs_follow_temperature_and_top_k",
        "tests/plugins/backends/test_local.py::test_finish_reason_is_stop_at_a_stop_token_and_length_at_max_tokens",
        "tests/plugins/backends/test_local.py::test_stop_strings_end_completions_and_are_reported_as_stop",
        "tests/plugins/samplers/test_local_*.py",
    ],
}
# plugins/<kind>/<name>.py -> tests/plugins/<kind>/test_<name>*.py, then the kind's shared files.
SHARED_TESTS = {
    "losses": ["tests/core/test_loss.py", "tests/plugins/losses/test_boundaries.py"],
    "advantages": ["tests/plugins/advantages/test_boundaries.py"],
    "rewards": ["tests/plugins/rewards/test_boundaries.py"],
}

# Tests that start the CLI in a subprocess (10-75 s each on 2 busy cores): too slow to run per
# mutant; the in-process tests beside them check the same values.
DESELECT = [
    "tests/core/test_data.py::test_run_stops_on_bad_rows_before_the_model_loads_or_skips_and_counts_them",
    "tests/core/test_data.py::test_a_hub_name_fails_clearly_offline",
    "tests/core/test_data.py::test_a_run_stops_on_a_bad_parquet_row_before_the_model_loads",
    "tests/core/test_data.py::test_single_turn_chat_template_counts_in_the_length_check",
    "tests/plugins/advantages/test_igpo.py::test_a_run_through_the_cli_scores_turns_and_trains",
]

COMPARE_SWAP = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
BINOP_SWAP = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
}
NAME_SWAP = {"min": "max", "max": "min"}
ATTR_SWAP = {
    "min": "max",
    "max": "min",
    "minimum": "maximum",
    "maximum": "minimum",
    "amin": "amax",
    "amax": "amin",
    "clamp_min": "clamp_max",
    "clamp_max": "clamp_min",
    "sum": "mean",
    "mean": "sum",
}


@attrs.frozen
class Mutant:
    path: str
    line: int
    col: int
    what: str
    source: str  # the whole mutated file


def tests_for(path: str) -> list[str]:
    patterns = TESTS.get(path)
    if patterns is None:
        parts = Path(path).parts
        if len(parts) != 3 or parts[0] != "plugins":
            raise SystemExit(f"no tests mapped for {path}: add it to TESTS in scripts/mutate.py")
        kind, name = parts[1], Path(parts[2]).stem
        patterns = [f"tests/plugins/{kind}/test_{name}.py", f"tests/plugins/{kind}/test_{name}_*.py", *SHARED_TESTS.get(kind, [])]
    found: list[str] = []
    for pattern in patterns:
        file, _, test = pattern.partition("::")
        for match in sorted(glob.glob(str(ROOT / file))) if any(c in file for c in "*?[") else [str(ROOT / file)]:
            rel = os.path.relpath(match, ROOT) + (f"::{test}" if test else "")
            if Path(match).exists() and rel not in found:
                found.append(rel)
    if not found:
        raise SystemExit(f"none of the tests mapped for {path} exist: {patterns}")
    return found


def skipped_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes never mutated: docstrings, annotations, f-strings, decorators, TYPE_CHECKING blocks."""
    skip: set[int] = set()

    def skip_all(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                skip_all(body[0])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            skip_all(node.returns)
            for d in node.decorator_list:
                skip_all(d)
            args = node.args
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if a is not None:
                    skip_all(a.annotation)
        elif isinstance(node, ast.ClassDef):
            for d in node.decorator_list:
                skip_all(d)
        elif isinstance(node, ast.AnnAssign):
            skip_all(node.annotation)
        elif isinstance(node, ast.JoinedStr):
            skip_all(node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            skip_all(node)
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skip_all(node)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            skip_all(node)  # attribute docstrings
    return skip


def enclosing_names(tree: ast.AST) -> dict[int, tuple[str, ...]]:
    names: dict[int, tuple[str, ...]] = {}

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = (*scope, node.name)
        names[id(node)] = scope
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, ())
    return names


def replacements(node: ast.AST) -> Iterator[tuple[ast.AST, ast.AST, str]]:
    """(node to replace, replacement, description) for one site."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            swap = COMPARE_SWAP.get(type(op))
            if swap:
                new = copy.deepcopy(node)
                new.ops[i] = swap()
                yield node, new, f"{type(op).__name__} -> {swap.__name__}"
    elif isinstance(node, ast.BinOp):
        swap = BINOP_SWAP.get(type(node.op))
        if swap:
            new = copy.deepcopy(node)
            new.op = swap()
            yield node, new, f"{type(node.op).__name__} -> {swap.__name__}"
    elif isinstance(node, ast.BoolOp):
        new = copy.deepcopy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield node, new, f"{type(node.op).__name__} -> {type(new.op).__name__}"
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        yield node, node.operand, f"drop {type(node.op).__name__}"
    elif isinstance(node, ast.Constant) and not isinstance(node.value, str):
        value = node.value
        if isinstance(value, bool):
            yield node, ast.Constant(not value), f"{value} -> {not value}"
        elif isinstance(value, int):
            yield node, ast.Constant(value + 1), f"{value} -> {value + 1}"
            if value == 1:
                yield node, ast.Constant(0), "1 -> 0"
        elif isinstance(value, float):
            new_value = 1.0 if value == 0.0 else value + 1.0
            yield node, ast.Constant(new_value), f"{value} -> {new_value}"
    elif isinstance(node, (ast.If, ast.While, ast.IfExp)):
        yield node.test, ast.UnaryOp(ast.Not(), node.test), "negate condition"
    elif isinstance(node, ast.Return) and node.value is not None and not isinstance(node.value, ast.Constant):
        yield node.value, ast.Constant(None), "return None"
    elif isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id in NAME_SWAP:
            yield func, ast.Name(NAME_SWAP[func.id], ast.Load()), f"{func.id} -> {NAME_SWAP[func.id]}"
        elif isinstance(func, ast.Attribute) and func.attr in ATTR_SWAP:
            new = copy.deepcopy(func)
            new.attr = ATTR_SWAP[func.attr]
            yield func, new, f".{func.attr} -> .{new.attr}"
    elif isinstance(node, ast.AugAssign):
        swap = BINOP_SWAP.get(type(node.op))
        if swap:
            yield node, ast.AugAssign(node.target, swap(), node.value), f"{type(node.op).__name__}= -> {swap.__name__}="


def splice(lines: list[bytes], old: ast.AST, new: ast.AST) -> str:
    """The file with ``old``'s span replaced by ``new`` (ast offsets are UTF-8 byte columns)."""
    start, end = old.lineno - 1, old.end_lineno - 1
    text = ast.unparse(new)
    if isinstance(old, ast.stmt):
        indent = lines[start][: old.col_offset]
        body = text.encode().replace(b"\n", b"\n" + indent)
    else:
        body = b"(" + text.encode() + b")"
    head = lines[start][: old.col_offset]
    tail = lines[end][old.end_col_offset :]
    return b"".join([*lines[:start], head + body + tail, *lines[end + 1 :]]).decode()


def mutants(path: str, only: set[str]) -> list[Mutant]:
    original = (ROOT / path).read_bytes()
    tree = ast.parse(original)
    lines = original.splitlines(keepends=True)
    skip = skipped_nodes(tree)
    scopes = enclosing_names(tree)
    seen: set[str] = set()
    found: list[Mutant] = []
    for node in ast.walk(tree):
        if id(node) in skip or (only and not only & set(scopes[id(node)])):
            continue
        for old, new, what in replacements(node):
            source = splice(lines, old, new)
            if source in seen or source.encode() == original:
                continue
            try:
                compile(source, path, "exec")
            except SyntaxError:
                continue
            seen.add(source)
            found.append(Mutant(path, old.lineno, old.col_offset, what, source))
    return sorted(found, key=lambda m: (m.line, m.col, m.what))


def run_tests(tests: list[str], timeout: float) -> str:
    """'killed', 'survived' or 'timeout': the tests' verdict on the file as it is on disk now."""
    import pytest

    pid = os.fork()
    if pid == 0:  # child: its own process group, so a timeout kills what it started too
        os.setpgid(0, 0)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        try:
            code = pytest.main(["-x", "-q", "-p", "no:cacheprovider", "-m", "not slow", *(f"--deselect={t}" for t in DESELECT), *tests])
        except BaseException:
            code = 3
        os._exit(int(code))
    deadline = time.monotonic() + timeout
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                pid = 0
                code = os.waitstatus_to_exitcode(status)
                return "survived" if code in (0, 5) else "killed"
            if time.monotonic() > deadline:
                return "timeout"
            time.sleep(0.05)
    finally:  # a timeout, Ctrl-C or SIGTERM: the child's tests must not run on past the restore
        if pid:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)


def restore_leftovers(paths: list[str]) -> None:
    for path in paths:
        backup = ROOT / (path + ".mutate-backup")
        if backup.exists():
            os.replace(backup, ROOT / path)
            print(f"restored {path} from a backup a killed run left", file=sys.stderr)


def earlier_verdicts(report: str | None) -> dict[tuple, str]:
    """Each mutant's verdict in an earlier report: tests are only ever added, so a kill stays a kill."""
    if report is None:
        return {}
    records = [json.loads(line) for line in Path(report).read_text().splitlines() if line.strip()]
    return {(r["path"], r["line"], r["col"], r["mutation"], r["code"]): r["verdict"] for r in records}


def mutate_file(
    path: str, only: set[str], report: Any, timeout_factor: float, before: dict[tuple, str], reported_only: bool
) -> dict[str, int]:
    target = ROOT / path
    backup = ROOT / (path + ".mutate-backup")
    tests = tests_for(path)
    original = target.read_bytes()
    lines = original.decode().splitlines()
    todo = mutants(path, only)
    keys = {m: (path, m.line, m.col, m.what, lines[m.line - 1].strip()) for m in todo}
    if reported_only:
        todo = [m for m in todo if keys[m] in before]
    timeout = 0.0  # no clean run when every mutant is already decided (or there is none)
    if any(before.get(keys[m], "survived") == "survived" for m in todo):
        started = time.monotonic()
        if run_tests(tests, 1800) != "survived":
            raise SystemExit(f"{path}: its tests {tests} fail on the unmutated file; fix them first")
        timeout = max(15.0, timeout_factor * (time.monotonic() - started))
    print(f"{path}: {len(todo)} mutants, tests {' '.join(tests)}, timeout {timeout:.0f} s", flush=True)
    counts = {"killed": 0, "survived": 0, "timeout": 0}
    backup.write_bytes(original)
    try:
        for mutant in todo:
            line = keys[mutant][4]
            if before.get(keys[mutant], "survived") != "survived":
                verdict = before[keys[mutant]]
            else:
                target.write_text(mutant.source)
                verdict = run_tests(tests, timeout)
                target.write_bytes(original)
            counts[verdict] += 1
            record = {"path": path, "line": mutant.line, "col": mutant.col, "mutation": mutant.what, "verdict": verdict, "code": line}
            report.write(json.dumps(record, ensure_ascii=False) + "\n")
            report.flush()
            if verdict != "killed":
                print(f"  {verdict}: {path}:{mutant.line} {mutant.what}   | {line}", flush=True)
    finally:
        target.write_bytes(original)
        backup.unlink()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="+", help="path[:name,name] relative to the repository root")
    parser.add_argument("--list", action="store_true", help="print the mutants and stop")
    parser.add_argument("--report", default="mutation-report.jsonl", help="one JSON line per mutant (appended)")
    parser.add_argument("--rerun", metavar="REPORT", help="run only the mutants that REPORT (an earlier run) did not kill")
    parser.add_argument("--reported-only", action="store_true", help="with --rerun: leave out the mutants REPORT does not list")
    parser.add_argument("--timeout-factor", type=float, default=4.0, help="timeout = this x the clean run's time")
    args = parser.parse_args()
    targets = [(t.split(":")[0], set(filter(None, t.split(":")[1].split(","))) if ":" in t else set()) for t in args.targets]
    restore_leftovers([path for path, _ in targets])
    if args.list:
        for path, only in targets:
            for m in mutants(path, only):
                line = (ROOT / path).read_text().splitlines()[m.line - 1].strip()
                print(f"{path}:{m.line}:{m.col} {m.what}   | {line}")
        return
    sys.dont_write_bytecode = True  # a mutant's bytecode must never be cached
    os.chdir(ROOT)
    import pytest  # noqa: F401  (loaded once, before the forks)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks that restore files
    before = earlier_verdicts(args.rerun)
    totals = {"killed": 0, "survived": 0, "timeout": 0}
    with open(args.report, "a") as report:
        for path, only in targets:
            counts = mutate_file(path, only, report, args.timeout_factor, before, args.reported_only)
            n = sum(counts.values())
            score = 100.0 * (counts["killed"] + counts["timeout"]) / n if n else 100.0
            print(
                f"{path}: {counts['killed']} killed, {counts['timeout']} timeout, {counts['survived']} survived of {n}: {score:.1f}%",
                flush=True,
            )
            for k in totals:
                totals[k] += counts[k]
    n = sum(totals.values())
    if n:
        score = 100.0 * (totals["killed"] + totals["timeout"]) / n
        print(f"total: {totals['killed']} killed, {totals['timeout']} timeout, {totals['survived']} survived of {n}: {score:.1f}%")


if __name__ == "__main__":
    main()
