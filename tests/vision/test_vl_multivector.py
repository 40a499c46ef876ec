"""ColQwen-style multi-vector page retrievers (``MultiVectorVisionEncoder``, ``--pooling
multivector`` on Qwen-VL): GradCache gradients with MaxSimInfoNCE equal the unchunked float64
reference (dropout on; LoRA with a frozen vision tower, and full fine-tuning), the prompt's
head and padding are never scored, a saved folder reloads with the same token embeddings and
its weights load into colpali-engine's ColQwen2 structure (with peft for adapters), and
``bigbatch train --pooling multivector`` trains, evaluates by MaxSim over page images and
saves on rendered pages."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
import torch
from helpers import DT, grads_of, max_rel_err, zero_grads
from multivector_helpers import padded_cat
from pipeline_helpers import scifact_slice
from torch import nn

import bigbatch as bb
from bigbatch.data.records.image_checks import ImageDoc
from bigbatch.encoders.vision_multivector import MultiVectorVisionEncoder
from bigbatch.errors import ConfigError

QUERIES = ["what does the figure show", "protein folding under heat stress", "a claim",
           "ribosome assembly in bacteria"]


def _docs(pages, n=8):
    docs = [ImageDoc(p) for p in pages[:n]]
    docs[3] = "a text passage about ribosomes and translation"
    return docs


def _perturb(enc: nn.Module, seed: int = 0) -> None:
    """LoRA's B matrices off zero, so the adapter has an effect."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in enc.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)


def _encoder(path, mode: str, **kw) -> MultiVectorVisionEncoder:
    if mode == "lora":
        enc = MultiVectorVisionEncoder(path, lora_r=4, lora_alpha=8, max_num_visual_tokens=12,
                                       dim=16, **kw)
    else:  # everything trainable
        enc = MultiVectorVisionEncoder(path, freeze_vision=False, max_num_visual_tokens=12,
                                       dim=16, **kw)
    enc = enc.to(DT).train()
    _perturb(enc)
    return enc


def _chunked(enc, items, side, size):
    return padded_cat([enc(**enc.collate(items[i:i + size], side))
                       for i in range(0, len(items), size)])


@pytest.mark.parametrize("family,mode", [("qwen2_vl", "lora"), ("qwen2_vl", "full"),
                                         ("qwen3_vl", "lora"), ("qwen3_vl", "full"),
                                         ("qwen2_5_vl", "lora")])
def test_gradcache_maxsim_equals_unchunked_reference(tiny_vl, page_images, family, mode):
    enc = _encoder(tiny_vl(family, dropout=0.1), mode)
    loss_fn = bb.MaxSimInfoNCE(symmetric=True, normalize_query=True, block_size=3).to(DT)
    docs = _docs(page_images)
    cache = bb.GradCache({"query": enc, "doc": enc}, loss_fn, chunk_size={"query": 3, "doc": 3},
                         collate_fn=enc.collate_fns())
    torch.manual_seed(11)
    zero_grads(enc, loss_fn)
    result = cache.step(query=QUERIES, doc=docs)
    got = grads_of(enc, loss_fn)

    torch.manual_seed(11)  # the same chunks in order from the same seed: the same dropout
    zero_grads(enc, loss_fn)
    q, d = _chunked(enc, QUERIES, "query", 3), _chunked(enc, docs, "doc", 3)
    ref_loss, _ = loss_fn(q, d)
    ref_loss.backward()
    ref = grads_of(enc, loss_fn)
    assert max_rel_err(got, ref) <= 1e-10
    assert torch.allclose(result.loss, ref_loss.detach(), rtol=1e-12)
    proj = [k for k in got if "custom_text_proj" in k]
    assert proj, "the projection always trains"
    vision = [k for k in got if ".visual." in k and "lora" not in k]
    assert bool(vision) == (mode == "full")

    torch.manual_seed(12)  # dropout was on and matters
    zero_grads(enc, loss_fn)
    loss_fn(_chunked(enc, QUERIES, "query", 3), _chunked(enc, docs, "doc", 3))[0].backward()
    assert max_rel_err(got, grads_of(enc, loss_fn), record=False) > 1e-6


