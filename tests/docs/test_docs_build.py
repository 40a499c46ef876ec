"""The documentation site builds with ``mkdocs build --strict`` (what ``make docs`` runs): a
broken link, a docstring cross-reference that names nothing or a docstring that does not
render fails it. The CLI reference is generated from the command's parser, so each
subcommand's flags are on the page; the API reference is rendered from the docstrings.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings_handlers.python")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(out), "--config-file", str(ROOT / "mkdocs.yml")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stderr[-5000:]}"
    return out


def test_site_builds_strict_with_api_and_cli_reference(site):
    from bigbatch.cli import build_parser

    cli = (site / "reference" / "cli" / "index.html").read_text()
    for sub in build_parser()._subparsers._group_actions[0].choices:
        assert f"bigbatch {sub}" in cli
    for flag in ("--grad-cache-chunk", "--num-hard-negatives", "--rank-window", "--allow-lossy"):
        assert flag in cli, flag
    engine = (site / "reference" / "api" / "engine" / "index.html").read_text()
    assert 'id="bigbatch.engine.gradcache.GradCache.step"' in engine
    assert "Sphinx" not in engine and ":class:`" not in engine and ":meth:`" not in engine
    assert (site / "getting-started" / "index.html").is_file()


def test_cli_reference_says_what_help_says():
    from cli_reference import cli_markdown

    from bigbatch.cli import build_parser

    text = cli_markdown()
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    for action in train._actions:
        for flag in action.option_strings:
            if flag in ("-h", "--help"):
                continue
            assert f"`{flag}" in text, flag


def test_rst_literal_markers_read_as_sphinx_prints_them():
    from sphinx_roles import literal_markers

    assert literal_markers("scale t = 1 / temperature::\n\n    x\n") == \
        "scale t = 1 / temperature:\n\n    x\n"
    assert literal_markers("Example::\n\n    code\n") == "*Example*:\n\n    code\n"
    assert literal_markers("a[::2] stays\n") == "a[::2] stays\n"


def test_docstring_references_resolve_or_are_reported():
    griffe = pytest.importorskip("griffe")
    from sphinx_roles import _resolve

    pkg = griffe.load("bigbatch", search_paths=[str(ROOT / "src")])
    cache = pkg["engine.gradcache"]
    assert _resolve(cache["GradCache"], "split_inputs", pkg) == \
        "bigbatch.engine.gradcache.GradCache.split_inputs"
    assert _resolve(cache, "RandContext", pkg) == "bigbatch.engine.rng.RandContext"
    assert _resolve(pkg["losses.maxsim"]["MaxSimInfoNCE"], "clamp_", pkg) == \
        "bigbatch.losses.base.TemperatureLoss.clamp_"  # inherited: where it is defined
    assert _resolve(cache, "no_such_function", pkg) is None
    assert _resolve(pkg["data"]["formats"], ".swift", pkg) == "bigbatch.data.formats.swift"
