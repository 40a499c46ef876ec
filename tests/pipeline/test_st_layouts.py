"""What others write, read right: folders saved by the installed sentence-transformers (6's
layout: module types under ``sentence_transformers.base`` / ``.sentence_transformer``,
``pooling_mode`` and ``embedding_dimension`` in the Pooling config, the max length in
``tokenizer_config.json``) embed in bigbatch as in sentence-transformers, and ``bigbatch
eval`` of such a model equals sentence-transformers' own InformationRetrievalEvaluator on a
SciFact slice; what bigbatch cannot reproduce is refused, naming it (trap 3 of issue 34)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from pipeline_helpers import SCIFACT, minilm_path, scifact_slice, tiny_bert

from bigbatch.encoders import load_encoder
from bigbatch.errors import ConfigError

TEXTS = ["a short claim", "tumor suppression by p53 " * 40]  # the second is cut at 100 tokens


def _st_model(base, pooling: str, max_seq_length: int = 100, normalize: bool = True):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    t = Transformer(str(base), max_seq_length=max_seq_length)
    modules = [t, Pooling(t.get_embedding_dimension(), pooling_mode=pooling)] + (
        [Normalize()] if normalize else [])
    return SentenceTransformer(modules=modules, device="cpu",
                               prompts={"query": "query: ", "document": "passage: "})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_bert(tmp_path_factory.mktemp("tiny") / "bert", dropout=0.0)


@pytest.fixture(scope="module")
def st_cls(tiny, tmp_path_factory):
    """A CLS-pooled model saved by the installed sentence-transformers (its own layout)."""
    folder = tmp_path_factory.mktemp("st") / "cls"
    _st_model(tiny, "cls").save(str(folder))
    return folder


@pytest.mark.parametrize("pooling", ["cls", "mean", "lasttoken"])
def test_a_sentence_transformers_folder_embeds_as_sentence_transformers(tiny, tmp_path, pooling):
    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "st"
    _st_model(tiny, pooling).save(str(folder))
    enc = load_encoder(folder)
    assert (enc.pooling, enc.max_length, enc.normalize) == (
        {"lasttoken": "last"}.get(pooling, pooling), 100, True)
    assert (enc.query_prefix, enc.doc_prefix) == ("query: ", "passage: ")
    st = SentenceTransformer(str(folder), device="cpu")
    for side, name in (("query", "query"), ("doc", "document")):
        want = torch.tensor(st.encode(TEXTS, prompt_name=name))
        assert torch.equal(enc.encode(TEXTS, side=side), want)


def test_the_max_length_follows_sentence_transformers_rules(tiny, tmp_path):
    """Where the folder says nothing, sentence-transformers takes the tokenizer's
    model_max_length cut to the model's positions (128 for the tiny BERT)."""
    from bigbatch.encoders.loading import st_max_length

    folder = tmp_path / "st"
    _st_model(tiny, "mean").save(str(folder))
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok["model_max_length"] == 100 and st_max_length(folder) == 100
    tok["model_max_length"] = 10 ** 30  # "no limit": the positions decide
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    assert st_max_length(folder) == 128
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48}))
    assert st_max_length(folder) == 48  # the layout before sentence-transformers 6 wins


@pytest.mark.parametrize("edit,match", [
    (lambda f: _pool(f, {"embedding_dimension": 32, "pooling_mode": "max"}),
     r"pooling_mode \['max'\] is not supported"),
    (lambda f: _pool(f, {"embedding_dimension": 32, "pooling_mode": ["cls", "mean"]}),
     r"pooling_mode \['cls', 'mean'\] is not supported"),
    (lambda f: _pool(f, {"embedding_dimension": 64, "pooling_mode": "cls"}),
     "embedding_dimension 64 is not the model's hidden size 32"),
    (lambda f: _pool(f, {"embedding_dimension": 32, "pooling_mode": "cls",
                         "include_prompt": False}), "include_prompt false"),
    (lambda f: _modules(f, "sentence_transformers.base.modules.dense.Dense", "2_Dense"),
     r"module\(s\) \['sentence_transformers.base.modules.dense.Dense'\] are not supported"),
    (lambda f: _modules(f, "sentence_transformers.base.modules.router.Router", "2_Router"),
     "Router'] are not supported"),
    (lambda f: _sbc(f, {"transformer_task": "text-generation"}),
     "transformer_task 'text-generation' is not supported"),
    (lambda f: _sbc(f, {"modality_config": {"text": {"method": "forward",
                                                     "method_output_name": "pooler_output"}}}),
     "text embedded by .*pooler_output.* is not supported"),
])
def test_what_bigbatch_cannot_reproduce_is_refused(st_cls, tmp_path, edit, match):
    folder = tmp_path / "st"
    shutil.copytree(st_cls, folder)
    edit(folder)
    with pytest.raises(ConfigError, match=match):
        load_encoder(folder)


def _pool(folder, cfg):
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(cfg))


def _modules(folder, kind, path):
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": len(modules), "name": str(len(modules)), "path": path, "type": kind})
    (folder / "modules.json").write_text(json.dumps(modules))


def _sbc(folder, cfg):
    (folder / "sentence_bert_config.json").write_text(json.dumps(cfg))


@pytest.mark.skipif(not SCIFACT.exists(), reason="SciFact not available")
def test_bigbatch_eval_equals_sentence_transformers_evaluator(tmp_path):
    """The trap's signature: a CLS model at max length 100 read as mean pooling at 256 gave
    nDCG@10 0.9069 in `bigbatch eval` where sentence-transformers' evaluator gave 0.8892.
    all-MiniLM-L6-v2 with CLS pooling (a random tiny BERT's CLS vectors are all alike, so
    its rankings are ties)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    from bigbatch.cli import main
    from bigbatch.data.readers.beir_dir import load_beir

    folder = tmp_path / "minilm-cls"
    _st_model(minilm_path(), "cls").save(str(folder))
    data = scifact_slice(tmp_path / "slice", n_train=8, n_test=30, n_extra_docs=150)
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(folder), "--data", str(data), "--no-cache",
                 "--output", str(out)]) == 0
    ours = json.loads(out.read_text())[0]["metrics"]
    beir = load_beir(data, "test")
    relevant = {q: {d for d, s in docs.items() if s > 0} for q, docs in beir.qrels.items()}
    evaluator = InformationRetrievalEvaluator(
        {q: beir.queries[q] for q in relevant}, beir.corpus, relevant,
        query_prompt_name="query", corpus_prompt_name="document", ndcg_at_k=[10],
        mrr_at_k=[10], accuracy_at_k=[1], precision_recall_at_k=[10], map_at_k=[10],
        write_csv=False)
    theirs = evaluator(SentenceTransformer(str(folder), device="cpu"))
    assert ours["ndcg@10"] == pytest.approx(theirs["cosine_ndcg@10"], abs=1e-6)
    assert ours["mrr@10"] == pytest.approx(theirs["cosine_mrr@10"], abs=1e-6)
    assert ours["recall@10"] == pytest.approx(theirs["cosine_recall@10"], abs=1e-6)
