"""The import graph of core/, api/, workers/ and ops/ has no cycle, counting every import that runs:
module-level ones and the late ones inside functions (import-linter's contracts see neither kind of
cycle). Imports under `if TYPE_CHECKING:` never run and are left out: they are how a module names a type
of a module that imports it. A cycle of late imports works until the day one of them moves to the top."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "api", "workers", "ops")


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name | ast.Attribute) and ast.unparse(test).endswith("TYPE_CHECKING")


def _imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every dotted name an import statement that can run in `module` names, whatever its depth."""
    out: set[str] = set()
    todo = [tree]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                todo.extend(child.orelse)  # the `if TYPE_CHECKING:` body never runs
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = module.split(".")[: len(module.split(".")) - child.level + (1 if is_package else 0)]
                    base = ".".join([*parts, *([child.module] if child.module else [])])
                out.add(base)
                out.update(f"{base}.{a.name}" for a in child.names)
            todo.append(child)
    return out


def graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project's modules it imports (a package's __init__ counts: importing a.b.c runs
    a and a.b first; a module's own packages aside, which are being initialized around it)."""
    mods = _modules(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for name in _imported(ast.parse(f.read_text()), m, f.name == "__init__.py"):
            parts = name.split(".")
            for n in range(1, len(parts) + 1):
                target = ".".join(parts[:n])
                if target in mods and target != m and not m.startswith(target + "."):
                    edges[m].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(edges[w]))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def test_no_import_cycle_counting_late_imports():
    assert cycles(graph(ROOT)) == []


def test_a_late_import_that_closes_a_cycle_is_found(tmp_path):
    """The check itself: a cycle closed by an import inside a function, through a package's relative
    import, is found; one closed only under TYPE_CHECKING is not a cycle."""
    (tmp_path / "core" / "sub").mkdir(parents=True)
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").touch()
    (tmp_path / "core" / "sub" / "__init__.py").touch()
    (tmp_path / "core" / "a.py").write_text("from core.sub import b\n")
    (tmp_path / "core" / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (tmp_path / "api" / "c.py").write_text("import workers.d\n")
    (tmp_path / "workers" / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from api import c\nelse:\n    import os\n"
    )
    assert cycles(graph(tmp_path)) == [["core.a", "core.sub.b"]]
