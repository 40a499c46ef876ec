"""Model cards of vision-language models describe them as what they are (a single-vector
retriever, a ColQwen-style multi-vector one), with no path of the training machine, and
their usage snippets run (colpali-engine's is skipped where it is not installed)."""

from __future__ import annotations

import pytest
from card_helpers import machine_paths, run_card_snippets

from bigbatch.encoders import MultiVectorVisionEncoder, VisionLanguageEncoder
from bigbatch.train import TrainConfig
from bigbatch.train.card import render_model_card


def _card(folder, run, model, **options):
    config = TrainConfig(model=str(model), train_data=str(run / "pages.jsonl"),
                         output_dir=str(run), **options)
    return render_model_card(folder, config, {"step": 2, "num_records": 8},
                             chunk_sizes={"query": 2, "doc": 2})


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


@pytest.mark.slow
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


COLQWEN2_STAND_IN = """
# colpali-engine 0.3.18's ColQwen2 (models/qwen2/colqwen2/modeling_colqwen2.py), the parts
# that decide the embeddings (as tests/vision/test_vl_multivector.py's ColQwen2Structure)
from typing import ClassVar

from torch import nn
from transformers.models.qwen2_vl import Qwen2VLModel


class ColQwen2(Qwen2VLModel):
    _checkpoint_conversion_mapping: ClassVar[dict] = {
        r"^base_model\\.model\\.custom_text_proj": "custom_text_proj"}

    def __init__(self, config, mask_non_image_embeddings: bool = False):
        super().__init__(config=config)
        self.dim = 128
        self.custom_text_proj = nn.Linear(config.text_config.hidden_size, self.dim)
        self.post_init()

    def forward(self, *args, **kwargs):
        hidden = super().forward(*args, **kwargs, use_cache=False,
                                 return_dict=True).last_hidden_state
        proj = self.custom_text_proj(hidden)
        proj = proj / proj.norm(dim=-1, keepdim=True)
        return proj * kwargs["attention_mask"].unsqueeze(-1)
"""


def test_the_colqwen_cards_colpali_snippet_gives_bigbatchs_tokens(tiny_vl, tmp_path):
    """The colpali-engine snippet, run against a stand-in of ColQwen2's structure where
    colpali-engine is not installed, prints the scored tokens bigbatch embeds."""
    import importlib.util

    import torch

    base = tiny_vl("qwen2_vl")
    run = tmp_path / "colqwen"
    enc = MultiVectorVisionEncoder(base, dim=128, max_num_visual_tokens=12).eval()
    final = enc.save_final(run / "final")
    card = _card(final, run, base, pooling="multivector", lora_r=0)
    stand_ins = None
    if importlib.util.find_spec("colpali_engine") is None:
        stand_ins = tmp_path / "stand-ins"
        (stand_ins / "colpali_engine" / "models").mkdir(parents=True)
        (stand_ins / "colpali_engine" / "__init__.py").write_text("")
        (stand_ins / "colpali_engine" / "models" / "__init__.py").write_text(COLQWEN2_STAND_IN)
    colpali = [b for b in __import__("card_helpers").python_blocks(card) if "colpali" in b]
    assert len(colpali) == 1
    snippet = colpali[0].replace("print(tokens.shape)",
                                 f"torch.save(tokens, {str(tmp_path / 'tokens.pt')!r})")
    run_card_snippets(f"```python\n{snippet}```", {"colqwen/final": str(final)}, tmp_path,
                      stand_ins)
    want = enc.encode(["what reduces the risk of heart disease?"], side="query")
    got = torch.load(tmp_path / "tokens.pt")
    assert got.shape == want.values[want.mask].shape
    assert (got - want.values[want.mask]).abs().max() < 1e-5


def test_a_colpali_engine_folder_is_refused_naming_why(tiny_vl, tmp_path):
    """A folder colpali-engine saved (custom_text_proj, no bigbatch_encoder.json) was read
    as a single-vector model, its projection dropped: refused, naming what differs."""

    from bigbatch.encoders import load_encoder
    from bigbatch.errors import ConfigError

    base = tiny_vl("qwen2_vl")
    final = MultiVectorVisionEncoder(base, dim=128, max_num_visual_tokens=12).save_final(
        tmp_path / "final")
    (final / "bigbatch_encoder.json").unlink()  # what colpali-engine's save leaves
    with pytest.raises(ConfigError, match="ColQwen-style model .* colpali-engine's processor "
                                          "prompts"):
        load_encoder(final)


def test_training_a_colqwen_folder_as_one_vector_per_text_is_refused(tiny_vl, tmp_path):
    """``bigbatch train --model <ColQwen folder>`` without ``--pooling multivector`` used to
    train a single-vector model on it, its per-token projection dropped: refused before
    step 1; with ``--pooling multivector`` the folder's projection is where training starts."""

    from bigbatch.errors import ConfigError
    from bigbatch.train.build import build_encoder

    base = tiny_vl("qwen2_vl")
    enc = MultiVectorVisionEncoder(base, dim=128, max_num_visual_tokens=12)
    final = enc.save_final(tmp_path / "final")
    (final / "bigbatch_encoder.json").unlink()  # what colpali-engine's save leaves
    config = TrainConfig(model=str(final), train_data=str(tmp_path / "pages.jsonl"),
                         output_dir=str(tmp_path / "run"), lora_r=0, max_num_visual_tokens=12)
    with pytest.raises(ConfigError, match="ColQwen-style multi-vector model .* --pooling "
                                          "multivector"):
        build_encoder(config, [], 0)
    import dataclasses

    import torch

    got = build_encoder(dataclasses.replace(config, pooling="multivector"), [], 0)
    assert torch.equal(got.projection.weight, enc.projection.weight)
