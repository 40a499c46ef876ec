"""Helpers for model-card tests: the Python snippets of a generated card, run as a reader
would run them (in a fresh interpreter, offline), with the card's folder names mapped to
where the test saved the model, and every snippet whose library is not installed skipped
with that reason."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

# the top-level package each snippet's library is imported as
_LIBRARIES = ("sentence_transformers", "transformers", "peft", "pylate", "colpali_engine",
              "bigbatch")


def python_blocks(card: str) -> list[str]:
    """The card's ```python blocks, in order."""
    return re.findall(r"```python\n(.*?)```", card, flags=re.S)


def needed_libraries(code: str) -> list[str]:
    return [lib for lib in _LIBRARIES
            if re.search(rf"^\s*(from|import) {lib}\b", code, flags=re.M)]


_DRIVER = """import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
for i, code in enumerate(blocks):
    try:
        exec(compile(code, f"<card snippet {i}>", "exec"), {"__name__": "__main__"})
    except BaseException:
        print(f"card snippet {i} failed:\\n{code}\\n{traceback.format_exc()}", file=sys.stderr)
        sys.exit(1)
"""


def run_card_snippets(card: str, names: dict[str, str], tmp_path: Path,
                      stand_ins: Path | None = None) -> dict[str, list]:
    """Run every Python block of ``card`` after replacing each key of ``names`` (a folder or
    base-model name the card shows, quoted) by its value, each block in a fresh namespace
    of one new interpreter (offline); returns ``{"ran": [...], "skipped": [(first line,
    reason)]}``. A block that raises fails the test, naming it. ``stand_ins``: a folder of
    modules put first on the path (a library's stand-in where it cannot be installed)."""
    import json

    ran, skipped = [], []
    for code in python_blocks(card):
        missing = [lib for lib in needed_libraries(code)
                   if importlib.util.find_spec(lib) is None
                   and not (stand_ins is not None and (stand_ins / lib).is_dir())]
        if missing:
            skipped.append((code.splitlines()[0], f"{', '.join(missing)} not installed"))
            continue
        for shown, real in names.items():
            code = code.replace(repr(shown), repr(real))
        ran.append(code)
    (tmp_path / "snippets.json").write_text(json.dumps(ran))
    (tmp_path / "run_snippets.py").write_text(_DRIVER)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if stand_ins is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(stand_ins), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(tmp_path / "run_snippets.py"),
                           str(tmp_path / "snippets.json")], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return {"ran": ran, "skipped": skipped}


def machine_paths(card: str, *roots: Path) -> list[str]:
    """Absolute paths in ``card``: any of ``roots`` (the test's folders), and any quoted
    or backticked text that starts with ``/``."""
    found = [str(r) for r in roots if str(r) in card]
    found += re.findall(r"[`'\"](/[^`'\"\s]+)", card)
    return found
