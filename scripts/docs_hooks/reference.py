"""mkdocs hook: the API reference pages, generated from each package's ``__all__`` at build time.

``docs/reference/fleet.md``, ``ps_server.md`` and ``collective.md`` each hold the marker line
``<!-- api-reference -->``; this hook replaces it with a summary table and one mkdocstrings
directive (``::: module.name``) per public name. The public names are the package's ``__all__``,
read statically with :mod:`ast` (the docs build imports neither torch nor the packages), and each
name is followed to the module that defines it: through ``from x import y`` re-exports and the
packages' lazy ``_LAZY = {name: module}`` tables, so mkdocstrings documents the real object under
the name users write (``fleet.DistributedEmbedding`` is ``fleet.ps.embedding.DistributedEmbedding``).
A public module (``fleet.util``) gets its docstring and its own ``__all__``, one heading level down.

An object public in several places is documented once: in the package that defines it (fleet's
``record`` is collective's), else where it is met first (top-level names before module members);
its other places link there. A name in ``__all__`` that no module defines fails the build. Each
public name is also an anchor and an autorefs identifier: ``[fleet.init][]`` links to it.

``docs/reference/cli.md`` documents the ``fleetrun`` launch through mkdocs-click; this hook adds
one mkdocs-click block per subcommand of ``launcher.commands.tools`` (so a new subcommand appears
by itself) and the launch's examples (its ``--help`` epilog). Only the click modules are
imported, which load no torch, ray or kubernetes.

After rendering, the hook fixes two things on these pages: the option defaults mkdocs-click 0.9
prints as ``Sentinel.UNSET`` under click >= 8.3, and the docstrings' Sphinx roles
(``:class:`x```), which become links where the object is documented.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

MARKER = "<!-- api-reference -->"
"""The line of a reference page that the generated reference replaces."""

PAGES = {
    "reference/fleet.md": "fleet",
    "reference/ps_server.md": "ps_server",
    "reference/collective.md": "collective",
}
"""Reference page (relative to docs_dir) -> the package it documents, in page order."""

MAX_HEADING = 6

REPO = Path(__file__).resolve().parents[2]
"""The repository root (this file is scripts/docs_hooks/reference.py), where the packages live."""


@dataclass
class Public:
    """One public name: ``name`` as users write it, ``target`` where it is defined."""

    name: str
    target: str
    kind: str  # "class", "function", "attribute" or "module"
    depth: int  # 0 for a package's own names, 1 for a public module's names, ...
    members: list[Public] = field(default_factory=list)


class SourceTree:
    """Static reading of the repository's modules (parsed once, never imported)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._trees: dict[str, ast.Module] = {}

    def path(self, module: str) -> Path | None:
        """The file of a module or package, or None when it is not in the repository."""
        base = self.root.joinpath(*module.split("."))
        for candidate in (base / "__init__.py", base.with_suffix(".py")):
            if candidate.is_file():
                return candidate
        return None

    def tree(self, module: str) -> ast.Module:
        """The parsed module; raises PluginError naming it when it is missing."""
        if module not in self._trees:
            path = self.path(module)
            if path is None:
                raise PluginError(f"API reference: module {module!r} not found under {self.root}")
            self._trees[module] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        return self._trees[module]

    def lazy_table(self, module: str) -> dict[str, str]:
        """The module's ``_LAZY = {name: module}`` table of lazily imported names, if any."""
        for node in self.tree(module).body:
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in targets):
                    return ast.literal_eval(node.value)
        return {}

    def exports(self, module: str) -> list[str] | None:
        """The module's ``__all__`` (a list of strings or ``list(_LAZY)``); None without one."""
        names: list[str] | None = None
        for node in self.tree(module).body:
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if not any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                    continue
                value = self._names(module, node.value)
                names = [*(names or []), *value] if isinstance(node, ast.AugAssign) else value
        return names

    def _names(self, module: str, value: ast.expr | None) -> list[str]:
        if (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id in ("list", "sorted", "tuple")
            and len(value.args) == 1
            and isinstance(value.args[0], ast.Name)
            and value.args[0].id == "_LAZY"
        ):
            names = list(self.lazy_table(module))
            return sorted(names) if value.func.id == "sorted" else names
        try:
            return list(ast.literal_eval(value))  # type: ignore[arg-type]
        except ValueError as err:
            raise PluginError(
                f"API reference: {module}.__all__ is not a literal list of names or "
                f"list(_LAZY); write it as one so the reference can be generated ({err})"
            ) from err

    def resolve(self, module: str, name: str) -> tuple[str, str]:
        """Where ``module.name`` is defined: (dotted target, kind)."""
        for node in self.tree(module).body:
            found = self._defined(module, node, name)
            if found is not None:
                return found
        lazy = self.lazy_table(module).get(name)
        if lazy is not None:
            if lazy.endswith("."):
                return lazy[:-1], "module"
            return self.resolve(lazy, name)
        if self.path(f"{module}.{name}") is not None:
            return f"{module}.{name}", "module"
        raise PluginError(
            f"API reference: {module}.__all__ lists {name!r} but {module} neither defines, "
            f"imports nor lazily exports it; fix {module}'s __all__"
        )

    def _defined(self, module: str, node: ast.stmt, name: str) -> tuple[str, str] | None:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return f"{module}.{name}", "class"
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return f"{module}.{name}", "function"
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return f"{module}.{name}", "attribute"
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) != name:
                    continue
                source = self._absolute(module, node)
                if self.path(f"{source}.{alias.name}") is not None:
                    return f"{source}.{alias.name}", "module"
                return self.resolve(source, alias.name)
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname == name:
                    return alias.name, "module"
        return None

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = module if self.path(module).name == "__init__.py" else module.rpartition(".")[0]  # type: ignore[union-attr]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        return f"{package}.{node.module}" if node.module else package


