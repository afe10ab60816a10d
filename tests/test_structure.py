"""The shape of the source tree: no import cycles inside a package, no oversized files.

Imports are read from the source (every ``import`` statement, function-level ones included,
since a cycle hidden inside a function is still a cycle), so the test needs neither torch
nor kopf to run. Generated files are the only exception to the size limit."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {  # import name -> its directory
    "sftjob_contract": ROOT / "contract" / "sftjob_contract",
    "sftjob_trainer": ROOT / "trainer" / "sftjob_trainer",
    "sftjob_operator": ROOT / "operator" / "sftjob_operator",
}
MAX_LINES = 400
SOURCE_DIRS = ["contract", "trainer", "operator", "demo", "bench", "hack", "examples", "images", "tools"]
GENERATED: set[str] = set()  # repo-relative paths of generated sources, none today

pytestmark = pytest.mark.unit


def module_name(package: str, directory: Path, path: Path) -> str:
    parts = list(path.relative_to(directory).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that the source of module ``name`` imports anywhere."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            # `from pkg import mod` names a module; `from mod import name` names the module.
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(package: str, directory: Path) -> dict[str, set[str]]:
    paths = {module_name(package, directory, p): p for p in sorted(directory.rglob("*.py"))}
    known = set(paths)
    # A package's __init__ is imported with any of its modules; it is not an edge of its own.
    return {name: {m for m in imported_modules(name, path, known) if not name.startswith(m + ".")}
            for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.mark.parametrize("package", sorted(p for p, d in PACKAGES.items() if d.is_dir()))
def test_no_import_cycles(package):
    cycle = find_cycle(import_graph(package, PACKAGES[package]))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_a_function_level_cycle(tmp_path):
    """The check above would pass vacuously if it missed imports inside functions."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    (pkg / "c.py").write_text("from pkg import a\n")
    graph = import_graph("pkg", pkg)
    assert graph["pkg.c"] == {"pkg.a"}
    assert find_cycle(graph) in (["pkg.a", "pkg.b", "pkg.a"], ["pkg.b", "pkg.a", "pkg.b"])


def test_no_source_file_over_the_limit():
    over = []
    for top in SOURCE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")) if (ROOT / top).is_dir() else []:
            rel = str(path.relative_to(ROOT))
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES and rel not in GENERATED:
                over.append(f"{rel}: {lines} lines")
    assert not over, f"split these along their seams (limit {MAX_LINES}):\n" + "\n".join(over)


PRODUCT_IMPORTS_BANNED = ("tools", "bench", "demo", "examples", "hack", "tests")


def test_the_product_packages_hold_no_developer_tools():
    """What ships in the images (contract, trainer, operator) neither imports the checkout's
    tools, benchmarks, demo or tests, nor finds files by walking up from ``__file__``: that only
    works in a checkout. Developer tools live in tools/ (issue 24)."""
    found = []
    for directory in PACKAGES.values():
        for path in sorted(directory.rglob("*.py")):
            rel = path.relative_to(ROOT)
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                found += [f"{rel}: imports {n}" for n in names if n.split(".")[0] in PRODUCT_IMPORTS_BANNED]
                if isinstance(node, ast.Name) and node.id == "__file__":
                    found.append(f"{rel}:{node.lineno}: reads __file__")
    assert not found, "move these to tools/ (or read the path from configuration):\n" + "\n".join(found)
