"""The cases of test_multivector_split.py, run in 2 spawned gloo ranks: a late-interaction
(ColBERT-style) text model's evaluation and mining with the corpus split over the ranks,
against the same model on one process."""

from __future__ import annotations

import json

import torch


def _encoder(model_path):
    from bigbatch.encoders import MultiVectorTextEncoder

    torch.manual_seed(0)
    return MultiVectorTextEncoder(model_path, dim=16, max_length=32).eval()


def _counting(enc):
    """``enc`` with the documents its ``encode_tokens`` was given counted in ``seen``."""
    seen = []
    inner = enc.encode_tokens

    def encode_tokens(texts, side="doc", *args, **kw):
        if side == "doc":
            seen.extend(texts)
        return inner(texts, side, *args, **kw)

    enc.encode_tokens = encode_tokens
    return seen


def eval_case(model_path, beir_dir):
    """evaluate_beir split over the ranks (each rank stores and scores its share of the
    corpus) against the whole corpus on this process."""
    from bigbatch.retrieval.distributed_eval import split_over_ranks
    from bigbatch.retrieval.evaluate import evaluate_beir

    enc = _encoder(model_path)
    seen = _counting(enc)
    got = evaluate_beir(split_over_ranks(enc), beir_dir, batch_size=7, progress=False)
    split_docs = len(seen)
    seen.clear()
    want = evaluate_beir(enc, beir_dir, batch_size=7, progress=False)
    return {"got": got, "want": want, "split_docs": split_docs, "all_docs": len(seen)}


def mine_case(model_path, beir_dir):
    """mine_pairs (MaxSim search against the token store) split over the ranks against one
    process's."""
    from bigbatch.data.readers.beir_dir import load_qrels, load_queries
    from bigbatch.retrieval.distributed_eval import split_over_ranks
    from bigbatch.retrieval.mining import MiningOptions, mine_pairs

    enc = _encoder(model_path)
    qrels = load_qrels(f"{beir_dir}/qrels/train.tsv")
    queries = load_queries(f"{beir_dir}/queries.jsonl", set(qrels))
    options = MiningOptions(num_negatives=3, max_score_ratio=0.95, batch_size=5)
    got, _ = mine_pairs(split_over_ranks(enc), f"{beir_dir}/corpus.jsonl", queries, qrels,
                        options, progress=False)
    want, _ = mine_pairs(enc, f"{beir_dir}/corpus.jsonl", queries, qrels, options,
                         progress=False)
    return {"same_negatives": [g[:3] for g in got] == [w[:3] for w in want],
            "records": len(got),
            "score_diff": max(abs(g[3][d] - w[3][d]) for g, w in zip(got, want) for d in w[3])}


def cache_case(model_path, beir_dir, cache_dir):
    """Each rank's part cached under a name of its own, read back without embedding."""
    import torch.distributed as dist

    from bigbatch.retrieval.distributed_eval import split_over_ranks

    enc = _encoder(model_path)
    seen = _counting(enc)
    split = split_over_ranks(enc)
    first = split.corpus_token_store(f"{beir_dir}/corpus.jsonl", cache_dir=cache_dir,
                                     progress=False)
    dist.barrier()
    embedded = len(seen)
    again = split.corpus_token_store(f"{beir_dir}/corpus.jsonl", cache_dir=cache_dir,
                                     progress=False)
    return {"embedded": embedded, "embedded_again": len(seen) - embedded,
            "held": first.store.held, "held_again": again.store.held, "docs": len(first),
            "path": first.store.path.name}


def worker(rank, world, port, out_path, paths):
    from dist_helpers import run_cases

    paths = json.loads(paths)
    cases = {"eval": lambda: eval_case(paths["bert"], paths["beir"]),
             "mine": lambda: mine_case(paths["bert"], paths["beir"]),
             "cache": lambda: cache_case(paths["bert"], paths["beir"], paths["cache"])}
    run_cases(rank, world, port, out_path, cases)