def public_names(
    tree: SourceTree, module: str, depth: int = 0, seen: frozenset = frozenset()
) -> list[Public]:
    """The public names of ``module`` (its ``__all__``), public modules with their own names."""
    names = tree.exports(module)
    if names is None:
        raise PluginError(f"API reference: {module} has no __all__; declare its public names")
    found = []
    for name in names:
        target, kind = tree.resolve(module, name)
        item = Public(f"{module}.{name}", target, kind, depth)
        if kind == "module" and target not in seen and tree.exports(target) is not None:
            item.members = public_names(tree, target, depth + 1, seen | {module, target})
            for member in item.members:  # the name users write: fleet.util.shard_files
                member.name = f"{item.name}.{member.name.rpartition('.')[2]}"
        found.append(item)
    return found


def walk(items: list[Public]) -> Iterator[Public]:
    """Every public name of ``items``, a public module's own names after it."""
    for item in items:
        yield item
        yield from walk(item.members)


def owners(pages: dict[str, list[Public]]) -> dict[str, tuple[str, str]]:
    """target -> (page, public name) of the one place that documents it."""
    occurrences: list[tuple[int, int, int, str, Public]] = []
    for page_index, (page, items) in enumerate(pages.items()):
        for order, item in enumerate(walk(items)):
            home = item.target.split(".")[0] == PAGES[page]
            occurrences.append(
                (0 if home else 1, item.depth, page_index * 100_000 + order, page, item)
            )
    chosen: dict[str, tuple[str, str]] = {}
    for *_, page, item in sorted(occurrences, key=lambda o: o[:3]):
        chosen.setdefault(item.target, (page, item.name))
    return chosen


def _toc_label(item: Public) -> str:
    """The table of contents shows a package's names whole, a public module's by their last part."""
    return item.name if item.depth == 0 else item.name.rpartition(".")[2]


def _directive(item: Public, level: int, members: bool) -> str:
    lines = [
        f"::: {item.target}",
        "    options:",
        f'      heading: "{item.name}"',
        f'      toc_label: "{_toc_label(item)}"',
        f"      heading_level: {level}",
    ]
    if not members:
        lines.append("      members: false")
    return "\n".join(lines)


def render(page: str, items: list[Public], chosen: dict[str, tuple[str, str]]) -> str:
    """The generated Markdown of one reference page."""
    out = ["| Name | Kind | Defined in |", "| --- | --- | --- |"]
    for item in sorted(items, key=lambda i: (i.kind == "module", i.name.lower())):
        where = item.target if item.kind == "module" else item.target.rpartition(".")[0]
        out.append(f"| [`{item.name}`][{item.target}] | {item.kind} | `{where}` |")
    out.append("")
    ordered = sorted(items, key=lambda i: i.kind == "module")  # __all__ order, modules last
    out.extend(_sections(page, ordered, chosen, level=2))
    return "\n".join(out) + "\n"


