"""``bigbatch train`` on several sources (a tiny model, a SciFact slice and pairs made from
its abstracts): a resumed mix reproduces the straight run exactly, each source's prompts
reach the tokenizer and are saved with the model as its task, a bad record names its
source before step 1, several evaluation sets are each reported and their mean selects
``best/``, ``bigbatch make-pairs``, and prompts left out of mean pooling as
sentence-transformers leaves them out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from pipeline_helpers import scifact_slice, tiny_bert

from bigbatch.cli import main
from bigbatch.encoders import TextEncoder, load_encoder
from bigbatch.train import TrainConfig, train


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    tiny = tiny_bert(root / "tiny", dropout=0.1)
    sf = scifact_slice(root / "scifact")
    titles = root / "titles.jsonl"
    assert main(["make-pairs", str(sf), str(titles), "--max-pairs", "40"]) == 0
    rows = [json.loads(l) for l in titles.read_text().splitlines()]
    negs = root / "negs.jsonl"  # one hard negative each: another title's abstract
    negs.write_text("".join(json.dumps({"query": r["query"], "positive": r["positive"],
                                        "negatives": [rows[(i + 1) % len(rows)]["positive"]]})
                            + "\n" for i, r in enumerate(rows)))
    return tiny, sf, negs


SOURCES = lambda sf, negs: [  # noqa: E731
    {"path": str(sf), "name": "scifact", "query_prefix": "claim: "},
    {"path": str(negs), "name": "titles", "num_hard_negatives": 1, "in_batch_negatives": False,
     "query_instruction": "Title:", "doc_prefix": "abstract: ", "weight": 1.0}]


def config(assets, out, **kw):
    tiny, sf, negs = assets
    sources = SOURCES(sf, negs)
    sources[0]["weight"] = 1.0
    base = dict(model=str(tiny), train_data=sources, output_dir=str(out), batch_size=8,
                grad_cache_chunk=3, max_steps=4, warmup_steps=1, save_steps=2, eval_steps=0,
                eval_at_start=False, lora_r=0, lr=1e-3, max_length=48, seed=1,
                save_total_limit=5)
    base.update(kw)
    return TrainConfig(**base).validate()


def rows(out, kind="train"):
    return [r for r in (json.loads(l) for l in (Path(out) / "metrics.jsonl").read_text()
                        .splitlines()) if r["kind"] == kind]


def in_change_check() -> bool:
    """Whether the caller runs inside the end-of-run check (bigbatch.train.change_check)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "bigbatch.train.change_check":
            return True
        frame = frame.f_back
    return False


def test_a_resumed_mix_reproduces_the_straight_run_and_prompts_follow_the_source(
        assets, tmp_path, monkeypatch):
    calls = []
    real = TextEncoder.tokenize

    def spy(self, texts, side="doc", max_length=None, block=2048):
        if not in_change_check():  # (its few texts at the start and the end are no step's)
            calls.append((side, self.query_prefix if side == "query" else self.doc_prefix))
        return real(self, texts, side, max_length, block)

    monkeypatch.setattr(TextEncoder, "tokenize", spy)
    train(config(assets, tmp_path / "a"))
    straight = rows(tmp_path / "a")
    sources = [r["source"] for r in straight]
    assert sorted(set(sources)) == ["scifact", "titles"], sources  # the seed draws both
    for r in straight:
        assert r[f"loss/{r['source']}"] == r["loss"]
        assert r[f"margin/{r['source']}"] == r["margin"]
    assert "hard_neg_sim/titles" in next(r for r in straight if r["source"] == "titles")
    # every step's queries and documents were tokenized with its source's prompts
    prompts = {"scifact": ("claim: ", ""), "titles": ("Title: ", "abstract: ")}
    query_calls = [p for side, p in calls if side == "query"]
    doc_calls = [p for side, p in calls if side == "doc"][1:]  # the first: the memory probe
    assert query_calls == [prompts[s][0] for s in sources]
    assert doc_calls == [prompts[s][1] for s in sources]

    stopped = train(config(assets, tmp_path / "b"), on_step_end=lambda step, state: step >= 3)
    assert stopped["stopped"]
    state = torch.load(tmp_path / "b" / "checkpoint-000002" / "trainer_state.pt",
                       weights_only=False)
    data = state.get("state", state)
    assert set(data["sources"]) == {"scifact", "titles"} and data["mix"]["weights"] == [0.5, 0.5]
    train(config(assets, tmp_path / "b", resume=str(tmp_path / "b")))
    resumed = rows(tmp_path / "b")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["source"] for r in resumed] == sources
    for a, b in zip(straight, resumed):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a, b)
    from safetensors.torch import load_file
    wa = load_file(tmp_path / "a" / "final" / "model.safetensors")
    wb = load_file(tmp_path / "b" / "final" / "model.safetensors")
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-6, rtol=0), k

    # the sources' prompts are saved as tasks: bigbatch's json and sentence-transformers'
    final = tmp_path / "a" / "final"
    tasks = {"scifact": {"query": "claim: ", "doc": ""},
             "titles": {"query": "Title: ", "doc": "abstract: "}}
    assert json.loads((final / "bigbatch_encoder.json").read_text())["tasks"] == tasks
    st = json.loads((final / "config_sentence_transformers.json").read_text())["prompts"]
    assert st["titles_query"] == "Title: " and st["titles_document"] == "abstract: "
    assert load_encoder(final).tasks == tasks
    # a resume with another mix is refused
    from bigbatch.errors import ConfigError
    tiny, sf, negs = assets
    other = SOURCES(sf, negs)
    other[0]["weight"] = 3.0
    with pytest.raises(ConfigError, match="mix"):
        train(config(assets, tmp_path / "b", train_data=other, resume=str(tmp_path / "b"),
                     max_steps=6))


