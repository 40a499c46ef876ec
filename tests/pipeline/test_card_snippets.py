"""Model cards describe the model they sit beside, without a path of the training machine,
and every usage snippet they show runs (issue 34, item 3; trap 5: five absolute paths in
every card, multi-vector cards calling the model a single-vector "Sentence Transformer,
Cosine" whose snippets failed or returned one mean-pooled vector). Snippets of libraries
that are not installed here (PyLate, colpali-engine) are skipped with that reason; the
client matrix (tests/clients) runs the PyLate one in PyLate's own environment."""

from __future__ import annotations

import json

import pytest
import torch
from card_helpers import machine_paths, needed_libraries, python_blocks, run_card_snippets
from pipeline_helpers import minilm_path, scifact_slice, tiny_bert

from bigbatch.encoders import MultiVectorTextEncoder, TextEncoder
from bigbatch.train import TrainConfig
from bigbatch.train.card import base_model_id, render_model_card

MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return tiny_bert(root / "tiny", dropout=0.0), scifact_slice(root / "sf", n_train=8,
                                                                 n_test=2, n_extra_docs=5)


def _moved(enc):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in enc.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return enc.eval()


def _card(folder, run, model, data, kind="final", **options):
    config = TrainConfig(model=str(model), train_data=str(data), output_dir=str(run),
                         **options)
    return render_model_card(folder, config, {"step": 2, "num_records": 8}, kind=kind,
                             chunk_sizes={"query": 2, "doc": 2})


def test_the_base_model_is_named_by_its_hub_id_or_folder_name(tmp_path):
    assert base_model_id(str(minilm_path())) == MINILM_ID  # the packaged copy
    assert base_model_id("BAAI/bge-small-en-v1.5") == "BAAI/bge-small-en-v1.5"
    cache = tmp_path / "hub" / "models--BAAI--bge-small-en-v1.5" / "snapshots" / "abc123"
    cache.mkdir(parents=True)
    assert base_model_id(str(cache)) == "BAAI/bge-small-en-v1.5"
    assert base_model_id(str(tmp_path)) is None  # a folder of its own: its name is shown


def test_a_lora_text_card_has_no_machine_paths_and_its_snippets_run(assets, tmp_path):
    _, data = assets
    enc = _moved(TextEncoder(minilm_path(), lora_r=4, lora_alpha=8, max_length=64,
                             query_prefix="query: "))
    run = tmp_path / "my-run"
    final = enc.save_final(run / "final")
    card = _card(final, run, minilm_path(), data, lora_r=4, lora_alpha=8, max_length=64,
                 query_prefix="query: ")
    assert machine_paths(card, tmp_path, minilm_path(), data) == []
    assert f"base_model: {MINILM_ID}" in card and "library_name: sentence-transformers" in card
    assert "SentenceTransformer('my-run/final')" in card  # the run's folder, not a path
    assert "subfolder='adapter'" in card  # peft: the adapter kept beside the merged weights
    got = run_card_snippets(card, {"my-run/final": str(final), MINILM_ID: str(minilm_path())},
                            tmp_path)
    libraries = {lib for code in got["ran"] for lib in needed_libraries(code)}
    assert {"sentence_transformers", "transformers", "peft", "bigbatch"} <= libraries
    assert got["skipped"] == []


@pytest.mark.slow
def test_an_adapter_folder_card_warns_and_its_snippets_run(assets, tmp_path):
    """best/model of a LoRA run is an adapter (a checkpoint's model): the card says where
    sentence-transformers would drop it, and shows peft's loaders."""
    tiny, data = assets
    enc = _moved(TextEncoder(tiny, lora_r=4, lora_alpha=8, max_length=64))
    run = tmp_path / "run"
    model = enc.save(run / "best" / "model")
    card = _card(model, run, tiny, data, kind="best", lora_r=4, lora_alpha=8, max_length=64)
    assert machine_paths(card, tmp_path) == []
    assert "5.0 to 5.5.4 drop the adapter" in card and "AutoPeftModel" in card
    run_card_snippets(card, {"run/best/model": str(model), "tiny": str(tiny)}, tmp_path)


@pytest.mark.slow
def test_a_colbert_card_describes_a_multi_vector_model_and_its_snippets_run(assets, tmp_path):
    tiny, data = assets
    enc = _moved(MultiVectorTextEncoder(tiny, dim=16, max_length=64, query_length=12,
                                        query_expansion=True, lora_r=4, lora_alpha=8))
    run = tmp_path / "colbert"
    final = enc.save_final(run / "final")
    card = _card(final, run, tiny, data, pooling="multivector", multivector_dim=16,
                 query_length=12, lora_r=4, lora_alpha=8, max_length=64)
    assert machine_paths(card, tmp_path) == []
    assert "library_name: PyLate" in card and "Similarity Function:** MaxSim" in card
    assert "Sentence Transformer" not in card.split("## Usage")[0].split("---")[-1]
    assert "16 dimensions per token" in card
    blocks = python_blocks(card)
    assert not any("AutoModel" in b for b in blocks)  # no mean-pooled single vector
    got = run_card_snippets(card, {"colbert/final": str(final)}, tmp_path)
    assert any("MultiVectorEncoder" in code for code in got["ran"])
    assert any("maxsim_scores" in code for code in got["ran"])
    for first, reason in got["skipped"]:
        assert reason == "pylate not installed", (first, reason)


def test_the_written_card_has_no_machine_paths(assets, tmp_path):
    """The whole card of a real run (options, data, base): `bigbatch train` with
    --push-to-hub unset."""
    from bigbatch.train import train

    tiny, data = assets
    out = tmp_path / "run"
    train(TrainConfig(model=str(tiny), train_data=str(data), output_dir=str(out), batch_size=4,
                      grad_cache_chunk=2, max_steps=1, warmup_steps=0, save_steps=0,
                      eval_at_start=False, lora_r=0, max_length=32, report_to=["none"],
                      guide_model=str(tiny)).validate())
    card = (out / "final" / "README.md").read_text()
    assert machine_paths(card, tmp_path, tiny, data) == []
    assert "- `guide_model`: tiny" in card  # a path option by its folder's name
    meta = json.loads((out / "final" / "bigbatch_encoder.json").read_text())
    assert meta["lora"] is False