def _sections(
    page: str, items: list[Public], chosen: dict[str, tuple[str, str]], level: int
) -> list[str]:
    out: list[str] = []
    level = min(level, MAX_HEADING)
    for item in items:
        owner_page, owner_name = chosen[item.target]
        if (owner_page, owner_name) != (page, item.name):
            out += [
                f"{'#' * level} `{item.name}` {{ #{item.name} data-toc-label='{_toc_label(item)}' }}",
                "",
                f"The same object as [`{owner_name}`][{item.target}] (`{item.target}`), "
                "documented there.",
                "",
            ]
            continue
        if item.name != item.target:  # the name users write is an anchor (and autorefs id) too
            out += [f"[](){{ #{item.name} }}", ""]
        out += [_directive(item, level, members=item.kind != "module"), ""]
        if item.members:
            out.extend(_sections(page, item.members, chosen, level + 1))
    return out


def generate() -> tuple[dict[str, str], dict[str, str]]:
    """The generated Markdown of every reference page, by page; and public name -> target."""
    tree = SourceTree(REPO)
    pages = {page: public_names(tree, package) for page, package in PAGES.items()}
    chosen = owners(pages)
    targets = {item.name: item.target for items in pages.values() for item in walk(items)}
    return {page: render(page, items, chosen) for page, items in pages.items()}, targets


CLI_PAGE = "reference/cli.md"
CLI_SUBCOMMANDS = "<!-- cli-subcommands -->"
"""The line of the CLI page replaced by one mkdocs-click block per ``fleetrun`` subcommand."""
CLI_EXAMPLES = "<!-- cli-examples -->"
"""The line of the CLI page replaced by the launch command's examples (its ``--help`` epilog)."""


def cli_subcommands() -> str:
    """One mkdocs-click block per subcommand of ``launcher.commands.tools``, by name.

    Imports only ``launcher.commands`` (click; what ``fleetrun --help`` loads: no torch, ray or
    kubernetes). A group (``fleetrun k8s``) lists its own subcommands below it.
    """
    import launcher.commands as commands

    names = {id(obj): name for name, obj in vars(commands).items()}
    blocks = []
    for name in sorted(commands.tools.commands):
        command = commands.tools.commands[name]
        if command.hidden:
            continue
        if id(command) not in names:
            raise PluginError(
                f"CLI reference: subcommand {name!r} is not a module-level name of "
                "launcher.commands; mkdocs-click loads commands by name"
            )
        blocks.append(
            "\n".join(
                [
                    "::: mkdocs-click",
                    "    :module: launcher.commands",
                    f"    :command: {names[id(command)]}",
                    f"    :prog_name: fleetrun {name}",
                    "    :depth: 2",
                    "    :style: table",
                    "    :list_subcommands: true",
                ]
            )
        )
    return "\n\n".join(blocks) + "\n"


def _cli_commands() -> dict[str, Any]:
    """Heading id (mkdocs-click's slug of the command path) -> click command, for every command."""
    from launcher.cli import run_command
    from launcher.commands import tools

    found = {"fleetrun": run_command}
    stack = [(f"fleetrun {name}", command) for name, command in tools.commands.items()]
    while stack:
        path, command = stack.pop()
        found[path.replace(" ", "-")] = command
        for name, sub in getattr(command, "commands", {}).items():
            stack.append((f"{path} {name}", sub))
    return found


_ROW_OR_HEADING = re.compile(
    r'<h[1-6] id="(?P<id>[^"]+)"'
    r"|<tr>\s*<td><code>(?P<opt>[^<]+)</code>(?P<cells>(?:(?!</tr>).)*?)"
    r"<td><code>Sentinel\.UNSET</code></td>",
    flags=re.DOTALL,
)


def _context(command: Any) -> Any:
    """A click context of ``command`` with its own settings (``-h`` as a help option too)."""
    import click

    return click.Context(command, info_name=command.name, **command.context_settings)


