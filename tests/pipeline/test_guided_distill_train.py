"""Guided filtering and distillation in ``bigbatch train``: ``mine --scores`` writes teacher
scores, which survive ``convert`` and pass ``validate``, and a run distils from them with a
guide model (its own starting weights, or another model of another width)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from pipeline_helpers import minilm_path, scifact_slice, tiny_bert

from bigbatch.cli import main
from bigbatch.errors import ConfigError, DataError
from bigbatch.train import TrainConfig, train


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return tiny_bert(root / "tiny", dropout=0.1), scifact_slice(root / "sf", n_train=24, n_test=4,
                                                              n_extra_docs=20)


def wide_guide(path: Path) -> Path:
    """A 1-layer random BERT 48 wide (the trained tiny model is 32 wide) as a guide."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    tok = AutoTokenizer.from_pretrained(minilm_path())
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=48, num_hidden_layers=1,
                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=128)
    BertModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mined(assets, tmp_path_factory):
    """Records mined with scores by the tiny model, converted to st Parquet."""
    tiny, data = assets
    root = tmp_path_factory.mktemp("mined")
    out = root / "mined.jsonl"
    assert main(["mine", "--model", str(tiny), "--data", str(data), "--output", str(out),
                 "--num-negatives", "2", "--max-score-ratio", "0", "--scores",
                 "--device", "cpu", "--max-length", "48"]) == 0
    pq = root / "mined.parquet"
    assert main(["convert", "--to", "st", str(out), str(pq)]) == 0
    assert main(["validate", str(out), str(pq)]) == 0
    return out, pq


def config(assets, out, **kw):
    tiny, _ = assets
    base = dict(model=str(tiny), output_dir=str(out), batch_size=4, grad_cache_chunk=2,
                max_steps=2, warmup_steps=1, save_steps=0, eval_steps=0, eval_at_start=False,
                lora_r=0, lr=1e-3, max_length=48, seed=3, num_hard_negatives=2)
    base.update(kw)
    return TrainConfig(**base)


def train_rows(out):
    rows = [json.loads(l) for l in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def test_mined_scores_are_the_mining_models_cosines(mined):
    rec = json.loads(mined[0].read_text().splitlines()[0])
    assert len(rec["neg_scores"]) == len(rec["negatives"]) == 2
    assert all(-1 <= s <= 1 for s in [rec["pos_score"], *rec["neg_scores"]])


@pytest.mark.parametrize("distill, guide", [("kl", "self"), ("margin-mse", "wide")])
def test_train_distils_from_mined_scores_with_a_guide(assets, mined, tmp_path, distill, guide):
    guide_model = "self" if guide == "self" else str(wide_guide(tmp_path / "guide"))
    out = tmp_path / "run"
    summary = train(config(assets, out, train_data=str(mined[1]), distill=distill,
                           distill_weight=0.5, guide_model=guide_model, guide_margin=0.1))
    assert summary["steps"] == 2
    rows = train_rows(out)
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["distill"]) and r["distill"] > 0
        assert r["guide_masked"] >= 0 and r["masked"] >= r["guide_masked"]


def test_distill_without_scores_or_negatives_is_refused(assets, mined, tmp_path):
    _, data = assets
    with pytest.raises(ConfigError, match="--distill.*hard negatives"):
        train(config(assets, tmp_path / "a", train_data=str(mined[0]), distill="kl",
                      num_hard_negatives=0))
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({k: v for k, v in json.loads(l).items()
                                         if "score" not in k}) + "\n"
                             for l in mined[0].read_text().splitlines()))
    with pytest.raises(DataError, match="no teacher scores"):
        train(config(assets, tmp_path / "b", train_data=str(plain), distill="kl"))
    with pytest.raises(ConfigError, match="--guide-model"):
        train(config(assets, tmp_path / "c", train_data=str(plain), guide_model="nowhere"))
