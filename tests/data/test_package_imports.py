"""The data package's imports: no cycle among its modules, none of them deferred into a
function, and no module importing another module's ``_private`` name (read from the source
with ``ast``, so nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

import bigbatch

DATA = Path(bigbatch.__file__).parent / "data"


def _module(path: Path) -> str:
    parts = ["bigbatch", *path.relative_to(DATA.parent).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[ast.AST, str, list[str], bool]]:
    """(node, imported module, names, at module level) of each import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _module(path).split(".") if path.name == "__init__.py" else \
        _module(path).split(".")[:-1]
    top = set(map(id, tree.body))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = [a.name for a in node.names]
            out.append((node, target, names, id(node) in top))
        elif isinstance(node, ast.Import):
            out.extend((node, a.name, [], id(node) in top) for a in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in DATA.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, p in modules.items():
        for _, target, names, _ in _imports(p):
            # `from . import st` imports the module st; `from .types import Doc`, types
            deps = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules] or [target]
            graph[m].update(d for d in deps if d in modules and d != m)
    return graph


def test_no_import_cycle_in_the_data_package():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph[m]):
            assert state.get(dep) != 1, f"import cycle: {' -> '.join(stack + [m, dep])}"
            if dep not in state:
                visit(dep, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_data_modules_are_imported_at_module_level_and_by_public_names():
    for p in sorted(DATA.rglob("*.py")):
        for node, target, names, at_top in _imports(p):
            where = f"{p.relative_to(DATA.parent)}:{node.lineno}"
            if target.startswith("bigbatch.data"):
                assert at_top, f"{where}: deferred import of {target}"
            if target.startswith("bigbatch"):
                private = [n for n in names if n.startswith("_") and n != "__version__"]
                assert not private, f"{where}: imports private {private} from {target}"
