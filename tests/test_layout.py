"""The layers of events_ledger (docs/internals.md, "The layout"): a module imports only
from its own layer or below, and no import cycle exists. Imports inside functions count:
hiding an upward import in a function hides the dependency, it does not remove it."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "events_ledger"
INTERNALS = ROOT / "docs" / "internals.md"
README = ROOT / "README.md"

#: Bottom first. A module may import modules of its own layer and of the layers below.
LAYERS: list[tuple[str, set[str]]] = [
    ("foundations", {"states", "conf", "db", "deadline", "logcontext", "registry"}),
    ("answers", {"envelopes"}),
    ("the table's SQL", {"querysets"}),
    ("the table", {"models"}),
    ("around the table", {"signals", "background", "status", "fastpath"}),
    ("services", {"ledger", "cleanup", "runner", "retention"}),
    (
        "what services mean",
        {"diagnosis", "testing", "dashboard", "metrics", "health", "jobs"},
    ),
    (
        "surfaces",
        {
            "checks",
            "routers",
            "admin",
            "tasks",
            "celery",
            "views",
            "templatetags.events_ledger_dashboard",
            "management.base",
            "management.commands.cleanup_runs",
            "management.commands.ledger_status",
            "management.commands.reconcile_resources",
            "management.commands.prune_ledger",
            "management.commands.end_run",
            "management.commands.resolve_rows",
        },
    ),
    ("start-up and the public face", {"apps", "__init__"}),
]

#: The SQL layer imports only these of the app, so it can be read and tested alone.
TABLE_MAY_IMPORT = {"db", "states"}
TABLE = {"querysets", "models"}

#: Imports allowed against the rules above, each with the reason and when it goes. Empty
#: since step 3 of #13 (querysets take their limits as arguments and reach sibling models
#: through the schema); an entry whose import is gone fails test_each_known_exception_is_still_needed.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    return ".".join(rel.parts)


def app_modules() -> dict[str, Path]:
    """Every module of the app that holds code: not migrations (schema history), not the
    empty ``__init__`` of a subpackage."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "migrations" in path.parts:
            continue
        name = module_name(path)
        if name.endswith("__init__") and name != "__init__":
            if not path.read_text().strip():
                continue
        found[name] = path
    return found


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The app module an imported dotted name (relative to the package) lands in."""
    parts = name.split(".") if name else []
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return "__init__"  # `from events_ledger import x` where x is no module


def is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node Python may run, at any depth: not the body of ``if TYPE_CHECKING:``,
    whose imports exist for the type checker only and make no cycle at run time."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if is_type_checking(node):
            assert isinstance(node, ast.If)
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported app module, line) for every import of the app in a module, at any depth."""
    package = name.split(".")[:-1]  # the package a relative import starts from
    if name == "__init__":
        package = []
    for node in runtime_nodes(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(["events_ledger", *base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            # `from . import signals` imports the module signals; `from .x import y`, x.
            targets = [f"{module}.{alias.name}" for alias in node.names]
        for target in targets:
            if target != "events_ledger" and not target.startswith("events_ledger."):
                continue
            found = resolve(target.removeprefix("events_ledger").lstrip("."), modules)
            if found and found != name:
                yield found, node.lineno


def graph() -> dict[str, set[str]]:
    modules = app_modules()
    return {name: {m for m, _ in imports_of(name, path, modules)} for name, path in modules.items()}


def layer_of() -> dict[str, int]:
    return {module: i for i, (_, members) in enumerate(LAYERS) for module in members}


def violations(edges: dict[str, set[str]]) -> list[str]:
    layers = layer_of()
    found = []
    for module, imported in sorted(edges.items()):
        for other in sorted(imported):
            if (module, other) in KNOWN_EXCEPTIONS:
                continue
            if layers[other] > layers[module]:
                found.append(
                    f"{module} ({LAYERS[layers[module]][0]}) imports {other} "
                    f"({LAYERS[layers[other]][0]}), a higher layer"
                )
            elif module in TABLE and other not in TABLE_MAY_IMPORT | TABLE:
                found.append(f"{module} imports {other}: the table imports only db and states")
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def without_exceptions(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    return {
        m: {o for o in imported if (m, o) not in KNOWN_EXCEPTIONS} for m, imported in edges.items()
    }


# ── the tests ──


def test_every_module_has_a_layer():
    placed = layer_of()
    assert not set(app_modules()) - set(placed), "place the new module in LAYERS and the docs"
    assert not set(placed) - set(app_modules()), "a module in LAYERS no longer exists"


def test_no_module_imports_a_higher_layer():
    found = violations(graph())
    assert not found, "\n".join(found)


def test_no_import_cycle():
    found = cycles(without_exceptions(graph()))
    assert not found, f"modules that import each other: {found}"


def test_each_known_exception_is_still_needed():
    # When step 3 of #13 removes one, delete it from KNOWN_EXCEPTIONS too.
    edges = graph()
    stale = [edge for edge in KNOWN_EXCEPTIONS if edge[1] not in edges.get(edge[0], set())]
    assert not stale, f"these imports are gone; drop them from KNOWN_EXCEPTIONS: {stale}"


def test_function_level_imports_are_seen_and_type_checking_ones_are_not():
    assert {"checks", "registry", "metrics"} <= graph()["apps"]  # all inside ready()
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .models import EventRun\n"
        "else:\n    from .db import storable\n"
        "def f():\n    from .cleanup import sweep\n"
    )
    names = [n.module for n in runtime_nodes(tree) if isinstance(n, ast.ImportFrom)]
    assert sorted(names) == ["cleanup", "db", "typing"]


def test_an_upward_import_and_a_cycle_are_caught():
    edges = graph()
    edges["db"] = edges["db"] | {"cleanup"}
    assert any(v.startswith("db (foundations) imports cleanup") for v in violations(edges))
    assert ["cleanup", "db"] in [sorted(set(c) & {"db", "cleanup"}) for c in cycles(edges)]
    edges = graph()
    edges["querysets"] = edges["querysets"] | {"registry"}
    assert "querysets imports registry: the table imports only db and states" in violations(edges)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_layout_section_names_every_module():
    text = INTERNALS.read_text()
    section = text.partition("## The layout")[2].partition("\n## ")[0]
    assert section, "docs/internals.md has a section 'The layout'"
    named = {n for n in re.findall(r"`([a-z_/]+)\.py`", section) if not n.startswith("tests/")}
    expected = {name.replace(".", "/") for name in app_modules()}
    assert not expected - named, f"modules the layout does not describe: {expected - named}"
    assert not named - expected, f"the layout describes modules that are gone: {named - expected}"


def test_the_readmes_layout_names_every_module():
    section = README.read_text().partition("## Layout")[2].partition("\n## ")[0]
    named = set(re.findall(r"`(?!tests/|project/|docs/)(?:[a-z_]+/)*([a-z_]+\.py)`", section))
    expected = {path.name for path in app_modules().values()}
    assert not expected - named, f"modules the README's layout leaves out: {expected - named}"
    assert not named - expected, (
        f"the README's layout names modules that are gone: {named - expected}"
    )
