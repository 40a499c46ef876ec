"""Test helpers stand beside the tests that use them: a module at the root of ``tests/``
(other than ``conftest.py``, which puts the root on ``sys.path``) is one that tests in
several folders import; a helper that one folder uses belongs in that folder."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def helper_users(tests: Path = TESTS) -> dict[str, set[str]]:
    """``{module at the root of tests: the folders under tests whose files import it}``,
    counting imports deferred into functions (a root module importing another counts for
    no folder)."""
    helpers = {p.stem for p in tests.glob("*.py") if p.name != "conftest.py"}
    users: dict[str, set[str]] = {h: set() for h in helpers}
    for path in tests.rglob("*.py"):
        folder = path.relative_to(tests).parts[0] if path.parent != tests else None
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for name in names:
                if name in users and folder is not None:
                    users[name].add(folder)
    return users


def test_every_helper_at_the_root_is_shared_by_several_folders():
    lonely = {h: sorted(f) for h, f in helper_users().items() if len(f) < 2}
    assert lonely == {}, "move each into the one folder that uses it (or delete it if none)"


def test_the_check_sees_a_helper_one_folder_uses(tmp_path):
    for folder in ("core", "pipeline"):
        (tmp_path / folder).mkdir()
    (tmp_path / "conftest.py").write_text("import sys\n")
    (tmp_path / "shared.py").write_text("X = 1\n")
    (tmp_path / "lonely.py").write_text("Y = 2\n")
    (tmp_path / "core" / "test_a.py").write_text("from shared import X\nfrom lonely import Y\n")
    (tmp_path / "pipeline" / "test_b.py").write_text("def test():\n    import shared\n")
    assert helper_users(tmp_path) == {"shared": {"core", "pipeline"}, "lonely": {"core"}}
