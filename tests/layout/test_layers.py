"""The package's layout rules, checked on every `make test`.

- The import-linter contracts in ``pyproject.toml`` (``[tool.importlinter]``): imports run one
  way down the layers of ``docs/architecture.md``, the engine and the losses import no model,
  adapter or file-format library, and ``bigbatch.jax`` no torch (directly or through another
  module); each shown to break on a planted import in a copy of the package.
- No module imports another module's ``_private`` name, neither with ``from x import _name``
  nor as an attribute of an imported module (``D._name``): what one module offers another
  is public and documented.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "bigbatch"


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module a relative ``from`` import names."""
    if level == 0:
        return name or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """``{module: modules of src it imports}``, counting imports deferred into functions."""
    modules = {_module_name(p, src): p for p in src.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for me, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(me, path.name == "__init__.py", node.level, node.module)
                subs = [f"{target}.{a.name}" for a in node.names]
                deps = [m for m in subs if m in modules] or [target]
            elif isinstance(node, ast.Import):
                deps = [a.name for a in node.names]
            else:
                continue
            for dep in deps:  # `import a.b.c` also runs a and a.b
                parts = dep.split(".")
                graph[me].update(m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                                 if m in modules and m != me and not me.startswith(m + "."))
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of ``graph`` (empty: none)."""
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [m, dep] if dep in stack else [m, dep])
            elif dep not in state:
                visit(dep, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return cycles


def private_imports(src: Path = SRC) -> list[str]:
    """Every place a module of ``src`` uses a ``_private`` name of another module."""
    modules = {_module_name(p, src) for p in src.rglob("*.py")}
    found = []
    for path in sorted(src.rglob("*.py")):
        me = _module_name(path, src)
        where = path.relative_to(src.parent)
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases: dict[str, str] = {}  # local name -> bigbatch module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(me, path.name == "__init__.py", node.level, node.module)
                if not target.startswith("bigbatch"):
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    if sub in modules:  # `from . import distributed as D`: a module
                        aliases[a.asname or a.name] = sub
                    elif _is_private(a.name) and target != me:
                        found.append(f"{where}:{node.lineno}: "
                                     f"imports {a.name} from {target}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("bigbatch") and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and _is_private(node.attr)
                    and aliases[node.value.id] != me):
                found.append(f"{where}:{node.lineno}: uses "
                             f"{aliases[node.value.id]}.{node.attr}")
    return found


def test_no_import_cycle_in_the_package():
    """Counting imports deferred into functions: a deferred import is for a heavy library,
    never to dodge a circle."""
    assert import_cycles(import_graph()) == []


def test_the_cycle_check_sees_a_cycle(tmp_path):
    pkg = tmp_path / "bigbatch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    assert import_cycles(import_graph(pkg)) == [["bigbatch.a", "bigbatch.b", "bigbatch.a"]]


def test_no_module_imports_another_modules_private_name():
    assert private_imports() == []


def test_the_check_sees_a_private_import(tmp_path):
    """The rule above can fail: a planted private import is reported."""
    pkg = tmp_path / "bigbatch"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def _helper():\n    return 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from ..a import _helper\nfrom .. import a as A\n"
                                      "x = A._helper()\n")
    found = private_imports(pkg)
    assert len(found) == 2 and "imports _helper from bigbatch.a" in found[0]
    assert "uses bigbatch.a._helper" in found[1]


def _lint_imports(root: Path = ROOT, src: Path = ROOT / "src") -> subprocess.CompletedProcess:
    """``lint-imports`` on the package under ``src`` with the contracts of ``root``'s
    ``pyproject.toml``."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("lint-imports is not installed: pip install -e '.[test]' brings import-linter")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([exe, "--no-cache"], cwd=root, capture_output=True, text=True, env=env)


def test_import_linter_contracts_hold():
    out = _lint_imports()
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert out.stdout.rstrip().splitlines()[-1].endswith(" 0 broken."), out.stdout[-2000:]


def _broken_with(tmp_path: Path, module: str, line: str) -> str:
    """lint-imports' report on a copy of the package with ``line`` added to ``module`` (a
    path under src/bigbatch)."""
    shutil.copytree(SRC, tmp_path / "src" / "bigbatch",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "src" / "bigbatch" / module
    target.write_text(target.read_text() + f"\n{line}\n")
    out = _lint_imports(tmp_path, tmp_path / "src")
    assert out.returncode != 0, out.stdout[-2000:]
    return out.stdout


def test_the_layers_contract_sees_an_upward_import(tmp_path):
    """The engine importing the training loop (engine -> train) breaks the layers."""
    report = _broken_with(tmp_path, "engine/chunking.py", "from ..train import loop")
    assert "bigbatch.engine is not allowed to import bigbatch.train" in report, report[-3000:]
    assert "bigbatch.engine.chunking -> bigbatch.train.loop" in report


def test_the_jax_contract_sees_torch_through_another_room(tmp_path):
    """bigbatch.jax importing a module that imports torch (data/batches) breaks
    jax-without-torch: import-linter follows the chain."""
    report = _broken_with(tmp_path, "jax/rows.py", "from ..data import batches")
    assert "bigbatch.jax is not allowed to import torch" in report, report[-3000:]
    assert "bigbatch.jax.rows -> bigbatch.data.batches" in report


def test_every_module_has_a_layer():
    """A new top-level module or package is placed in a layer (else nothing checks it)."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["id"] == "layers")["layers"]
    named = {m.strip() for layer in layers for m in layer.replace("|", ":").split(":")}
    tops = {f"bigbatch.{p.stem}" for p in SRC.glob("*.py") if p.stem != "__init__"}
    tops |= {f"bigbatch.{p.parent.name}" for p in SRC.glob("*/__init__.py")}
    tops -= {"bigbatch.__main__"}
    assert sorted(tops - named) == [], "add these modules to [tool.importlinter] layers"