def test_bigbatch_eval_applies_a_saved_tasks_prompts(assets, tmp_path, monkeypatch, capsys):
    import bigbatch.retrieval.evaluate

    tiny, sf, _ = assets
    enc = TextEncoder(str(tiny), max_length=32, query_prefix="plain: ")
    enc.tasks = {"scifact": {"query": "claim: ", "doc": ""}, "other": {"query": "o: ",
                                                                        "doc": "d: "}}
    enc.save(tmp_path / "m")
    seen = []
    real = bigbatch.retrieval.evaluate.evaluate_beir

    def spy(encoder, *a, **kw):
        seen.append((encoder.query_prefix, encoder.doc_prefix))
        return real(encoder, *a, **kw)

    monkeypatch.setattr(bigbatch.retrieval.evaluate, "evaluate_beir", spy)
    common = ["eval", "--model", str(tmp_path / "m"), "--data", str(sf), "--no-cache"]
    assert main(common) == 0  # the folder is named scifact: that task's prompts
    assert main([*common, "--task", "other"]) == 0
    assert main([*common, "--task", "other", "--query-prefix", "q: "]) == 0
    assert seen == [("claim: ", ""), ("o: ", "d: "), ("q: ", "d: ")]
    assert main([*common, "--task", "nope"]) == 2
    assert "has no task 'nope' (it has: other, scifact)" in capsys.readouterr().err


def test_a_bad_record_names_its_source_before_step_one(assets, tmp_path, capsys):
    tiny, sf, _ = assets
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"query": "q", "positive": "p"}\n{"query": "q2", "positive": ""}\n')
    out = tmp_path / "run"
    rc = main(["train", "--model", str(tiny), "--train-data", str(sf), "--train-data",
               str(bad), "--output-dir", str(out), "--max-steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"training source 'broken' ({bad})" in err
    assert f"{bad}:2, field 'positive'" in err
    assert not (out / "metrics.jsonl").exists()


def test_several_evaluation_sets_are_reported_and_their_mean_selects_best(
        assets, tmp_path, monkeypatch, capsys):
    import bigbatch.retrieval.evaluate

    tiny, sf, negs = assets
    other = scifact_slice(tmp_path / "small", n_train=8, n_test=8, n_extra_docs=30)
    prefixes = []
    real = bigbatch.retrieval.evaluate.evaluate_beir

    def spy(encoder, root, *a, **kw):
        prefixes.append((Path(root).name, encoder.query_prefix))
        return real(encoder, root, *a, **kw)

    monkeypatch.setattr(bigbatch.retrieval.evaluate, "evaluate_beir", spy)
    out = tmp_path / "run"
    summary = train(config(assets, out, max_steps=2, eval_steps=1, save_steps=0,
                           eval_data=[{"path": str(sf), "name": "scifact"},
                                      {"path": str(other), "name": "small"}],
                           eval_batch_size=32))
    evals = rows(out, "eval")
    assert [r["step"] for r in evals] == [1, 2]
    header = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("eval"))
    assert "ndcg@10" in header and "scifact/ndcg@10" in header and "small/ndcg@10" in header
    for r in evals:
        for key in ("ndcg@10", "recall@10"):
            assert r[key] == pytest.approx((r[f"scifact/{key}"] + r[f"small/{key}"]) / 2)
    best = max(evals, key=lambda r: r["ndcg@10"])
    assert summary["best"] == pytest.approx(best["ndcg@10"])
    assert summary["best_step"] == best["step"]
    # the set named as a source is embedded with that source's prompts; the other with the
    # model's own
    assert set(prefixes) == {("scifact", "claim: "), ("small", "")}


def test_make_pairs_writes_title_abstract_pairs_and_names_a_bad_line(assets, tmp_path, capsys):
    _, sf, _ = assets
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"_id": "1", "title": "A", "text": "alpha"}\n'
                      '{"_id": "2", "title": "", "text": "beta"}\n'
                      '{"_id": "3", "title": "C", "text": "C"}\n')
    out = tmp_path / "pairs.jsonl"
    assert main(["make-pairs", str(corpus), str(out)]) == 0
    assert "wrote 1 pairs (title -> text)" in capsys.readouterr().out
    assert [json.loads(l)["query"] for l in out.read_text().splitlines()] == ["A"]
    corpus.write_text('{"_id": "1", "title": "A", "text": "alpha"}\nnot json\n')
    assert main(["make-pairs", str(corpus), str(tmp_path / "p2.jsonl")]) == 2
    assert f"{corpus}:2" in capsys.readouterr().err


