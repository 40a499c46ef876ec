"""Training a vision-language retriever end to end on rendered SciFact pages with a tiny
Qwen-VL model: image records (``chunk_path`` / ``neg_chunk_paths``) checked before training,
``bigbatch train`` running, evaluating, saving and resuming exactly, query-side tuning with
both backward paths (exact, document tower untouched), and the corpus-negatives mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import DT, grads_of, max_rel_err, zero_grads
from pipeline_helpers import scifact_slice, tiny_bert

import bigbatch as bb
from bigbatch.cli import main
from bigbatch.data import load_records
from bigbatch.data.records.image_checks import ImageDoc, doc_key
from bigbatch.train import TrainConfig, train


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """A 40-pair SciFact slice rendered to 224 x 224 pages, 1 random negative per record."""
    from bigbatch.data.tools.pages import render_beir_pages

    root = tmp_path_factory.mktemp("vl_pages")
    src = scifact_slice(root / "src", n_train=40, n_test=12, n_extra_docs=20)
    render_beir_pages(src, root / "pages", num_negatives=1, size=(224, 224), font_size=9,
                      progress=False)
    return root / "pages"


def stop_after(n):
    """An ``on_step_end`` callback that ends the run right after step ``n`` (its checkpoint
    written, if one was due), as a kill would."""
    return lambda step, state: step >= n


def _config(model, data, out, **kw):
    base = dict(model=str(model), train_data=str(data), output_dir=str(out), batch_size=4,
                grad_cache_chunk=2, max_steps=4, warmup_steps=1, save_steps=2, eval_steps=0,
                eval_at_start=False, lora_r=4, lora_alpha=8, lr=1e-3, max_length=32, seed=3,
                max_num_visual_tokens=16, save_total_limit=5, eval_batch_size=8)
    base.update(kw)
    return TrainConfig(**base)


def _losses(out):
    rows = [json.loads(l) for l in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def test_rendered_pages_are_a_beir_set_with_image_records(pages):
    recs = load_records(pages / "train.jsonl", num_hard_negatives=1)
    assert len(recs) == 40
    assert all(isinstance(r.positive, ImageDoc) and Path(r.positive.path).exists() for r in recs)
    assert all(len(r.negatives) == 1 and isinstance(r.negatives[0], ImageDoc) for r in recs)
    corpus = [json.loads(l) for l in (pages / "corpus.jsonl").read_text().splitlines()]
    assert all((pages / c["image"]).exists() for c in corpus)
    beir = load_records(pages)  # the BEIR directory itself: image positives too
    assert isinstance(beir[0].positive, ImageDoc)


def test_missing_or_broken_image_reported_with_file_and_line(pages, tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    good = json.loads((pages / "train.jsonl").read_text().splitlines()[0])
    good["chunk_path"] = str(pages / good["chunk_path"])
    good["neg_chunk_paths"] = [str(pages / p) for p in good["neg_chunk_paths"]]
    lines = [good, dict(good, chunk_path="missing.png"),
             dict(good, neg_chunk_paths=["broken.png"])]
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(bb.DataError) as e:
        load_records(f)
    msg = str(e.value)
    assert f"{f}:2" in msg and "chunk_path" in msg and "missing.png" in msg
    assert f"{f}:3" in msg and "neg_chunk_paths[0]" in msg and "broken.png" in msg


def test_image_records_with_a_text_model_stop_before_training(pages, tmp_path):
    tiny = tiny_bert(tmp_path / "bert")
    with pytest.raises(bb.ConfigError, match="image documents.*text model"):
        train(_config(tiny, pages / "train.jsonl", tmp_path / "out", encoder="text"))


def test_train_evaluate_save_and_resume_exactly(tiny_vl, pages, tmp_path):
    model = tiny_vl("qwen3_vl", dropout=0.1)
    kw = dict(num_hard_negatives=1, eval_data=str(pages))
    straight = train(_config(model, pages / "train.jsonl", tmp_path / "a", **kw))
    assert straight["final"]["ndcg@10"] >= 0 and (tmp_path / "a" / "final").exists()
    meta = json.loads((tmp_path / "a" / "final" / "bigbatch_encoder.json").read_text())
    assert meta["encoder"] == "vision-language" and meta["max_num_visual_tokens"] == 16
    train(_config(model, pages / "train.jsonl", tmp_path / "b", **kw), on_step_end=stop_after(2))
    train(_config(model, pages / "train.jsonl", tmp_path / "b", resume=str(tmp_path / "b"), **kw))
    la, lb = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert sorted(la) == sorted(lb) == [1, 2, 3, 4]
    for s in la:
        assert abs(la[s] - lb[s]) <= 1e-6, (s, la[s], lb[s])


def test_command_line_query_side_tune_with_corpus_negatives(tiny_vl, pages, tmp_path, capsys,
                                                           monkeypatch):
    monkeypatch.setenv("BIGBATCH_CACHE", str(tmp_path / "cache"))
    model = tiny_vl("qwen2_vl")
    out = tmp_path / "run"
    argv = ["train", "--model", str(model), "--train-data", str(pages),
            "--eval-data", str(pages), "--output-dir", str(out), "--batch-size", "4",
            "--grad-cache-chunk", "2", "--max-steps", "2", "--warmup-steps", "1",
            "--lora-r", "4", "--max-num-visual-tokens", "16", "--mode", "query-side-tune",
            "--doc-negatives", "corpus", "--query-side-backward", "gradcache",
            "--eval-batch-size", "8", "--save-steps", "0"]
    code = main(argv)
    text = capsys.readouterr().out
    assert code == 0, text
    assert "query-side-tune (gradcache backward, corpus negatives:" in text
    cached = list((tmp_path / "cache" / "embeddings").glob("corpus-*.pt"))
    assert len(cached) == 1
    # a second run (or a resume) loads the frozen tower's corpus embeddings
    assert main(argv[:argv.index("--output-dir") + 1] + [str(tmp_path / "again")]
                + argv[argv.index("--output-dir") + 2:]) == 0
    assert f"training corpus embeddings loaded from {cached[0]}" in capsys.readouterr().out
    meta = json.loads((out / "final" / "bigbatch_encoder.json").read_text())
    assert meta["doc_tower"] == "base"
    from bigbatch.encoders import load_encoder
    enc = load_encoder(out / "final")
    assert enc.doc_tower == "base"
    with torch.no_grad():  # documents are embedded by the base weights, queries are not
        base = bb.encoders.VisionLanguageEncoder(model, max_num_visual_tokens=16).eval()
        page = ImageDoc(str(next((pages / "images").iterdir())))
        assert torch.allclose(enc.encode([page], "doc"), base.encode([page], "doc"), atol=1e-6)
        assert not torch.allclose(enc.encode(["a claim"], "query"),
                                  base.encode(["a claim"], "query"), atol=1e-4)


@pytest.mark.parametrize("backward", ["direct", "gradcache"])
def test_query_side_tune_text_full_finetune_exact(tmp_path, backward):
    """Full fine-tuning: the document tower is a frozen copy; both backward paths give the
    reference gradient and the copy receives none."""
    from bigbatch.encoders import TextEncoder

    enc = TextEncoder(tiny_bert(tmp_path / "bert", dropout=0.1), max_length=24).to(DT).train()
    enc.use_base_doc_tower()
    with torch.no_grad():  # the query side has moved away from the base weights
        for p in enc.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    queries = ["heat shock proteins", "ribosome", "the cell cycle checkpoint", "apoptosis",
               "DNA repair"]
    docs = [f"document {i} about {w}" for i, w in enumerate(
        ["proteins", "x", "cells", "a", "repair", "b", "death", "c", "genes", "d"])]
    loss_fn = bb.InfoNCE().to(DT)
    q_chunk = 5 if backward == "direct" else 2
    cache = bb.GradCache({"query": enc, "doc": enc.frozen_doc_tower()}, loss_fn,
                         chunk_size={"query": q_chunk, "doc": 3})
    torch.manual_seed(4)
    zero_grads(enc, loss_fn)
    cache.step(query=enc.tokenize(queries, "query"), doc=enc.tokenize(docs))
    got = grads_of(enc, loss_fn)
    assert all(p.grad is None for p in enc._doc_base.parameters())

    torch.manual_seed(4)
    zero_grads(enc, loss_fn)
    q = torch.cat([enc(**enc.tokenize(queries[i:i + q_chunk], "query"))
                   for i in range(0, 5, q_chunk)])
    d = enc.embed_doc_frozen(**enc.tokenize(docs))
    assert not d.requires_grad
    loss_fn(q, d)[0].backward()
    assert max_rel_err(got, grads_of(enc, loss_fn)) <= 1e-10


def test_mine_page_corpus_then_train_on_the_mined_file(tiny_vl, pages, tmp_path, capsys,
                                                       monkeypatch):
    """`bigbatch mine` over a corpus of page images writes the seed's image keys
    (`chunk_path`, `neg_chunk_paths`, relative to the output), which train reads back as
    images with their corpus ids; a page mined for one query that is another query's
    positive has one id in the batch."""
    monkeypatch.setenv("BIGBATCH_CACHE", str(tmp_path / "cache"))
    model = tiny_vl("qwen2_vl")
    mined = tmp_path / "mined" / "train.jsonl"
    assert main(["mine", "--model", str(model), "--data", str(pages), "--output", str(mined),
                 "--num-negatives", "2", "--rank-window", "0:6", "--max-num-visual-tokens",
                 "16", "--batch-size", "8", "--max-score-ratio", "0"]) == 0  # random model
    capsys.readouterr()
    lines = [json.loads(l) for l in mined.read_text().splitlines()]
    assert lines and all("chunk_path" in r and len(r["neg_chunk_paths"]) == 2 for r in lines)
    assert all(not Path(r["chunk_path"]).is_absolute() for r in lines)
    recs = load_records(mined, num_hard_negatives=2)
    assert all(isinstance(r.positive, ImageDoc) and Path(r.positive.path).exists() for r in recs)
    assert recs[0].positive_id == lines[0]["positive_id"]
    by_id = {r["positive_id"]: r["chunk_path"] for r in lines}
    shared = 0
    for r, line in zip(recs, lines):  # a negative that is another record's positive page
        for nid, neg in zip(line["negative_ids"], r.negatives):
            if nid in by_id:
                shared += 1
                assert Path(neg.path) == (mined.parent / by_id[nid]).resolve()
                assert doc_key(neg) == next(x.positive_key for x in recs
                                            if x.positive_id == nid)
    assert shared > 0
    out = tmp_path / "run"
    assert main(["train", "--model", str(model), "--train-data", str(mined), "--output-dir",
                 str(out), "--batch-size", "4", "--grad-cache-chunk", "4", "--max-steps", "1",
                 "--warmup-steps", "0", "--num-hard-negatives", "2", "--lora-r", "4",
                 "--max-num-visual-tokens", "16", "--save-steps", "0"]) == 0
    assert (out / "final").is_dir()
