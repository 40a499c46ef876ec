"""``bigbatch train`` with Matryoshka widths, extra in-batch negatives and token-budget
chunks on a tiny model; ``bigbatch eval --dims``; the saved model's recorded widths and
sentence-transformers' ``truncate_dim``; the bad options, refused before step 1."""

from __future__ import annotations

import json

import pytest
from pipeline_helpers import scifact_slice, tiny_bert

from bigbatch.cli import main
from bigbatch.errors import ConfigError
from bigbatch.train import TrainConfig, train


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return tiny_bert(root / "tiny", dropout=0.1), scifact_slice(root / "sf")


@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory):
    """A 2-step run with every option of this file (width 32)."""
    tiny, data = assets
    out = tmp_path_factory.mktemp("run") / "run"
    rc = main(["train", "--model", str(tiny), "--train-data", str(data), "--output-dir", str(out),
               "--batch-size", "8", "--grad-cache-chunk", "4", "--grad-cache-tokens", "96",
               "--max-steps", "2", "--warmup-steps", "1", "--no-eval-at-start",
               "--lora-r", "0", "--max-length", "48",
               "--matryoshka-dims", "32,16,8", "--matryoshka-weights", "1,1,0.5",
               "--extra-negatives", "qq,dd"])
    assert rc == 0
    return out


def test_a_run_logs_each_width_and_the_model_records_them(trained):
    rows = [json.loads(l) for l in (trained / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert len(train_rows) == 2
    first = train_rows[0]
    for d in (32, 16, 8):
        assert f"loss@{d}" in first and f"accuracy@{d}" in first
    assert first["loss"] == pytest.approx(first["loss@32"] + first["loss@16"]
                                          + 0.5 * first["loss@8"], rel=1e-5)
    st_config = json.loads((trained / "final" / "config_sentence_transformers.json").read_text())
    assert st_config["matryoshka_dims"] == [32, 16, 8]
    assert "truncate_dim" not in st_config  # full width by default
    meta = json.loads((trained / "final" / "bigbatch_encoder.json").read_text())
    assert meta["matryoshka_dims"] == [32, 16, 8]
    resolved = (trained / "config.yaml").read_text()
    assert "grad_cache_tokens: 96" in resolved and "- qq" in resolved


def test_sentence_transformers_truncate_dim_loads_the_saved_model(trained):
    from sentence_transformers import SentenceTransformer

    full = SentenceTransformer(str(trained / "final"), device="cpu")
    cut = SentenceTransformer(str(trained / "final"), device="cpu", truncate_dim=16)
    a, b = full.encode(["a claim"]), cut.encode(["a claim"])
    assert a.shape == (1, 32) and b.shape == (1, 16)
    assert (abs(a[0, :16] - b[0]) < 1e-5).all()


def test_eval_dims_reports_each_width(trained, assets, tmp_path, capsys):
    _, data = assets
    out = tmp_path / "eval.json"
    rc = main(["eval", "--model", str(trained / "final"), "--data", str(data), "--dims", "32,8",
               "--output", str(out), "--no-cache", "--max-length", "48"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "@32" in printed and "@8" in printed
    results = json.loads(out.read_text())
    assert [r["dim"] for r in results] == [32, 8]
    assert results[0]["metrics"] != results[1]["metrics"]
    # the full width equals the plain evaluation (the model normalises its embeddings)
    plain = tmp_path / "plain.json"
    main(["eval", "--model", str(trained / "final"), "--data", str(data), "--output", str(plain),
          "--no-cache", "--max-length", "48"])
    whole = json.loads(plain.read_text())[0]["metrics"]
    assert results[0]["metrics"]["ndcg@10"] == pytest.approx(whole["ndcg@10"], abs=1e-6)
    capsys.readouterr()
    rc = main(["eval", "--model", str(trained / "final"), "--data", str(data), "--dims", "64",
               "--no-cache"])  # a width above the model's: refused before the corpus is embedded
    err = capsys.readouterr().err
    assert rc == 2 and "--dims: [64] larger than the model's embedding width 32" in err
    assert "embed corpus" not in err


def config(assets, out, **kw):
    tiny, data = assets
    base = dict(model=str(tiny), train_data=str(data), output_dir=str(out), batch_size=4,
                grad_cache_chunk=2, max_steps=1, warmup_steps=0, eval_at_start=False,
                lora_r=0, max_length=32)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("kw,message", [
    ({"matryoshka_dims": [64, 16]}, "larger than the model's embedding width 32"),
    ({"matryoshka_dims": [8, 16]}, "largest to smallest"),
    ({"matryoshka_dims": [16, 16]}, "more than once"),
    ({"matryoshka_dims": [32, 16], "matryoshka_weights": [1.0]}, "one weight per dimension"),
    ({"matryoshka_weights": [1.0]}, "needs --matryoshka-dims"),
    ({"extra_negatives": ["qx"]}, "--extra-negatives: unknown term"),
    ({"grad_cache_tokens": 0}, "--grad-cache-tokens: must be > 0"),
])
def test_bad_options_stop_the_run_before_step_one(assets, tmp_path, kw, message):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=message):
        train(config(assets, out, **kw).validate())
    assert not (out / "metrics.jsonl").exists()


def test_number_lists_from_yaml_and_flags(assets, tmp_path, capsys):
    from bigbatch.train.config import load_config

    tiny, data = assets
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {tiny}\ntrain_data: {data}\nmatryoshka_dims: [32, 8]\n"
                   f"matryoshka_weights: 1,0.5\nextra_negatives: qq\n")
    loaded = load_config(cfg)
    assert loaded.matryoshka_dims == [32, 8] and loaded.matryoshka_weights == [1.0, 0.5]
    assert loaded.extra_negatives == ["qq"]
    cfg.write_text(f"model: {tiny}\ntrain_data: {data}\nmatryoshka_dims: [32, 8.5]\n")
    with pytest.raises(ConfigError, match="matryoshka_dims: 8.5 is not an integer"):
        load_config(cfg)
    with pytest.raises(SystemExit):
        main(["train", "--model", str(tiny), "--train-data", str(data),
              "--matryoshka-dims", "32,x"])
    assert "'x' is not an integer" in capsys.readouterr().err
