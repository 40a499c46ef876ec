"""Model cards of vision-language models describe them as what they are (a single-vector
retriever, a ColQwen-style multi-vector one), with no path of the training machine, and
their usage snippets run (colpali-engine's is skipped where it is not installed)."""

from __future__ import annotations

from card_helpers import machine_paths, run_card_snippets

from bigbatch.encoders import MultiVectorVisionEncoder, VisionLanguageEncoder
from bigbatch.train import TrainConfig
from bigbatch.train.card import render_model_card


def _card(folder, run, model, **options):
    config = TrainConfig(model=str(model), train_data=str(run / "pages.jsonl"),
                         output_dir=str(run), **options)
    return render_model_card(folder, config, {"step": 2, "num_records": 8})


def test_a_vision_language_card(tiny_vl, tmp_path):
    base = tiny_vl("qwen2_vl")
    run = tmp_path / "vl"
    final = VisionLanguageEncoder(base, lora_r=4, lora_alpha=8,
                                  max_num_visual_tokens=12).save_final(run / "final")
    card = _card(final, run, base, lora_r=4, lora_alpha=8)
    assert machine_paths(card, tmp_path, base) == []
    assert "vision-language retriever" in card and "SentenceTransformer" not in card
    got = run_card_snippets(card, {"vl/final": str(final)}, tmp_path)
    assert len(got["ran"]) == 1 and not got["skipped"]


def test_a_colqwen_card(tiny_vl, tmp_path):
    base = tiny_vl("qwen2_vl")
    run = tmp_path / "colqwen"
    enc = MultiVectorVisionEncoder(base, dim=128, lora_r=4, lora_alpha=8,
                                   max_num_visual_tokens=12)
    final = enc.save_final(run / "final")
    card = _card(final, run, base, pooling="multivector", lora_r=4, lora_alpha=8)
    assert machine_paths(card, tmp_path, base) == []
    assert "ColQwen-style" in card and "MaxSim" in card and "ColQwen2.from_pretrained" in card
    assert "128 dimensions per token" in card
    got = run_card_snippets(card, {"colqwen/final": str(final)}, tmp_path)
    assert any("maxsim_scores" in code for code in got["ran"])
    for first, reason in got["skipped"]:
        assert reason == "colpali_engine not installed", (first, reason)
