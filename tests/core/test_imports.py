"""The architecture as tests: the modules of core/ import each other without a circle, and no
plugin or engine code; engine/ imports no plugin; remote/ imports no plugin and holds no hook;
plugins of one kind import another kind's only on a short allow-list; the docs list every kind and
module. Every import counts: at the top, under ``TYPE_CHECKING``, inside functions, and by name
(``importlib.import_module``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core"
ENGINE = ROOT / "engine"
REMOTE = ROOT / "remote"
PLUGINS = ROOT / "plugins"

BETWEEN_KINDS = {
    ("envs/retry_math.py", "grpo_core.plugins.rewards.gsm8k"): "the environment checks an answer by the gsm8k reward's own rule",
    ("envs/verifiers.py", "grpo_core.plugins.rollouts.multi_turn"): "the environment reads multi_turn's max_turns default",
}
"""The imports from one plugin kind into another that are allowed, each with its reason: a plugin
that needs a behaviour of another kind asks for it through a declared attribute (core/kinds.py)."""


def imports_of(path: Path, modules: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "grpo_core":
            parts = node.module.split(".")
            names = [parts[1]] if len(parts) > 1 else [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name.split(".")[1] for alias in node.names if alias.name.startswith("grpo_core.")]
        found.update(name for name in names if name in modules)
    return found - {path.stem}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_core_has_no_import_circle():
    modules = {p.stem for p in CORE.glob("*.py") if p.stem != "__init__"}
    graph = {name: imports_of(CORE / f"{name}.py", modules) for name in modules}
    assert circles(graph) == []
    # The contract and the data types import no loop.
    assert not graph["hookspecs"] & {"loop", "async_loop", "lifecycle", "stages"}
    assert graph["types"] == set() and graph["errors"] == set()
    # The two loops are siblings: only ``train`` chooses between them.
    assert "async_loop" not in graph["loop"] and "loop" not in graph["async_loop"]
    assert {name for name, imported in graph.items() if {"loop", "async_loop"} & imported} == {"train"}


def test_a_circle_is_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def imported_modules(source: str) -> set[str]:
    """Every module ``source`` imports, wherever the import stands, and every module it names to
    ``importlib.import_module``/``__import__``: ``from grpo_core import plugins`` counts as
    ``grpo_core.plugins``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if called in ("import_module", "__import__"):
                found.add(node.args[0].value)
    return found


def forbidden(folder: Path, packages: tuple[str, ...]) -> dict[str, list[str]]:
    """The modules under ``folder`` that import one of ``packages`` or a module in them, with what they import."""
    problems = {}
    for path in sorted(folder.rglob("*.py")):
        bad = sorted(m for m in imported_modules(path.read_text()) if any(m == p or m.startswith(p + ".") for p in packages))
        if bad:
            problems[str(path.relative_to(folder))] = bad
    return problems


def test_core_imports_no_plugin_and_no_engine():
    """Plugins and the engine build on the core: the core reaches plugins through hooks and entry points only."""
    assert forbidden(CORE, ("grpo_core.plugins", "grpo_core.engine")) == {}


def test_engine_imports_no_plugin():
    """The engine (in-process PyTorch code that plugins share) builds on the core only."""
    # The trainer and the logprobs among them: a check over a moved or empty folder would pass on nothing.
    assert {"trainer.py", "logprobs.py", "optim.py"} <= {p.name for p in ENGINE.glob("*.py")}
    assert forbidden(ENGINE, ("grpo_core.plugins",)) == {}


def test_remote_imports_no_plugin_and_declares_no_hook():
    """remote/ (code that talks to other processes) serves plugins of every kind: it imports none
    of them, and neither declares nor implements a hook."""
    assert {"server_client.py", "tinker_sdk.py", "vllm_worker.py"} <= {p.name for p in REMOTE.glob("*.py")}
    assert forbidden(REMOTE, ("grpo_core.plugins", "grpo_core.hookspecs", "pluggy")) == {}
    hooks = {
        str(path.relative_to(REMOTE)): name
        for path in sorted(REMOTE.rglob("*.py"))
        for name in ("hookimpl", "hookspec")
        if name in imported_names(path.read_text())
    }
    assert hooks == {}