def test_instruction_and_padding_are_not_scored(tiny_vl, page_images):
    path = tiny_vl("qwen2_vl")
    enc = MultiVectorVisionEncoder(path, max_num_visual_tokens=12).eval()
    items = ["short", ImageDoc(page_images[0]), "a somewhat longer text document here"]
    batch = enc.collate(items, "doc")
    head = len(enc._template_ids(enc.doc_instruction)[0])
    with torch.no_grad():
        out = enc(**batch)
    attn = batch["attention_mask"].bool()
    assert torch.equal(out.mask, attn & (torch.arange(attn.shape[1]) >= head))
    assert torch.equal(out.mask.sum(1), attn.sum(1) - head)
    norms = out.values[out.mask].norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5)  # L2 per token
    # another instruction changes the embeddings but not which tokens are scored: the content
    with torch.no_grad(), enc.using_prompts(doc="Find the page."):
        other = enc(**enc.collate(items, "doc"))
    assert torch.equal(other.mask.sum(1), out.mask.sum(1))
    everything = MultiVectorVisionEncoder(path, max_num_visual_tokens=12,
                                          mask_instruction=False).eval()
    with torch.no_grad():
        assert torch.equal(everything(**everything.collate(items, "doc")).mask, attn)


def test_bad_options(tiny_vl, tmp_path):
    path = tiny_vl("qwen2_vl")
    with pytest.raises(ConfigError, match="dim must be > 0"):
        MultiVectorVisionEncoder(path, dim=0)
    with pytest.raises(ConfigError, match="'multivector'"):
        MultiVectorVisionEncoder(path, pooling="last")
    enc = MultiVectorVisionEncoder(path, dim=8)
    out = enc.save(tmp_path / "full")
    with pytest.raises(ConfigError, match="8 dimensions, but 16"):
        MultiVectorVisionEncoder(out, dim=16)
    with pytest.raises(ConfigError, match="not supported for multi-vector"):
        enc.use_base_doc_tower()


@pytest.mark.parametrize("mode", ["lora", "full", "lora-final"])
def test_save_reload_same_token_embeddings(tiny_vl, page_images, tmp_path, mode):
    """lora-final: a LoRA run's final/ (``save_final``): the merged weights, the projection
    among them, which colpali-engine's classes read; the adapter in final/adapter/."""
    from bigbatch.encoders import load_encoder
    from bigbatch.encoders.vision_multivector import projection_weights

    enc = _encoder(tiny_vl("qwen2_vl"), mode.removesuffix("-final")).float().eval()
    with torch.no_grad():
        for p in enc.projection.parameters():
            p.add_(0.01)  # a trained projection, not the initial one
    if mode == "lora-final":
        out = enc.save_final(tmp_path / "final")
        assert not (out / "adapter_config.json").exists()
        assert (out / "adapter" / "adapter_model.safetensors").exists()
        saved = projection_weights(out)  # in model.safetensors, as colpali-engine reads it
        assert torch.equal(saved["weight"], enc.projection.weight.detach())
    else:
        out = enc.save(tmp_path / "final")
    items = [ImageDoc(page_images[2]), "a text document", ImageDoc(page_images[5])]
    want = enc.encode(items, side="doc", batch_size=2)
    loaded = load_encoder(out)
    assert isinstance(loaded, MultiVectorVisionEncoder) and loaded.is_lora == (mode == "lora")
    assert loaded.dim == 16 and loaded.mask_instruction
    got = loaded.encode(items, side="doc", batch_size=2)
    assert torch.equal(got.mask, want.mask)
    assert (got.values - want.values).abs().max() < 1e-6
    q_want = enc.encode(QUERIES, side="query")
    assert (loaded.encode(QUERIES, side="query").values - q_want.values).abs().max() < 1e-6
    fresh = MultiVectorVisionEncoder(tiny_vl("qwen2_vl"), dim=16, max_num_visual_tokens=12)
    assert (fresh.encode(items).values - want.values).abs().max() > 1e-3  # training shows


class ColQwen2Structure:
    """colpali-engine 0.3.18's ``ColQwen2`` (models/qwen2/colqwen2/modeling_colqwen2.py), the
    parts that decide the embeddings: a ``Qwen2VLModel`` subclass with ``custom_text_proj =
    Linear(hidden, 128)``, L2 per token, times the attention mask. Used when colpali-engine
    is not installed (it pins peft < 0.21: see docs/guides/multivector.md)."""

    @staticmethod
    def make():
        from transformers.models.qwen2_vl import Qwen2VLModel

        class ColQwen2(Qwen2VLModel):
            _checkpoint_conversion_mapping: ClassVar[dict] = {
                r"^base_model\.model\.custom_text_proj": "custom_text_proj"}

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
        return ColQwen2


