"""docs/architecture.md's tree is the code's: every module and package of ``src/bigbatch/``
has its one line there, and every line names a module that exists; the folders of ``tests/``
and its shared helpers, and the files of ``examples/``, likewise."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
ITEM = re.compile(r"^(?P<indent> *)- `(?P<name>[^`]+)`")


def tree_paths(page: str) -> list[str]:
    """The paths the nested list of the page's "The tree" section names, in order: each item
    ``- `name`...`` under its parent item (four spaces a level, Markdown's nesting)."""
    section = page.split("\n## The tree\n", 1)[1].split("\n## ", 1)[0]
    stack: list[str] = []
    paths = []
    for line in section.splitlines():
        m = ITEM.match(line)
        if m is None:
            continue
        depth, rest = divmod(len(m["indent"]), 4)
        assert rest == 0 and depth <= len(stack), f"misplaced in the tree: {line!r}"
        stack[depth:] = [m["name"]]
        paths.append("".join(p if p.endswith("/") else p + "/" for p in stack).rstrip("/")
                     + ("/" if m["name"].endswith("/") else ""))
    return paths


def package_paths(src: Path) -> set[str]:
    """What the tree must name of the package at ``src``: each module and each package
    folder (a folder's ``__init__.py`` is its line; the root's is named)."""
    root = f"src/{src.name}/"
    out = {root}
    for p in src.rglob("*.py"):
        rel = p.relative_to(src)
        if p.name == "__init__.py" and p.parent != src:
            out.add(root + rel.parent.as_posix() + "/")
        else:
            out.add(root + rel.as_posix())
    return out


def beside_paths(root: Path) -> set[str]:
    """What the tree must name beside the package: the folders of ``tests/`` and the
    modules at its root, and the files of ``examples/``."""
    out = {"tests/", "examples/", "docs/"}
    out |= {f"tests/{p.name}/" for p in (root / "tests").iterdir()
            if p.is_dir() and any(p.glob("*.py"))}
    out |= {f"tests/{p.name}" for p in (root / "tests").glob("*.py")}
    out |= {f"examples/{p.name}" for p in (root / "examples").glob("*.py")}
    return out


def tree_differences(page: str, expected: set[str]) -> dict[str, list[str]]:
    """What the page's tree lacks, names without a module, and names twice."""
    named = tree_paths(page)
    return {"missing": sorted(expected - set(named)), "not in the code": sorted(set(named) - expected),
            "named twice": sorted(p for p, n in Counter(named).items() if n > 1)}


def test_the_tree_names_every_module_once_and_nothing_else():
    expected = package_paths(ROOT / "src" / "bigbatch") | beside_paths(ROOT)
    found = tree_differences(PAGE.read_text(encoding="utf-8"), expected)
    assert found == {"missing": [], "not in the code": [], "named twice": []}, \
        "give each module one line in docs/architecture.md's tree (and remove lines of modules gone)"


PLANTED_PAGE = """# Architecture

## The tree

- `src/pkg/`
    - `__init__.py`: the face.
    - `a.py`: a module,
      described on two lines.
    - `room/`: a room.
        - `b.py`: a module of the room.
        - `gone.py`: a module no longer there.

## After
- `src/pkg/`
    - `not_the_tree.py`: another section.
"""


def test_the_check_sees_a_module_without_a_line_and_a_line_without_a_module(tmp_path):
    src = tmp_path / "src" / "pkg"
    (src / "room").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "room/__init__.py", "room/b.py", "room/new.py"):
        (src / name).write_text("")
    assert tree_paths(PLANTED_PAGE) == ["src/pkg/", "src/pkg/__init__.py", "src/pkg/a.py",
                                        "src/pkg/room/", "src/pkg/room/b.py",
                                        "src/pkg/room/gone.py"]
    assert tree_differences(PLANTED_PAGE, package_paths(src)) == {
        "missing": ["src/pkg/room/new.py"], "not in the code": ["src/pkg/room/gone.py"],
        "named twice": []}
    twice = PLANTED_PAGE.replace("- `b.py`: a module of the room.",
                                 "- `b.py`: one.\n        - `b.py`: again.")
    assert tree_differences(twice, package_paths(src))["named twice"] == ["src/pkg/room/b.py"]