def fix_unset_defaults(html: str) -> str:
    """Default cells of options without a default, as mkdocs-click shows them with click < 8.3.

    click 8.3 gives such options the default ``Sentinel.UNSET`` where it had ``None``, and
    mkdocs-click 0.9 prints it as is; the cell becomes what ``to_info_dict()`` reports (None for
    no default, False for a flag), or *required*. An empty-string default shows as ``""``.
    """
    commands = _cli_commands()
    current: list[Any] = [None]

    def cell(match: re.Match) -> str:
        if match["id"] is not None:
            current[0] = commands.get(match["id"], current[0])
            return match[0]
        command = current[0]
        if command is None:
            raise PluginError(f"CLI reference: option {match['opt']} before any command heading")
        for param in command.get_params(_context(command)):
            if match["opt"] in (*param.opts, *getattr(param, "secondary_opts", [])):
                info = param.to_info_dict()
                if info.get("default") is not None:
                    text = f"<code>{info['default']}</code>"
                else:
                    text = "<em>required</em>" if info.get("required") else "None"
                return f"<tr>\n<td><code>{match['opt']}</code>{match['cells']}<td>{text}</td>"
        raise PluginError(f"CLI reference: option {match['opt']} not found in its click command")

    html = _ROW_OR_HEADING.sub(cell, html).replace("<td>``</td>", '<td><code>""</code></td>')
    if "Sentinel.UNSET" in html:
        raise PluginError("CLI reference: a 'Sentinel.UNSET' default is left on the CLI page")
    return html


_ROLE_OR_HEADING = re.compile(
    r'<h[1-6] id="(?P<id>[^"]+)"'
    r"|:(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):<code>(?P<tilde>~?)\.?(?P<name>[^<]+)</code>"
)


def link_roles(html: str, targets: dict[str, str]) -> str:
    """Docstrings' Sphinx roles (``:class:`~fleet.x.Y```) as links where the object is documented.

    The docstrings are written for Sphinx as well; in Markdown a role shows as ``:class:`` before
    the code. It becomes an optional cross-reference (plain code when nothing documents the
    name): a public name (``fleet.init``) to its definition, a bare name (``:meth:`save```) to
    the member of that name of the object being documented or of its parents; ``~`` shows the
    last part only. RST's ``text::`` before a literal block reads ``text:``.
    """
    ids = set(re.findall(r'id="([^"]+)"', html))
    heading = [""]

    def link(match: re.Match) -> str:
        if match["id"] is not None:
            heading[0] = match["id"]
            return match[0]
        name = match["name"]
        shown = name.rpartition(".")[2] if match["tilde"] else name
        target = targets.get(name, name)
        if "." not in name:
            parts = heading[0].split(".")
            for end in range(len(parts), 0, -1):
                if f"{'.'.join(parts[:end])}.{name}" in ids:
                    target = f"{'.'.join(parts[:end])}.{name}"
                    break
        return f'<autoref optional identifier="{target}"><code>{shown}</code></autoref>'

    return _ROLE_OR_HEADING.sub(link, html).replace("::</p>", ":</p>")


def cli_examples() -> str:
    """The launch command's examples, as ``fleetrun --help`` prints them (its epilog)."""
    from launcher.cli import run_command

    lines = [line for line in (run_command.epilog or "").splitlines() if line.strip() != "\b"]
    return "\n".join(["```text", *lines, "```"]) + "\n"


_generated: dict[str, str] = {}
_targets: dict[str, str] = {}


CLI_MODULES = ("launcher.cli", "launcher.commands")
"""The click modules the CLI page is generated from (by this hook and by mkdocs-click)."""


def on_config(config: Any) -> None:
    """Read the packages' public names once per build.

    ``mkdocs serve`` rebuilds in the same process: the click modules are dropped from
    ``sys.modules`` so that each build imports the CLI as it is now.
    """
    for name in CLI_MODULES:
        sys.modules.pop(name, None)
    pages, targets = generate()
    _generated.clear()
    _generated.update(pages)
    _targets.clear()
    _targets.update(targets)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace a reference page's marker line with its generated reference."""
    src = page.file.src_uri
    if src == CLI_PAGE:
        for marker, make in ((CLI_SUBCOMMANDS, cli_subcommands), (CLI_EXAMPLES, cli_examples)):
            if marker not in markdown:
                raise PluginError(f"CLI reference: docs/{src} lacks the line {marker}")
            markdown = markdown.replace(marker, make())
        return markdown
    if src not in PAGES:
        return markdown
    if MARKER not in markdown:
        raise PluginError(f"API reference: docs/{src} lacks the line {MARKER} to generate into")
    return markdown.replace(MARKER, _generated[src])


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Fix up the rendered reference pages (see fix_unset_defaults and link_roles)."""
    src = page.file.src_uri
    if src == CLI_PAGE:
        return fix_unset_defaults(html)
    if src in PAGES:
        return link_roles(html, _targets)
    return html
