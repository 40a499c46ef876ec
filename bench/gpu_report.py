"""The GPU section of docs/benchmarks.md, from what ``make bench-gpu`` (``bench/gpu.sh``) wrote
into its results folder: the checks (float64 exactness, bf16 against float32), step time at
batch 2,048 against plain training and sentence-transformers' cached loss (and PyLate's),
peak memory against batch size, and ``bigbatch train`` with the demo's recipe.

    python bench/gpu_report.py --results bench/results/gpu --docs docs/benchmarks.md

The section sits between two marker lines in the page (added at its end the first time), so
``bench/report.py``, which writes the rest of the page, keeps it (it calls :func:`section`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT

START, END = "<!-- bench-gpu: start -->", "<!-- bench-gpu: end -->"
GPU_RESULTS = RESULTS / "gpu"
SPEED_LABELS = {"a_plain_full_batch": "plain full batch", "b_st_cached_mnrl":
                "sentence-transformers CachedMNRL", "c_bigbatch": "bigbatch GradCache",
                "d_bigbatch_sorted": "bigbatch, length-ordered (as `bigbatch train`)"}


def _load(folder: Path, pattern: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob(pattern))]


def _where(r: dict) -> str:
    m, s = r["machine"], r.get("settings", {})
    model = s.get("weights") or s.get("model") or r.get("note", "")
    return f"{m.get('gpu', m['device'])}, torch {m['torch']}, {r['date'][:10]}; {model}"


def checks_lines(r: dict) -> list[str]:
    ex, bf = r["exactness"], r["bf16_vs_fp32"]
    lines = ["### Checks", "", f"`{r['command']}` ({_where(r)}).", "",
             f"Float64, dropout on and replayed by the device's generator: the largest relative "
             f"gradient error against the unchunked reference is **{ex['max_rel_err']:.2g}** "
             f"over {len(ex['cases'])} cases (bound {ex['bound']:g}: "
             f"{'passed' if ex['passed'] else 'FAILED'}).", "",
             "| case | chunks (queries / documents) | max relative error |", "|---|---|---|"]
    for c in ex["cases"]:
        sizes = f"{c['sizes']['query']} / {c['sizes']['doc']}" + (
            f", {c['tokens']['doc']} tokens" if c.get("tokens") else "")
        lines.append(f"| {c['case']} | {sizes} | {c['max_rel_err']:.2g} |")
    lines += ["", f"bf16 autocast against float32 ({r['settings']['batch']} pairs, chunk "
              f"{r['settings']['chunk']}, dropout off): the cosine of each parameter's gradient "
              f"is {bf['median']:.5f} at the median and {bf['min']:.5f} at the lowest "
              f"({next(iter(bf['worst']))}) over {bf['parameters']} parameters "
              f"({len(bf['left_out'])} left out: their gradient is zero analytically).", ""]
    return lines


def speed_lines(runs: list[dict]) -> list[str]:
    if not runs:
        return []
    s0 = runs[0]["settings"]
    lines = ["### Step time", "",
             f"Batch {s0['batch']:,}, SciFact's real lengths cut at {s0['max_length']}, "
             f"{s0['dtype']}, the fastest of {s0['repeats']} interleaved rounds "
             f"({_where(runs[0])}). Seconds per optimizer step:", "",
             "| chunk | " + " | ".join(SPEED_LABELS.values()) + " | bigbatch / plain |",
             "|---|" + "---|" * (len(SPEED_LABELS) + 1)]
    for r in sorted(runs, key=lambda r: (r["settings"].get("auto") is not None,
                                         r["settings"]["chunk"])):
        sec, s = r["seconds"], r["settings"]
        auto = s.get("auto")
        chunk = (f"auto ({'plain, one pass' if auto['plain'] else auto['sizes']['doc']}; "
                 f"budget {auto['budget_mb']:,.0f} MB)" if auto else str(s["chunk"]))
        lines.append(f"| {chunk} | " + " | ".join(f"{sec[k]:.3f}" for k in SPEED_LABELS)
                     + f" | {sec['d_bigbatch_sorted'] / sec['a_plain_full_batch']:.2f}x |")
    lines += ["", "Commands: " + "; ".join(f"`{r['command']}`" for r in runs) + ".", ""]
    return lines


def pylate_lines(runs: list[dict]) -> list[str]:
    lines = []
    for r in runs:
        sec = r.get("seconds", {})
        text = ", ".join(f"{k} {v:.3f} s" for k, v in sec.items())
        lines += ["### Late interaction: PyLate", "", f"`{r['command']}` ({_where(r)}): {text}.",
                  ""]
    return lines


def memory_lines(runs: list[dict]) -> list[str]:
    if not runs:
        return []
    r = runs[0]
    s = r["settings"]
    key = "peak_cuda_mb" if s["device"].startswith("cuda") else "peak_rss_mb"
    what = "CUDA memory allocated" if "cuda" in key else "resident memory"
    lines = ["### Peak memory against batch size", "",
             f"`{r['command']}` ({_where(r)}): the peak {what} of one step, in MB (each point "
             f"in its own process; chunk {s['chunk']}, max length {s['max_length']}).", "",
             "| batch | bigbatch (streamed loss) | bigbatch (dense loss) | plain full batch |",
             "|---|---|---|---|"]
    for b in sorted({x["batch"] for x in r["rows"]}):
        cells = []
        for mode in ("streamed", "dense", "plain"):
            x = next((x for x in r["rows"] if x["batch"] == b and x["mode"] == mode), None)
            cells.append("-" if x is None else "failed" if "failed" in x
                         else f"{x[key]:,.0f}")
        lines.append(f"| {b:,} | " + " | ".join(cells) + " |")
    return lines + [""]


def train_lines(runs: list[dict]) -> list[str]:
    lines = []
    for r in runs:
        evals = {e["step"]: e for e in r["evals"] if "ndcg@10" in e}
        base, final = evals.get(0), evals.get(max(evals, default=-1))
        score = "no evaluation" if final is None else \
            f"nDCG@10 {final['ndcg@10']:.4f} after" if base is None or base is final else \
            f"nDCG@10 {base['ndcg@10']:.4f} before and {final['ndcg@10']:.4f} after"
        lines += ["### `bigbatch train`, the demo's recipe", "",
                  f"`{r['command']}` ({_where(r)}): {r['train_steps']} steps in "
                  f"{r['seconds']:.0f} s (evaluations included), {score}.", ""]
    return lines


def section(folder: Path = GPU_RESULTS) -> list[str]:
    """The section's lines between its markers (empty when the folder holds no results)."""
    if not folder.is_dir() or not any(folder.glob("*.json")):
        return []
    lines = [START, "## GPU", "",
             "Produced by `make bench-gpu` (`bench/gpu.sh`; `bash bench/gpu.sh --dry` runs the "
             "same script on the CPU with tiny shapes). Raw results: the `.json` files beside "
             "this section's run.", ""]
    for r in _load(folder, "checks-*.json"):
        lines += checks_lines(r)
    lines += speed_lines(_load(folder, "speed-[0-9a]*.json"))
    lines += pylate_lines(_load(folder, "speed-multivector*.json"))
    lines += memory_lines(_load(folder, "memory*.json"))
    lines += train_lines(_load(folder, "train-*.json"))
    return lines + [END]


def write(page: Path, lines: list[str]) -> None:
    """Put the section into ``page``: between its markers, else at the end (a new page when
    there is none)."""
    text = page.read_text() if page.exists() else "# Benchmarks\n"
    block = "\n".join(lines)
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    page.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(GPU_RESULTS))
    ap.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"))
    args = ap.parse_args()
    lines = section(Path(args.results))
    if not lines:
        sys.exit(f"no results in {args.results}")
    write(Path(args.docs), lines)
    print(f"wrote the GPU section of {args.docs}")


if __name__ == "__main__":
    main()
