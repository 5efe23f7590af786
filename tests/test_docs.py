"""The docs site builds with warnings as errors, and its reference pages follow the code."""

from __future__ import annotations

import html
import importlib.util
import json
import re
import shutil

import attrs
import pytest

from grpo_core import hookimpl, option
from grpo_core.plugins.loggers.console import ConsoleLogger
from tests.conftest import REPO
from tests.helpers import grpo_core_in_process


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site_dir = tmp_path_factory.mktemp("site")
    build_in_process(site_dir)  # strict: any warning aborts the build (test_a_broken_link_fails_the_build)
    return site_dir


def text_of(html_file) -> str:
    """A page's visible text, roughly: tags dropped, entities left."""
    return re.sub(r"<[^>]+>", "", html_file.read_text())


def test_every_page_of_the_nav_is_built(site):
    for page in ("index", "quickstart/index", "concepts/index", "reference/plugins/index", "reference/hooks/index",
                 "writing-plugins/index", "benchmarks/index", "losses/index", "async/index", "scaling-out/index",
                 "performance/index", "coming-from-cookbook/index"):  # fmt: skip
        assert (site / f"{page}.html").is_file(), page


def test_the_plugin_reference_shows_what_grpo_core_plugins_lists(site):
    listed = json.loads(grpo_core_in_process("plugins", "--json").stdout)
    built_in = [p for p in listed if p["distribution"] == "grpo-core"]
    page = (site / "reference" / "plugins" / "index.html").read_text()
    assert len(built_in) >= 20
    for plugin in built_in:
        section = page.split(f'id="{plugin["kind"]}-{plugin["name"]}"', 1)[1].split("<h3", 1)[0]
        for opt in plugin["options"]:
            row = section.split(f"<td><code>{opt['name']}</code></td>", 1)[1].split("</tr>", 1)[0]
            assert f"<code>{opt['default']!r}</code>" in html.unescape(row), (plugin["name"], opt)


def test_the_hooks_page_has_every_hook_with_its_parameters(site):
    from grpo_core import hookspecs

    text = text_of(site / "reference" / "hooks" / "index.html")
    for name in ("load_tokenizer", "make_trainer", "make_sampler", "make_reference", "weight_sync", "rollout", "reward",
                 "advantage", "loss", "on_run_start", "on_step", "on_run_end"):  # fmt: skip
        assert getattr(hookspecs, name).grpo_core_spec is not None
        assert f"def {name}(" in text
    assert "groups: the step's scored prompt groups" in text and "first result wins" in text


def test_links_to_repository_files_reach_pages_of_the_site(site):
    performance = (site / "performance" / "index.html").read_text()
    # ../benchmarks/README.md: the README of a folder is that folder's page.
    assert 'href="../repo/benchmarks/"' in performance
    readme = site / "repo" / "benchmarks" / "index.html"
    assert "What it measures" in text_of(readme)
    # A link from a repository file back into docs/ reaches the docs page.
    assert 'href="../../performance/"' in readme.read_text()
    # Any other file shows as its source.
    assert "def on_step(step: int" in html.unescape(text_of(site / "repo" / "core" / "hookspecs.py" / "index.html"))


def build_in_process(site_dir, docs_dir=None) -> None:
    from mkdocs.commands.build import build as build_site
    from mkdocs.config import load_config

    overrides = {"docs_dir": str(docs_dir)} if docs_dir else {}
    build_site(load_config(str(REPO / "mkdocs.yml"), site_dir=str(site_dir), strict=True, **overrides))


def test_a_broken_link_fails_the_build(tmp_path, caplog):
    from mkdocs.exceptions import Abort

    docs = tmp_path / "docs"
    shutil.copytree(REPO / "docs", docs)
    (docs / "quickstart.md").write_text((docs / "quickstart.md").read_text() + "\n[nowhere](no-such-page.md)\n")
    with pytest.raises(Abort, match="1 warnings in strict mode"):
        build_in_process(tmp_path / "site", docs)
    assert "contains a link 'no-such-page.md', but the target is not found" in caplog.text


@attrs.define
class ChangedConsole(ConsoleLogger):
    """The console logger as a later version might have it."""

    every: int = option(5, help="print a line every N steps off a terminal")
    color: bool = option(True, help="colored output")

    @hookimpl
    def on_step(self, step, metrics, state):
        pass


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_pages", REPO / "docs" / "gen_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def console_section(page: str) -> str:
    return page.split("### console {#logger-console}", 1)[1].split("\n### ", 1)[0]


def test_the_plugin_reference_changes_when_a_plugin_options_change(monkeypatch, tmp_path):
    import grpo_core.plugin_info
    from grpo_core.plugins_manager import catalog

    generator = load_generator()
    before = generator.plugin_reference()
    assert "| `every` | `1` | print a line every N steps when not on a terminal |" in console_section(before)
    entries = tuple(attrs.evolve(e, target=f"{__name__}:ChangedConsole") if e.qualified_name == "logger.console" else e for e in catalog())
    monkeypatch.setattr(grpo_core.plugin_info, "catalog", lambda: entries)
    after = generator.plugin_reference()
    section = console_section(after)
    assert "| `every` | `5` | print a line every N steps off a terminal |" in section
    assert "| `color` | `True` | colored output |" in section
    assert "The console logger as a later version might have it." in section
    assert before.replace(console_section(before), section) == after  # nothing else changed
    # And so does the page of the site built from it.
    build_in_process(tmp_path / "site")
    page = (tmp_path / "site" / "reference" / "plugins" / "index.html").read_text()
    assert "<td><code>color</code></td>" in page and "print a line every N steps off a terminal" in page