def _colqwen2_class():
    try:
        from colpali_engine.models import ColQwen2
        return ColQwen2
    except ImportError:
        return ColQwen2Structure.make()


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_colqwen2_loads_the_saved_folder(tiny_vl, page_images, tmp_path, mode):
    """A Qwen2-VL ``final/`` (128 dimensions, ColQwen2's width) loads with
    ``ColQwen2.from_pretrained`` (an adapter: ``PeftModel`` over the base model) and gives
    the same token embeddings at every scored token."""
    from peft import PeftModel

    base = tiny_vl("qwen2_vl")
    enc = MultiVectorVisionEncoder(base, lora_r=4 if mode == "lora" else 0, lora_alpha=8,
                                   max_num_visual_tokens=12).eval()
    _perturb(enc)
    with torch.no_grad():
        for p in enc.projection.parameters():
            p.add_(0.01)
    out = enc.save(tmp_path / "final")
    cls = _colqwen2_class()
    if mode == "lora":
        model = PeftModel.from_pretrained(cls.from_pretrained(base), str(out)).eval()
    else:
        model = cls.from_pretrained(str(out)).eval()
    for items in ([ImageDoc(page_images[1])], ["a text document", "another one"]):
        batch = enc.collate(items, "doc")
        with torch.no_grad():
            want = enc(**batch)
            kwargs = {k: v for k, v in batch.items() if k != "skip_mask"}
            if "pixel_values" in kwargs:  # ColQwen2 takes pixel values padded per image
                kwargs["pixel_values"] = kwargs["pixel_values"].unsqueeze(0)
            else:  # text only: the positions bigbatch gives
                pos = (batch["attention_mask"].cumsum(-1) - 1).clamp_min(0)
                kwargs["position_ids"] = pos.unsqueeze(0).expand(3, -1, -1)
            got = model(**kwargs)
        assert got.shape == want.values.shape
        assert (got[want.mask] - want.values[want.mask]).abs().max() < 1e-5


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """A 16-pair SciFact slice rendered to 224 x 224 pages, one negative per record."""
    from bigbatch.data.tools.pages import render_beir_pages

    root = tmp_path_factory.mktemp("mv_pages")
    src = scifact_slice(root / "src", n_train=16, n_test=6, n_extra_docs=8)
    render_beir_pages(src, root / "pages", num_negatives=1, size=(224, 224), font_size=9,
                      progress=False)
    return root / "pages"


def test_train_pooling_multivector_on_pages(tiny_vl, pages, tmp_path, capsys):
    """``bigbatch train --pooling multivector`` on page images: trains (LoRA), evaluates by
    MaxSim over the page corpus, saves; ``bigbatch eval`` on the saved folder gives the
    final figures."""
    from bigbatch.cli import main

    out = tmp_path / "run"
    main(["train", "--model", str(tiny_vl("qwen2_vl", dropout=0.1)),
          "--train-data", str(pages / "train.jsonl"), "--eval-data", str(pages),
          "--output-dir", str(out), "--pooling", "multivector", "--multivector-dim", "16",
          "--batch-size", "4", "--grad-cache-chunk", "2", "--max-steps", "2",
          "--warmup-steps", "1", "--eval-steps", "0", "--lora-r", "4", "--lora-alpha", "8",
          "--lr", "1e-3", "--max-length", "32", "--max-num-visual-tokens", "12",
          "--num-hard-negatives", "1", "--eval-batch-size", "8", "--seed", "3"])
    meta = json.loads((out / "final" / "bigbatch_encoder.json").read_text())
    assert meta["pooling"] == "multivector" and meta["dim"] == 16
    assert not meta["lora"] and meta["adapter"] == "adapter"  # merged; the adapter beside
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]
    final = [r for r in rows if r["kind"] == "eval"][-1]
    main(["eval", "--model", str(out / "final"), "--data", str(pages), "--batch-size", "8",
          "--output", str(tmp_path / "eval.json")])
    metrics = json.loads((tmp_path / "eval.json").read_text())[0]["metrics"]
    assert abs(metrics["ndcg@10"] - final["ndcg@10"]) < 1e-6  # the same model reloaded


def test_query_length_is_refused_for_page_retrievers(tiny_vl, pages, tmp_path):
    from bigbatch.train import TrainConfig, train

    cfg = TrainConfig(model=str(tiny_vl("qwen2_vl")), train_data=str(pages / "train.jsonl"),
                      output_dir=str(tmp_path / "run"), pooling="multivector", query_length=8,
                      batch_size=4, max_steps=1)
    with pytest.raises(ConfigError, match="--query-length: query expansion with mask tokens "
                                          "is for text models"):
        train(cfg)
    assert not (tmp_path / "run" / "final").exists()
