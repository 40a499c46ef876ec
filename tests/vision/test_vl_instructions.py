"""Per-source system instructions of a vision-language encoder: a source's instructions are
in effect for every chunk GradCache collates, in the first pass and in the replay (raw
examples are collated when embedded), the encoder's own come back after the step, and the
tasks are saved with the model and loaded back."""

from __future__ import annotations

import pytest
import torch

import bigbatch as bb
from bigbatch.data.mix import SourceSpec
from bigbatch.data.records.types import ImageDoc
from bigbatch.encoders import VisionLanguageEncoder, load_encoder
from bigbatch.errors import ConfigError


def test_a_sources_instructions_reach_every_collated_chunk(tiny_vl, page_images, tmp_path):
    enc = VisionLanguageEncoder(tiny_vl("qwen2_vl"), max_num_visual_tokens=8)
    own = enc.prompts()
    seen = []
    real = enc.collate

    def spy(items, side="doc"):
        out = real(items, side)
        seen.append((side, enc.tokenizer.decode(out["input_ids"][0])))
        return out

    enc.collate_query = lambda items: spy(items, "query")
    enc.collate_doc = lambda items: spy(items, "doc")
    loss_fn = bb.InfoNCE(temperature=0.05, learnable_temperature=False)
    cache = bb.GradCache({"query": enc, "doc": enc}, loss_fn, chunk_size=2,
                         collate_fn=enc.collate_fns())
    spec = SourceSpec("pages.jsonl", "pages", query_instruction="Find the page.",
                      doc_instruction="A scanned page.")
    prompts = spec.prompts(enc.encoder_type)
    with enc.using_prompts(**prompts):
        cache.step(query=["a query", "another query", "a third"],
                   doc=[ImageDoc(p) for p in page_images[:3]])
    assert enc.prompts() == own  # the encoder's own instructions are back
    assert len([s for s, _ in seen if s == "query"]) >= 2  # first pass and replay
    for side, text in seen:
        want = "Find the page." if side == "query" else "A scanned page."
        assert f"system\n{want}<|im_end|>" in text, text
    with pytest.raises(ConfigError, match=r"query_instruction contains the vision token"):
        with enc.using_prompts(query="Look: <|image_pad|>"):
            pass
    assert enc.prompts() == own
    # a prefix is for text models: a vision-language source is told to use an instruction
    with pytest.raises(ConfigError, match="query_instruction"):
        SourceSpec("x", "x", query_prefix="q: ").prompts("vision-language")
    enc.tasks = {"pages": {"query": "Find the page.", "doc": "A scanned page."}}
    enc.save(tmp_path / "m")
    back = load_encoder(tmp_path / "m")
    assert back.tasks == enc.tasks and back.task_prompts("pages")["query"] == "Find the page."
    assert back.task_prompts("unknown") == own
    assert torch.is_tensor(back.encode(["q"], side="query"))
