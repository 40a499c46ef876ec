"""Every ```python block of every docs/**/*.md page runs: each page's blocks in order, in one
namespace, in a temporary working directory, offline (HF_HUB_OFFLINE=1) and on the CPU only
(no GPU visible), in a fresh process per page against this checkout's src/. A block that
cannot run here (a GPU, a download, minutes of work) is preceded by a line
``<!-- skip: reason -->`` and is not run; the reason is required. Other blocks (bash, yaml,
text) are never run.

``python tests/docs/test_docs_code.py`` prints how many blocks each page runs and skips.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")
SKIP = re.compile(r"^\s*<!--\s*skip\b(?P<rest>.*?)-->\s*$")

# runs the blocks of one page: argv[1] is a JSON list of {"code", "where"}
RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for block in json.loads(open(sys.argv[1]).read()):
    print(f"--- {block['where']}", flush=True)
    exec(compile(block["code"], block["where"], "exec"), namespace)
"""


@dataclass
class Block:
    page: str       # path relative to docs/
    line: int       # line of the opening fence, counted from 1
    code: str
    skip: str | None  # the reason given, "" for a skip marker without one, None: runs

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a Markdown page, with the skip marker each one has.

    A fence inside another fence (a Markdown example in a ````markdown block) is text, and an
    indented fence (in a list or an admonition) is read with its indentation removed.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    page = path.relative_to(DOCS).as_posix()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"].expandtabs())
        lang = m["info"].strip().split(" ")[0].split("{")[0].lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = FENCE.match(lines[i])
            if close and close["fence"][0] == fence[0] and len(close["fence"]) >= len(fence) \
                    and not close["info"].strip():
                break
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        if lang != "python":
            continue
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        skip = SKIP.match(before)
        reason = None
        if skip:
            rest = skip["rest"].strip()
            reason = rest[1:].strip() if rest.startswith(":") else ""
        blocks.append(Block(page, start + 1, "\n".join(body) + "\n", reason))
    return blocks


def all_blocks() -> list[Block]:
    return [b for p in sorted(DOCS.rglob("*.md")) for b in python_blocks(p)]


PAGES = sorted({b.page for b in all_blocks() if b.skip is None})


def test_skip_markers_give_a_reason():
    bare = [b.where for b in all_blocks() if b.skip == ""]
    assert not bare, f"<!-- skip: reason --> needs its reason: {bare}"


def test_the_reader_finds_blocks_and_skips(tmp_path, monkeypatch):
    """The reader itself: runnable, skipped, nested and indented blocks."""
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "```python", "a = 1", "```",
        "<!-- skip: needs a GPU -->", "", "```python", "b = 2", "```",
        "````markdown", "```python", "not = run", "```", "````",
        "- item", "", "    ```python", "    c = a + 1", "    ```",
        "```bash", "echo no", "```",
        "<!-- skip -->", "```python", "d = 4", "```",
    ]) + "\n")
    monkeypatch.setattr(sys.modules[__name__], "DOCS", tmp_path)
    blocks = python_blocks(page)
    assert [(b.line, b.code, b.skip) for b in blocks] == [
        (1, "a = 1\n", None), (6, "b = 2\n", "needs a GPU"), (16, "c = a + 1\n", None),
        (23, "d = 4\n", "")]


# `make test-all` runs these: JAX's first compilations; the trainers the integration tests
# already run
SLOW_PAGES = {"guides/jax.md", "guides/integrations.md"}


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_PAGES
                                  else p for p in PAGES])
def test_page_code_blocks_run(page, tmp_path):
    blocks = [b for b in python_blocks(DOCS / page) if b.skip is None]
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([{"code": b.code, "where": b.where} for b in blocks]))
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               CUDA_VISIBLE_DEVICES="", MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", RUNNER, str(spec)], cwd=work, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (f"a python block of docs/{page} failed:\n"
                                 f"{out.stdout[-3000:]}\n{out.stderr[-4000:]}")


if __name__ == "__main__":
    counts: dict[str, list[int]] = {}
    for b in all_blocks():
        counts.setdefault(b.page, [0, 0])[b.skip is not None] += 1
    for page, (run, skipped) in counts.items():
        print(f"docs/{page}: {run} run, {skipped} skipped")
    print(f"total: {sum(c[0] for c in counts.values())} run, "
          f"{sum(c[1] for c in counts.values())} skipped, on {len(counts)} pages")
