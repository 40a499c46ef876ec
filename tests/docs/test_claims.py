"""Every headline figure of the README and the guides is the one its result file in
``bench/results/`` holds, ``docs/benchmarks.md`` is what ``bench/report.py`` writes from those
files, and no page (README, docs, configs, the generated benchmarks page) carries wording
that is not for users: how the figures came to be instead of what they are, the project's
own notes, machine paths, issue numbers without a repository."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))

# (pattern, why it is not for users); case-insensitive
FORBIDDEN = [
    (r"no GPU was lent|lent to (this|the) project|\bsessions?\b", "the project's own circumstances"),
    (r"\bthe seed\b", "the project's own notes (name the script or the option)"),
    (r"\b00\d_", "a note of the project's own (`003_...`)"),
    (r"DESIGN\.md|\.\./shared/(?!data/scifact)", "a file beside the clone that users do not have"),
    (r"paths on this machine|this machine|installed here", "the machine that wrote the page"),
    (r"earlier environment|as before|no longer", "how it came to be, not what it is"),
    (r"(?<![\w.])/(work|tmp|root|home)/\w", "a machine path"),
    (r"(?<![\w/#&-])#\d+\b|\bissue \d+", "an issue number without its repository"),
]


def pages() -> list[Path]:
    docs = [p for p in (ROOT / "docs").rglob("*.md")]
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *docs,
            *sorted((ROOT / "configs").glob("*.yaml"))]


def findings(text: str, where: str) -> list[str]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern, why in FORBIDDEN:
            if m := re.search(pattern, line, flags=re.I):
                out.append(f"{where}:{n}: {m.group(0)!r} ({why})")
    return out


def test_no_page_says_what_is_not_for_users():
    found = [f for p in pages() for f in findings(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "\n".join(found)


def test_the_check_finds_each_kind_of_wording():
    for text in ("no GPU was lent to the sessions", "the seed pipeline", "the `003_...` report",
                 "see ../shared/DESIGN.md", "paths on this machine", "in an earlier environment",
                 "read whole, as before", "memory no longer grows", "--work /tmp/evm",
                 "/work/pylate-venv/bin/python", "fixed in #3531", "since issue 28"):
        assert findings(text, "x"), text
    for text in ("sentence-transformers#3531", "luyug/GradCache#37", "--seed 42",
                 "the same seed", "../shared/data/scifact", "/path/to/pylate-venv",
                 "[x](page.md#anchor-1)", "`data/scifact`"):
        assert not findings(text, "x"), text


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("bench-docs")
    subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), "--results", str(RESULTS),
                    "--docs", str(out)], check=True, capture_output=True, text=True, timeout=300)
    return out / "benchmarks.md"


def test_the_benchmarks_page_is_what_the_report_writes(generated):
    assert generated.read_text() == (ROOT / "docs" / "benchmarks.md").read_text(), (
        "docs/benchmarks.md differs from `python bench/report.py`'s output: run it")
    assert not findings(generated.read_text(), "generated benchmarks.md")


def result(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def text(page: str) -> str:
    return " ".join((ROOT / page).read_text().split())  # wrapped lines joined


def has(page: str, *figures: str) -> None:
    body = text(page)
    missing = [f for f in figures if f not in body]
    assert not missing, f"{page} does not state {missing} (read from bench/results)"


def demo_rows() -> list[str]:
    """The four rows of make demo's table, as the README prints them, from recipes-cpu.json."""
    runs = result("recipes-cpu.json")["runs"]
    keys = ("ndcg@10", "recall@1", "recall@5", "recall@10", "mrr@10", "margin")
    rows = []
    for prefix, label in (("", "full test split (300)"), ("unseen/", "unseen-document queries (104)")):
        for run, name in (("base", "base"), ("demo", "fine-tuned")):
            m = runs[run]["rows"][0]["metrics"]
            rows.append(f"{name}, {label} " + " ".join(f"{m[prefix + k]:.4f}" for k in keys))
    return rows


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_demo_table_and_times_are_the_recorded_runs(page):
    has(page, "bench/results/recipes-cpu.json", *demo_rows())
    runs = result("recipes-cpu.json")["runs"]
    train = runs["demo"]["train_seconds"] / 60
    evals = sorted(runs[r]["eval_seconds"] / 60 for r in ("base", "demo"))
    has(page, f"training took {train:.1f} minutes",
        f"each full-corpus evaluation {evals[0]:.1f} to {evals[1]:.1f} minutes")
    if page == "README.md":
        has(page, f"raises the 0.6810 to {runs['hn1']['rows'][0]['metrics']['ndcg@10']:.4f}")


