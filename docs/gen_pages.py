"""The mkdocs hook (``hooks:`` in mkdocs.yml) that writes the pages made from the code.

- ``reference/plugins.md``: every built-in plugin with its help and options, from
  ``grpo_core.plugin_info.describe_all()``, the records ``grpo-core plugins`` prints.
- ``reference/hooks.md``: every hook of ``core/hookspecs.py``, its signature and docstring.
- ``repo/<path>``: a repository file outside docs/ that a page links to (``../benchmarks/README.md``),
  a Markdown file as a page and any other file as its source, so such links work on the site and
  a strict build checks them. Links between pages are rewritten to match.

Nothing is written into docs/: the pages exist only in the build.
"""

from __future__ import annotations

import html
import inspect
import posixpath
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MIRROR = "repo/"
"""Where the site shows repository files that live outside docs/."""
LINK = re.compile(r"(\]\()([^)\s]+)(\))")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
FENCE = re.compile(r"^\s*(```|~~~)")
KIND_TITLES = {
    "backend": "Backends (trainers)",
    "sampler": "Samplers",
    "weight_sync": "Weight sync",
    "rollout": "Rollouts",
    "env": "Environments",
    "tool": "Tools",
    "reward": "Rewards",
    "advantage": "Advantages",
    "group_filter": "Group filters",
    "loss": "Losses",
    "logger": "Loggers",
}
BUILT_IN = "grpo-core"


# ----- the plugin reference -------------------------------------------------------------------


def plugin_reference(infos: list[dict[str, Any]] | None = None) -> str:
    """The plugin reference page of ``infos`` (default: the installed built-ins, as ``grpo-core plugins`` lists them)."""
    from grpo_core.hookspecs import KIND_TABLE

    if infos is None:
        from grpo_core.plugin_info import describe_all

        infos = [info for info in describe_all() if info["distribution"] == BUILT_IN]
    lines = [
        "# Plugin reference",
        "",
        "Every built-in plugin, its help and its options, generated from the plugins themselves when the",
        "site is built: the same records `grpo-core plugins` prints (`grpo-core plugins --json` for a",
        "program). Select a plugin with `--KIND NAME` and set an option with `--KIND-opt key=value`,",
        "or in a `[KIND.NAME]` table of a TOML config.",
        "",
    ]
    for kind in KIND_TABLE:
        title = KIND_TITLES.get(kind, kind)  # a kind added to the core is listed even before it has a title
        of_kind = [info for info in infos if info["kind"] == kind]
        if not of_kind:
            continue
        flag = kind.replace("_", "-")
        lines += [f"## {title}", "", ", ".join(f"[`{info['name']}`](#{kind}-{info['name']})" for info in of_kind), ""]
        for info in of_kind:
            lines += _plugin_section(info, flag)
    return "\n".join(lines) + "\n"


def _plugin_section(info: dict[str, Any], flag: str) -> list[str]:
    lines = [f"### {info['name']} {{#{info['kind']}-{info['name']}}}", ""]
    lines += [f"`--{flag} {info['name']}` · hooks: {', '.join(f'`{h}`' for h in info.get('hooks', [])) or 'none'} · `{info['target']}`", ""]
    if "error" in info:
        return [*lines, f'!!! failure "does not import"\n    {_text(info["error"])}', ""]
    for paragraph in info["help"].split("\n\n"):
        lines += [_text(paragraph), ""]
    if not info["options"]:
        return [*lines, "No options.", ""]
    lines += ["| option | default | what it sets |", "|---|---|---|"]
    for option in info["options"]:
        secret = " Secret: never written to config.json; `env:NAME` reads a variable." if option["secret"] else ""
        lines.append(f"| `{option['name']}` | `{_cell(repr(option['default']))}` | {_cell(_text(option['help']))}{secret} |")
    return [*lines, ""]