def imported_names(source: str) -> set[str]:
    """The names ``source`` imports or reads as attributes (``grpo_core.hookimpl``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
    return found


def test_a_hook_in_remote_code_is_found():
    assert "hookimpl" in imported_names("from grpo_core import hookimpl")
    assert "hookimpl" in imported_names("import grpo_core\n\n@grpo_core.hookimpl\ndef reward(): pass")
    assert "hookimpl" not in imported_names("HOOKS = 'hookimpl'")


def imports_between_kinds(folder: Path) -> set[tuple[str, str]]:
    """(module, imported module) for every import in ``folder``/<kind>/ of a module of another kind."""
    found = set()
    for path in sorted(folder.glob("*/*.py")):
        kind = path.parent.name
        for module in imported_modules(path.read_text()):
            parts = module.split(".")
            if parts[:2] == ["grpo_core", "plugins"] and len(parts) > 2 and parts[2] != kind:
                found.add((str(path.relative_to(folder)), ".".join(parts[:4])))
    return found


def test_plugin_kinds_import_each_other_only_on_the_allow_list():
    found = imports_between_kinds(PLUGINS)
    assert found <= set(BETWEEN_KINDS), sorted(found - set(BETWEEN_KINDS))
    assert len(BETWEEN_KINDS) <= 3 and set(BETWEEN_KINDS) <= found  # no stale entry


def test_an_import_between_kinds_is_found(tmp_path):
    (tmp_path / "backends").mkdir()
    (tmp_path / "backends" / "b.py").write_text(
        "from grpo_core.plugins.backends.local import LocalBackend\n"
        "def f():\n    from grpo_core.plugins.losses.cispo import CISPOLoss\n"
        "from grpo_core.plugins import samplers\n"
    )
    assert imports_between_kinds(tmp_path) == {
        ("backends/b.py", "grpo_core.plugins.losses.cispo"),
        ("backends/b.py", "grpo_core.plugins.samplers"),
    }


def test_every_kind_of_import_is_found(tmp_path):
    (tmp_path / "m.py").write_text(
        """import importlib
from typing import TYPE_CHECKING

from grpo_core.plugins_manager import find  # a core module whose name starts the same

if TYPE_CHECKING:
    import grpo_core.engine.models


def f():
    from grpo_core.plugins.group_filters.zero_variance import ZeroVarianceFilter


def g():
    from grpo_core import plugins


def h():
    return importlib.import_module("grpo_core.plugins.backends.moe_routing")


DOC = "grpo_core.plugins.losses.cispo:CISPOLoss in a string is no import"
"""
    )
    assert forbidden(tmp_path, ("grpo_core.plugins", "grpo_core.engine")) == {
        "m.py": [
            "grpo_core.engine.models",
            "grpo_core.plugins",
            "grpo_core.plugins.backends.moe_routing",
            "grpo_core.plugins.group_filters.zero_variance",
            "grpo_core.plugins.group_filters.zero_variance.ZeroVarianceFilter",
        ]
    }


def test_the_docs_name_every_kind_and_contributing_every_module():
    """docs/concepts.md's table of kinds is KIND_TABLE's, and CONTRIBUTING's layout names every
    module of core/, engine/ and remote/ and every folder of plugins/."""
    import re

    from grpo_core.hookspecs import KIND_TABLE

    concepts = (ROOT / "docs" / "concepts.md").read_text().split("## Plugins")[1]
    rows = re.findall(r"^\| (\w+) \| (.*?) \| .* \|$", concepts, re.M)
    assert [kind for kind, _ in rows[1:]] == list(KIND_TABLE)
    for kind, hooks in rows[1:]:
        assert set(re.findall(r"`(\w+)`", hooks)) == set(KIND_TABLE[kind].hooks), kind
    layout = (ROOT / "CONTRIBUTING.md").read_text().split("## Layout")[1].split("\n## ")[0]
    modules = [f"{p.stem}.py" for folder in (CORE, ENGINE, REMOTE) for p in sorted(folder.glob("*.py")) if p.stem != "__init__"]
    assert [m for m in modules if f"`{m}`" not in layout] == []
    kinds = [p.name for p in sorted(PLUGINS.iterdir()) if (p / "__init__.py").is_file()]
    assert [k for k in kinds if f"`{k}/`" not in layout] == []