def test_the_readme_headline_is_read_from_its_result_files():
    from report import speed_summary

    equal = speed_summary(result("speed-cpu-fp32-equal.json"))
    real = speed_summary(result("speed-cpu-fp32-real.json"))
    bound = equal["ratios"]["c_over_FB"] / equal["bound_F_plus_FB_over_FB"]
    st = sorted(s["ratios"]["b_over_c"] for s in (equal, real))
    floors = sorted(s["ceiling_b_over_c_at_floors"] for s in (equal, real))
    has("README.md", f"**{bound:.2f}x** the time", f"**{real['ratios']['d_over_a']:.2f}x** the time",
        f"{st[0]:.2f}x to {st[1]:.2f}x bigbatch's", f"allow any exact one-chunk GradCache "
        f"{floors[0]:.2f}x to {floors[1]:.2f}x")
    tiny = {(r["batch"], r["mode"]): r for r in result("memory-cpu-tiny-bert.json")["rows"]}
    added = {b: tiny[b, "streamed"]["peak_rss_mb"] - tiny[b, "streamed"]["rss_before_step_mb"]
             for b in (256, 16384)}
    has("README.md", f"added {added[256]:.0f} MB to the process at batch 256 and "
        f"{added[16384]:.0f} MB at 16,384", f"against {tiny[256, 'streamed']['estimate_mb']:.0f} MB "
        f"and {tiny[16384, 'streamed']['estimate_mb']:.0f} MB",
        f"**{tiny[16384, 'streamed']['ratio']:.2f}x**",
        f"peaked at {tiny[1024, 'streamed']['peak_rss_mb']:,.0f} MB, plain full-batch training at "
        f"{tiny[1024, 'plain']['peak_rss_mb']:,.0f} MB",
        f"{result('memory-cpu-65536.json')['rows'][0]['peak_rss_mb']:,.0f} MB")
    body = text("README.md")
    assert "Measured with `make bench`" not in body and "a quick check" in body


@pytest.mark.parametrize("page, name", [
    ("configs/demo_mix.yaml", "demo-mix-scifact.json"),
    ("docs/guides/multi-dataset.md", "demo-mix-scifact.json"),
    ("docs/guides/multivector.md", "demo-colbert-scifact.json"),
])
def test_demo_times_are_their_records(page, name):
    has(page, f"{result(name)['wall_minutes']} minutes")


def test_the_mining_counts_are_the_recorded_report():
    rec = result("mining-scifact-k3.json")
    r = rec["report"]
    for page in ("docs/guides/mining.md", "docs/recipes.md"):
        has(page, "bench/results/mining-scifact-k3.json", f"{r['records']:,} records",
            f"{r['dropped_as_false_negative']:,}", f"{r['candidates_seen']:,}",
            f"{r['skipped_records']}", f"{rec['seconds'] / 60:.1f} minutes")
    has("docs/guides/mining.md", f"{r['queries']} queries", f"{r['dropped_as_positive']}",
        f"{r['negatives_written']:,} negatives")


def test_the_recipe_study_table_is_its_results_file():
    """Every row of docs/recipes.md's results table is what ``bench/recipes.py --table``
    prints from bench/results/recipes-cpu.json: no measured run is missing from the page,
    and no figure on it differs from the record."""
    from recipes import table

    has("docs/recipes.md", *table(result("recipes-cpu.json")["runs"]).splitlines())


def test_the_cpu_bf16_cost_is_its_record():
    ratio = f"{result('cpu-bf16.json')['bf16_over_fp32']:.1f}x"
    for page in ("docs/troubleshooting.md", "configs/demo_scifact.yaml"):
        has(page, ratio, "bench/results/cpu-bf16.json")
    assert not re.search(r"~1[01]x", text("docs/getting-started.md") + text("configs/demo_scifact.yaml"))


def test_the_allocator_table_is_its_record():
    """docs/choosing-sizes.md's allocator rows (median step, page faults, peak resident
    memory of each setting and chunk plan) and the ratios drawn from them are
    bench/results/cpu-allocator.json's."""
    from cpu_allocator import SETTINGS

    rows = result("cpu-allocator.json")["rows"]
    names = {"default": "glibc as it comes",
             **{k: "`" + " ".join(f"{a}={b}" for a, b in v.items()) + "`"
                for k, v in SETTINGS.items() if v}}
    figures = ["bench/results/cpu-allocator.json"]
    for setting, r in rows.items():
        for plan, s in r["summary"].items():
            q, d = plan.split("/")
            figures.append(f"| {names[setting]} | {q} / {d} | {s['median_wall_s']:.1f} s | "
                           f"{s['median_minor_faults']:,.0f} | {r['peak_rss_mb']:,.0f} MB |")
    small, large = (rows[k]["summary"] for k in ("default", "heap"))
    figures += [f"{small['16/36']['median_wall_s'] / small['16/16']['median_wall_s']:.2f}x",
                f"{large['16/36']['median_wall_s'] / large['16/16']['median_wall_s']:.2f}x",
                f"{large['16/36']['median_wall_s'] / small['16/16']['median_wall_s']:.2f}x"]
    has("docs/choosing-sizes.md", *figures)
