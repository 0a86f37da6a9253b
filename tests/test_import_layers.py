"""The package's layers (DESIGN.md, README "Architecture"): nothing imports upward, nothing imports in
a circle.

A small AST walk over ``asynctorchx/`` (no import is executed). Every ``import``/``from ... import``
of the package counts for the layering, those inside functions (lazy imports) included; the cycle
check takes the imports that run when a module is imported (everything outside functions,
``if TYPE_CHECKING:`` blocks included: a cycle that only the type checker follows is still a
cycle a reader has to untangle).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "asynctorchx"

#: What each part of the package may import of the package, from the bottom up. ``_tasks`` and
#: ``version`` are the base every layer may use; ``apps`` runs inside replicas (stdlib only);
#: ``tracker`` is imported by jobs too (specs and logs only); ``testing`` is a backend for tests.
#: The package's ``__init__`` and ``__main__`` are the top and may import anything.
BASE = frozenset({"_tasks", "version"})
ALLOWED: dict[str, frozenset[str]] = {
    "_tasks": frozenset(),
    "version": frozenset(),
    "apps": frozenset(),
    "specs": BASE,
    "logs": BASE | {"specs"},
    "tracker": frozenset({"specs", "logs"}),
    "schedulers": BASE | {"specs", "logs"},
    "testing": BASE | {"specs", "logs", "schedulers"},
    "components": BASE | {"specs", "logs", "schedulers", "tracker", "apps"},
    "runner": BASE | {"specs", "logs", "schedulers", "tracker", "components"},
    "cli": BASE | {"specs", "logs", "schedulers", "tracker", "components", "runner"},
}
TOP = frozenset({"", "__main__"})

#: Modules run by path or inside replicas: they may import the standard library and their
#: siblings named here, nothing else.
STDLIB_ONLY = {
    "asynctorchx.schedulers._local.watchdog": {"contain", "protocol", "recordfile"},
    "asynctorchx.schedulers._local.protocol": set(),
    "asynctorchx.schedulers._local.contain": set(),
    "asynctorchx.schedulers._local.recordfile": set(),
}


@dataclass(frozen=True)
class Import:
    """One import of a module of the package by a module of the package."""

    source: str
    target: str
    line: int
    eager: bool  # outside any function: runs when ``source`` is imported


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


MODULES = _module_names()


def _targets(module: str, node: ast.Import | ast.ImportFrom, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".")
        if not is_package:
            base.pop()
        base = base[: len(base) - node.level + 1]
        prefix = ".".join([*base, *([node.module] if node.module else [])])
    else:
        prefix = node.module or ""
    # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` imports mod
    return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix for a in node.names]


def _imports_of(module: str, path: Path) -> Iterator[Import]:
    is_package = path.name == "__init__.py"

    def walk(node: ast.AST, in_function: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, child, is_package):
                    if target.split(".")[0] == "asynctorchx":
                        yield Import(module, target, child.lineno, not in_function)
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from walk(child, in_function or nested)

    yield from walk(ast.parse(path.read_text(encoding="utf-8"), str(path)), False)


IMPORTS = [imp for module, path in MODULES.items() for imp in _imports_of(module, path)]


def _part(module: str) -> str:
    """The top-level part of the package a module belongs to (``""`` for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _where(imp: Import) -> str:
    path = MODULES[imp.source].relative_to(PACKAGE.parent)
    return f"{path}:{imp.line} imports {imp.target}"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_part_of_the_package_has_a_layer() -> None:
    """Each top-level module or package is placed in the layering (a new one must be placed)."""
    parts = {_part(m) for m in MODULES}
    assert parts - TOP - set(ALLOWED) == set()


def test_nothing_imports_upward() -> None:
    """No module imports a part of the package above its own layer, lazily or not."""
    bad = [
        f"{_where(imp)} ({_part(imp.source)} may import only {sorted(ALLOWED[_part(imp.source)])})"
        for imp in IMPORTS
        if _part(imp.source) not in TOP
        and _part(imp.target) != _part(imp.source)
        and _part(imp.target) not in ALLOWED[_part(imp.source)]
    ]
    assert bad == []


def test_no_import_cycles() -> None:
    """No two modules import each other, directly or through others, when they are imported."""
    edges: dict[str, set[str]] = {}
    for imp in IMPORTS:
        if imp.eager and imp.target in MODULES and imp.target != imp.source:
            edges.setdefault(imp.source, set()).add(imp.target)
    assert _cycles(edges) == []


def test_the_cycle_check_finds_cycles() -> None:
    """The cycle finder reports a cycle through three modules and none in a chain."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}}) == []


def _third_party_imports(path: Path, allowed: set[str], eager_only: bool) -> Iterator[str]:
    """The imports of ``path`` of modules outside the standard library and ``allowed``."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}

    def walk(node: ast.AST, in_function: bool) -> Iterator[str]:
        for child in ast.iter_child_nodes(node):
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and not child.level:
                names = [child.module or ""]
            for name in names:
                top = name.split(".")[0]
                if top not in stdlib and top not in allowed and not (eager_only and in_function):
                    yield f"{path.relative_to(PACKAGE.parent)}:{child.lineno} imports {name}"
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from walk(child, in_function or nested)

    yield from walk(ast.parse(path.read_text(encoding="utf-8")), False)


def test_scripts_and_replica_code_import_the_standard_library_only() -> None:
    """The watchdog's modules import only the standard library (and each other); ``apps`` (run in
    replicas) only the standard library when imported (an optional library lazily, where used)."""
    bad = []
    for module, path in MODULES.items():
        if module in STDLIB_ONLY:
            bad += _third_party_imports(path, STDLIB_ONLY[module], eager_only=False)
        elif _part(module) == "apps":
            bad += _third_party_imports(path, set(), eager_only=True)
    assert bad == []


def test_the_watchdog_starts_without_typing_dataclasses_or_logging() -> None:
    """The watchdog's start-up competes for a core with its launcher's first launches; these three
    (with ``inspect``, ``dis`` and ``ast`` behind ``dataclasses``) were 37 ms of its 150 ms of
    processor time here. Run as the launcher starts it (``python -I -S``, siblings by path)."""
    import subprocess

    local = PACKAGE / "schedulers" / "_local"
    probe = (
        f"import sys; sys.path.insert(0, {str(local)!r}); import watchdog; "
        "print(sorted(m for m in ('typing', 'dataclasses', 'logging', 'inspect') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
