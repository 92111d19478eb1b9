"""The package's import graph, read from the source (imports inside functions included).

``module_imports()`` maps each ``zeroplus`` module to the ``zeroplus`` modules it imports, wherever in
the file the import stands (``type_checking=True``: those under ``if TYPE_CHECKING`` as well);
``cycles()`` lists the strongly connected groups of two or more modules (import loops);
``imports_in_functions()`` lists the imports written inside a function or method.
"""
from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path

import zeroplus
from zeroplus.source_tree import MAPPED

ROOT = Path(zeroplus.__file__).resolve().parent
# each package's folder: zeroplus's own, and the top-level folders it maps (beside it in a source checkout)
FOLDERS = {"zeroplus": ROOT, **{f"zeroplus.{name}": Path(importlib.import_module(f"zeroplus.{name}").__path__[0])
                                for name in MAPPED}}


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in FOLDERS.items():
        for dirpath, _, files in os.walk(folder):
            for name in files:
                if name.endswith(".py"):
                    path = Path(dirpath) / name
                    parts = [*package.split("."), *path.relative_to(folder).with_suffix("").parts]
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    out.setdefault(".".join(parts), path)
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, bool, bool]]:
    """(imported zeroplus module, inside a function, under ``if TYPE_CHECKING``) for each import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: list[tuple[str, bool, bool]] = []

    def visit(node: ast.AST, in_function: bool, in_type_checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            checking = in_type_checking or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(module, is_package, child)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in child.names]
            for name in names:
                while name and name not in known:
                    name = name.rpartition(".")[0]
                if name.startswith("zeroplus") and name != module:
                    found.append((name, in_function, checking))
            visit(child, inside, checking)

    visit(tree, False, False)
    return found


def module_imports(type_checking: bool = False) -> dict[str, set[str]]:
    """Each module's imports run when it loads; ``type_checking``: those under ``if TYPE_CHECKING`` too."""
    known = _modules()
    return {m: {t for t, _, checking in _targets(m, p, known) if type_checking or not checking}
            for m, p in known.items()}


def imports_in_functions() -> list[tuple[str, str]]:
    known = _modules()
    return sorted({(m, t) for m, p in known.items() for t, inner, _ in _targets(m, p, known) if inner})


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


if __name__ == "__main__":
    g = module_imports()
    for c in cycles(g):
        print(len(c), c)
    print(len(imports_in_functions()), "imports inside functions")