def test_a_prompt_left_out_of_pooling_matches_sentence_transformers(assets, tmp_path):
    from sentence_transformers import SentenceTransformer

    tiny, _, _ = assets
    texts = ["a short claim", "another, somewhat longer claim about cells"]
    enc = TextEncoder(str(tiny), max_length=32, query_prefix="query: ",
                      exclude_prompt_from_pooling=True)
    enc.save(tmp_path / "m")
    ours = enc.encode(texts, side="query")
    st = SentenceTransformer(str(tmp_path / "m"), device="cpu")
    theirs = torch.from_numpy(st.encode(texts, prompt_name="query"))
    assert torch.allclose(ours, theirs, atol=1e-5)
    included = TextEncoder(str(tiny), max_length=32, query_prefix="query: ")
    assert not torch.allclose(included.encode(texts, side="query"), ours, atol=1e-3)
    back = load_encoder(tmp_path / "m")
    assert back.exclude_prompt_from_pooling
    assert torch.allclose(back.encode(texts, side="query"), ours, atol=1e-6)


def test_sources_from_flags_and_the_demo_config(assets, tmp_path, monkeypatch):
    from bigbatch.cli import build_parser
    from bigbatch.train import load_config

    tiny, sf, negs = assets
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["train", "--model", str(tiny), "--train-data",
                                      f"{sf},rel.jsonl", "--train-data", str(negs),
                                      "--eval-data", str(sf)])
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    cfg = load_config(None, overrides)
    assert cfg.train_data == [str(sf), str(tmp_path / "rel.jsonl"), str(negs)]
    assert [s.name for s in cfg.train_sources()] == ["scifact", "rel", "negs"]
    assert cfg.eval_data == str(sf)  # one path stays a path
    demo = Path(__file__).resolve().parents[2] / "configs" / "demo_mix.yaml"
    cfg = load_config(demo, {"model": str(tiny)})
    specs = cfg.train_sources()
    assert [(s.name, s.weight) for s in specs] == [("scifact", 0.5), ("titles", 0.5)]
    assert specs[1].path == str(demo.parents[1] / "runs" / "demo-mix-data" /
                                "scifact-titles.jsonl")
    assert specs[1].prompts("text")["query"].startswith("Given the title")
    cfg.write(tmp_path / "c.yaml")  # the resolved sources written back read the same
    assert load_config(tmp_path / "c.yaml").train_sources() == specs


def test_a_small_source_and_a_prompt_option_that_cannot_apply_are_refused(assets, tmp_path):
    from bigbatch.errors import ConfigError

    tiny, sf, _ = assets
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"query": f"q{i}", "positive": f"p{i}"}) + "\n"
                             for i in range(5)))
    with pytest.raises(ConfigError, match="training source 'small': 5 training records are "
                                          "fewer than one global batch"):
        train(config(assets, tmp_path / "run", train_data=[str(sf), str(small)]))
    with pytest.raises(ConfigError, match="source 'scifact': in_batch_negatives false .* "
                                          "give num_hard_negatives >= 1"):
        train(config(assets, tmp_path / "run", train_data=[
            {"path": str(sf), "in_batch_negatives": False}, str(small)]))
    with pytest.raises(ConfigError, match="--exclude-instruction-from-pooling: applies to "
                                          "--pooling mean"):
        config(assets, tmp_path / "run", pooling="cls", exclude_instruction_from_pooling=True)


def test_one_sources_prompts_become_the_models_own(assets, tmp_path):
    from bigbatch.train.loop import Trainer

    tiny, sf, _ = assets
    trainer = Trainer(config(assets, tmp_path / "run", train_data=[
        {"path": str(sf), "query_instruction": "Find the abstract:"}]))
    assert trainer.encoder.prompts() == {"query": "Find the abstract: ", "doc": ""}
    assert trainer.encoder.tasks == {} and trainer.sources[0].prompts == {}
    assert not (tmp_path / "run").exists()  # building a run writes nothing