def _text(text: str) -> str:
    """Help text as Markdown: backtick spans kept, ``<run_dir>`` and the like shown, not taken for HTML."""
    parts = re.split(r"(`[^`]*`)", text.replace("\n", " ").strip())
    return "".join(part if part.startswith("`") else html.escape(part, quote=False) for part in parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


# ----- the hook reference ---------------------------------------------------------------------


def hook_reference() -> str:
    """The hooks page: core/hookspecs.py's module docstring, then each hook's signature and docstring."""
    from grpo_core import hookspecs
    from grpo_core.hookspecs import KIND_TABLE, PROJECT

    kinds_of = {
        hook: [kind for kind, spec in KIND_TABLE.items() if hook in spec.hooks] for spec in KIND_TABLE.values() for hook in spec.hooks
    }
    lines = [
        "# Hooks",
        "",
        "Generated from [`core/hookspecs.py`](../../core/hookspecs.py), the contract between the core and every plugin.",
        "",
    ]
    lines += [_rest(inspect.getdoc(hookspecs) or ""), ""]
    specs = [(f, getattr(f, f"{PROJECT}_spec", None)) for _, f in inspect.getmembers(hookspecs, inspect.isfunction)]
    # In the file's order, which is the loop's.
    for function, spec in sorted(((f, s) for f, s in specs if s is not None), key=lambda fs: fs[0].__code__.co_firstlineno):
        name = function.__name__
        first = "first result wins" if spec.get("firstresult") else "every implementation is called"
        kinds = ", ".join(f"`{k}`" for k in kinds_of.get(name, [])) or "any"
        lines += [f"## {name}", "", f"Implemented by plugins of kind {kinds}; {first}.", ""]
        lines += ["```python", f"def {name}{_signature(function)}", "```", ""]
        lines += [_rest(inspect.getdoc(function) or ""), ""]
    return "\n".join(lines) + "\n"


def _signature(function: Any) -> str:
    """The signature as written (the module's annotations are strings: no quotes around them)."""
    signature = inspect.signature(function)
    params = ", ".join(f"{p.name}: {p.annotation}" if p.annotation is not p.empty else p.name for p in signature.parameters.values())
    returns = "" if signature.return_annotation is signature.empty else f" -> {signature.return_annotation}"
    return f"({params}){returns}"


def _rest(doc: str) -> str:
    """reStructuredText field lists and roles as Markdown."""
    doc = re.sub(r":(?:class|func|meth):`~?([^`]+)`", r"`\1`", doc).replace("``", "`")
    doc = re.sub(r"^:param (\w+):", r"- `\1`:", doc, flags=re.MULTILINE)
    doc = re.sub(r"^:returns?:", "- returns:", doc, flags=re.MULTILINE)
    # A field's continuation lines are indented; as Markdown they continue the list item.
    doc = re.sub(r"^( +)(?=\S)", "  ", doc, flags=re.MULTILINE)
    # Markdown starts a list only after a blank line.
    return re.sub(r"^((?!- |  )\S.*)\n(?=- )", r"\1\n\n", doc, flags=re.MULTILINE)


# ----- repository files the pages link to -----------------------------------------------------


def source_path(src_uri: str) -> str:
    """The repository path of a page of the site (``losses.md`` -> ``docs/losses.md``)."""
    if src_uri.startswith(MIRROR):
        path = src_uri[len(MIRROR) :]
        return path if path.endswith(".md") and (REPO / path).is_file() else path.removesuffix(".md")
    return "docs/" + src_uri


def mirror_uri(repo_path: str) -> str | None:
    """The page that shows a repository file outside docs/, or None when there is no such file."""
    target = REPO / repo_path
    if target.is_dir():
        repo_path = posixpath.join(repo_path, "README.md")
        target = REPO / repo_path
    if not target.is_file() or repo_path.startswith("../"):
        return None
    return MIRROR + (repo_path if repo_path.endswith(".md") else repo_path + ".md")


def page_uri(repo_path: str) -> str | None:
    """The page a link to ``repo_path`` should reach: a docs page, or a mirror of the file."""
    if repo_path.startswith("docs/"):
        return repo_path[len("docs/") :]
    return mirror_uri(repo_path)


def relative_links(markdown: str) -> list[tuple[int, int, str, str]]:
    """``(start, end, path, anchor)`` of each relative link outside code: what may need a rewrite."""
    found, offset, in_code = [], 0, False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code:
            for match in LINK.finditer(line):
                target = match.group(2)
                if SCHEME.match(target) or target.startswith(("#", "/")):
                    continue
                path, _, anchor = target.partition("#")
                found.append((offset + match.start(2), offset + match.end(2), path, anchor))
        offset += len(line)
    return found


def resolve(src_uri: str, link: str) -> str:
    return posixpath.normpath(posixpath.join(posixpath.dirname(source_path(src_uri)), link))


def mirror_contents(uri: str) -> str:
    repo_path = source_path(uri)
    text = (REPO / repo_path).read_text(encoding="utf-8")
    if repo_path.endswith(".md"):
        return text
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall("`{3,}", text)), default=0))
    language = {".py": "python", ".toml": "toml", ".yml": "yaml", ".yaml": "yaml", ".json": "json", ".sh": "bash"}.get(
        Path(repo_path).suffix, ""
    )
    return f"# {repo_path}\n\n{fence}{language}\n{text}\n{fence}\n"


# ----- the mkdocs events ----------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File, InclusionLevel

    for uri, content in (("reference/plugins.md", plugin_reference()), ("reference/hooks.md", hook_reference())):
        files.append(File.generated(config, uri, content=content))
    # The repository files the pages link to, and those they link to in turn.
    pending = [(f.src_uri, f.content_string) for f in files.documentation_pages()]
    while pending:
        src_uri, markdown = pending.pop()
        for _, _, path, _ in relative_links(markdown):
            repo_path = resolve(src_uri, path) if path else None
            uri = mirror_uri(repo_path) if repo_path and not repo_path.startswith("docs/") else None
            if uri and files.get_file_from_path(uri) is None:
                content = mirror_contents(uri)
                # Reached by links, not listed in the nav.
                files.append(File.generated(config, uri, content=content, inclusion=InclusionLevel.NOT_IN_NAV))
                pending.append((uri, content))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Links to repository files outside docs/, and links from mirrored files, point at pages of the site."""
    src_uri = page.file.src_uri
    for start, end, path, anchor in reversed(relative_links(markdown)):
        if not path:
            continue
        uri = page_uri(resolve(src_uri, path))
        if uri is None:
            continue  # left as written: a strict build reports it if it leads nowhere
        target = posixpath.relpath(uri, posixpath.dirname(src_uri) or ".")
        markdown = markdown[:start] + target + (f"#{anchor}" if anchor else "") + markdown[end:]
    return markdown
