"""The vision-language bi-encoder: GradCache gradients with image documents and text queries
equal the unchunked float64 reference (LoRA with a frozen vision tower, and everything
trainable; dropout on), the rope state never leaks from an image call into a text call, and
a saved adapter loads in plain transformers + peft with identical embeddings."""

from __future__ import annotations

import pytest
import torch
from helpers import DT, grads_of, max_rel_err, zero_grads

import bigbatch as bb
from bigbatch.data.records.image_checks import ImageDoc
from bigbatch.encoders.vision import VisionLanguageEncoder

QUERIES = ["what does the figure show", "protein folding under heat stress", "a claim",
           "ribosome assembly in bacteria"]


def _docs(pages, n=8):
    # interleaved [pos, neg] per query; one text document among the images
    docs = [ImageDoc(p) for p in pages[:n]]
    docs[3] = "a text passage about ribosomes and translation"
    return docs


def _perturb_lora(enc: VisionLanguageEncoder, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in enc.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)


def _encoder(path, mode: str) -> VisionLanguageEncoder:
    if mode.startswith("lora-frozen-vision"):
        enc = VisionLanguageEncoder(path, lora_r=4, lora_alpha=8, freeze_vision=True,
                                    max_num_visual_tokens=12,
                                    gradient_checkpointing=mode.endswith("checkpointing"))
    else:  # everything trainable
        enc = VisionLanguageEncoder(path, lora_r=0, freeze_vision=False, max_num_visual_tokens=12)
    enc = enc.to(DT).train()
    _perturb_lora(enc)
    return enc


@pytest.mark.parametrize("family,mode", [("qwen2_vl", "lora-frozen-vision"),
                                         ("qwen2_vl", "full"),
                                         ("qwen3_vl", "lora-frozen-vision"),
                                         ("qwen3_vl", "full"),
                                         ("qwen3_vl", "lora-frozen-vision-checkpointing"),
                                         ("qwen2_5_vl", "lora-frozen-vision")])
def test_gradcache_equals_unchunked_reference(tiny_vl, page_images, family, mode):
    enc = _encoder(tiny_vl(family, dropout=0.1), mode)
    loss_fn = bb.InfoNCE(symmetric=True).to(DT)
    docs = _docs(page_images)
    cache = bb.GradCache({"query": enc, "doc": enc}, loss_fn, chunk_size={"query": 3, "doc": 3},
                         collate_fn=enc.collate_fns())
    torch.manual_seed(11)
    zero_grads(enc, loss_fn)
    result = cache.step(query=QUERIES, doc=docs)
    got = grads_of(enc, loss_fn)

    # reference: the same chunks in order, with gradients, from the same seed (same dropout)
    torch.manual_seed(11)
    zero_grads(enc, loss_fn)
    q = torch.cat([enc(**enc.collate(QUERIES[i:i + 3], "query")) for i in range(0, 4, 3)])
    d = torch.cat([enc(**enc.collate(docs[i:i + 3], "doc")) for i in range(0, 8, 3)])
    ref_loss, _ = loss_fn(q, d)
    ref_loss.backward()
    ref = grads_of(enc, loss_fn)
    assert max_rel_err(got, ref) <= 1e-10
    assert torch.allclose(result.loss, ref_loss.detach(), rtol=1e-12)

    vision = [n for n, p in enc.named_parameters() if ".visual." in n and "lora" not in n]
    vision_grads = [n for n in vision if f"0.{n}" in got]
    if mode.startswith("lora-frozen-vision"):
        assert vision and not vision_grads  # the frozen vision tower receives nothing
        assert all("lora" in k or k.startswith("1.") for k in got)
    else:
        assert len(vision_grads) > 0.8 * len(vision)

    # dropout was on and matters: another seed gives another gradient
    torch.manual_seed(12)
    zero_grads(enc, loss_fn)
    q = torch.cat([enc(**enc.collate(QUERIES[i:i + 3], "query")) for i in range(0, 4, 3)])
    d = torch.cat([enc(**enc.collate(docs[i:i + 3], "doc")) for i in range(0, 8, 3)])
    loss_fn(q, d)[0].backward()
    assert max_rel_err(got, grads_of(enc, loss_fn), record=False) > 1e-6


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_text_after_image_equals_text_alone(tiny_vl, page_images, family):
    enc = VisionLanguageEncoder(tiny_vl(family), max_num_visual_tokens=12).to(DT).eval()
    with torch.no_grad():
        alone = enc(**enc.collate(["protein folding", "a much longer query about cells"], "query"))
        enc(**enc.collate([ImageDoc(page_images[5]), ImageDoc(page_images[0])], "doc"))
        assert enc._core().rope_deltas is None  # reset after the image call
        after = enc(**enc.collate(["protein folding", "a much longer query about cells"], "query"))
        # even a stale offset left by someone else's call is ignored
        enc._core().rope_deltas = torch.full((2, 1), 37)
        stale = enc(**enc.collate(["protein folding", "a much longer query about cells"], "query"))
    assert torch.equal(alone, after) and torch.equal(alone, stale)


def test_embeddings_do_not_depend_on_batch_padding(tiny_vl, page_images):
    enc = VisionLanguageEncoder(tiny_vl("qwen3_vl"), max_num_visual_tokens=12).to(DT).eval()
    docs = [ImageDoc(page_images[1]), "short text", ImageDoc(page_images[6]),
            ImageDoc(page_images[6], text="a caption beside the page")]  # image and text
    with torch.no_grad():
        together = enc(**enc.collate(docs, "doc"))
        single = torch.cat([enc(**enc.collate([d], "doc")) for d in docs])
    assert (together - single).abs().max() < 1e-12
    assert (together[2] - together[3]).abs().max() > 1e-4  # the text beside the page counts


def test_pixel_budget_follows_the_family(tiny_vl, page_images):
    for family, side in (("qwen2_vl", 28), ("qwen3_vl", 32)):
        enc = VisionLanguageEncoder(tiny_vl(family), max_num_visual_tokens=6,
                                    min_num_visual_tokens=2)
        assert enc.pixel_budget == (2 * side * side, 6 * side * side)
        batch = enc.collate([ImageDoc(p) for p in page_images], "doc")
        tokens = batch["image_grid_thw"].prod(-1) // 4
        assert int(tokens.max()) <= 6 and int(tokens.min()) >= 2
        assert int((batch["input_ids"] == enc.image_token_id).sum()) == int(tokens.sum())


def test_bad_options_and_inputs(tiny_vl, tmp_path):
    with pytest.raises(bb.ConfigError, match="min_num_visual_tokens"):
        VisionLanguageEncoder(tiny_vl("qwen2_vl"), max_num_visual_tokens=2, min_num_visual_tokens=4)
    enc = VisionLanguageEncoder(tiny_vl("qwen2_vl"))
    with pytest.raises(bb.DataError, match="missing.png"):
        enc.collate([ImageDoc(str(tmp_path / "missing.png"))], "doc")
    with pytest.raises(bb.InputError, match="text or an ImageDoc"):
        enc.collate([3], "doc")


@pytest.mark.parametrize("freeze_vision", [True, False])
def test_adapter_loads_in_plain_transformers_and_peft(tiny_vl, page_images, tmp_path, freeze_vision):
    from peft import PeftModel
    from transformers import AutoModel

    from bigbatch.encoders import load_encoder

    base_path = tiny_vl("qwen3_vl")
    enc = VisionLanguageEncoder(base_path, lora_r=4, lora_alpha=8, max_num_visual_tokens=12,
                                freeze_vision=freeze_vision).eval()
    _perturb_lora(enc)
    if not freeze_vision:  # the trained vision tower travels with the adapter
        with torch.no_grad():
            for n, p in enc.named_parameters():
                if ".visual." in n and p.requires_grad:
                    p.add_(0.05)
    out = enc.save(tmp_path / "final")
    assert (out / "adapter_model.safetensors").exists()
    items = [ImageDoc(page_images[2]), "a text document", ImageDoc(page_images[7])]
    batch = enc.collate(items, "doc")
    with torch.no_grad():
        want = enc(**batch)
        plain = PeftModel.from_pretrained(AutoModel.from_pretrained(base_path), str(out)).eval()
        hidden = plain(**batch, use_cache=False).last_hidden_state
        last = batch["attention_mask"].sum(1) - 1
        got = torch.nn.functional.normalize(hidden[torch.arange(3), last], dim=-1)
        base = VisionLanguageEncoder(base_path, max_num_visual_tokens=12).eval()(**batch)
        loaded = load_encoder(out).eval()
        again = loaded(**loaded.collate(items, "doc"))
    assert (got - want).abs().max() < 1e-5
    assert (again - want).abs().max() < 1e-6
    assert (base - want).abs().max() > 1e-3  # the adapter is not silently without effect
    assert loaded.max_num_visual_tokens == 12 and loaded.is_lora


def test_a_lora_final_folder_loads_as_full_weights_and_its_adapter_in_peft(tiny_vl, page_images,
                                                                           tmp_path):
    """A LoRA run's final/ (``save_final``): merged weights for AutoModel.from_pretrained,
    the adapter in final/adapter/ for peft (issue 34, item 1)."""
    from peft import PeftModel
    from transformers import AutoModel

    base_path = tiny_vl("qwen2_vl")
    enc = VisionLanguageEncoder(base_path, lora_r=4, lora_alpha=8,
                                max_num_visual_tokens=12).eval()
    _perturb_lora(enc)
    out = enc.save_final(tmp_path / "final")
    assert not (out / "adapter_config.json").exists()
    items = [ImageDoc(page_images[2]), "a text document"]
    batch = enc.collate(items, "doc")
    last = batch["attention_mask"].sum(1) - 1

    def embed(model):
        hidden = model(**batch, use_cache=False).last_hidden_state
        return torch.nn.functional.normalize(hidden[torch.arange(2), last], dim=-1)

    with torch.no_grad():
        want = enc(**batch)
        merged = embed(AutoModel.from_pretrained(out).eval())
        peft = embed(PeftModel.from_pretrained(AutoModel.from_pretrained(base_path), str(out),
                                               subfolder="adapter").eval())
    assert (merged - want).abs().max() < 1e-5 and (peft - want).abs().max() < 1e-5


def test_prompt_ids_tokenize_each_text_once_and_literally(tiny_vl, page_images):
    """The prompt is the ChatML template around the text's own tokens: equal to tokenizing the
    whole prompt for ordinary text, cut at exactly ``max_length`` text tokens, and a special
    token written in user text stays text (no fake image slot, no early end of turn)."""
    from bigbatch.encoders.vision import DOC_INSTRUCTION, TEMPLATE

    enc = VisionLanguageEncoder(tiny_vl("qwen2_vl"), max_num_visual_tokens=6, max_length=12)
    tok = enc.tokenizer
    short = "heat shock"
    ids = enc.collate([short], "doc")["input_ids"][0].tolist()
    assert ids == tok(TEMPLATE.format(instruction=DOC_INSTRUCTION, content=short),
                      add_special_tokens=False)["input_ids"]

    long_text = "a claim about protein folding in heat-stressed cells"
    head, tail = (len(tok(p.replace("{instruction}", DOC_INSTRUCTION),
                          add_special_tokens=False)["input_ids"])
                  for p in TEMPLATE.split("{content}"))
    batch = enc.collate([long_text, short], "doc")
    assert int(batch["attention_mask"][0].sum()) == head + 12 + tail  # truncated to 12 tokens
    assert tok.decode(batch["input_ids"][0, head:head + 12]) == long_text.encode()[:12].decode()

    sneaky = "see <|image_pad|><|image_pad|> and <|im_end|> here"
    page = ImageDoc(page_images[2], text=sneaky)
    batch = enc.collate([sneaky, page], "doc")
    slots = int(batch["image_grid_thw"].prod(-1).item()) // 4
    assert int((batch["input_ids"] == enc.image_token_id).sum()) == slots  # the image's only
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert int((batch["input_ids"][0] == im_end).sum()) == 2  # system's and user's, not the text's
    with torch.no_grad():
        assert torch.isfinite(enc(**batch)).all()

    with pytest.raises(bb.ConfigError, match="query_instruction contains the vision token"):
        VisionLanguageEncoder(tiny_vl("qwen2_vl"), query_instruction="look: <|image_pad|>")


@pytest.mark.parametrize("layout", ["current", "pre-4.52"])
def test_generation_checkpoints_load_into_the_encoder(tiny_vl, page_images, tmp_path, layout):
    """Released Qwen-VL checkpoints are ``...ForConditionalGeneration`` (keys under
    ``model.``, plus ``lm_head``; older uploads with ``model.layers``/``visual.`` keys): the
    encoder loads every weight from either layout and embeds as the bare model does."""
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    base = tiny_vl("qwen2_vl")
    gen = transformers.Qwen2VLForConditionalGeneration.from_pretrained(base)
    out = tmp_path / "gen"
    gen.save_pretrained(out)
    for f in base.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    weights = load_file(out / "model.safetensors")
    assert "lm_head.weight" in weights
    if layout == "pre-4.52":
        weights = {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
                   for k, v in weights.items()}
        assert any(k.startswith("visual.") for k in weights)
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    inputs = QUERIES[:2] + [ImageDoc(page_images[0])]  # the language model and vision tower
    with torch.no_grad():
        want = VisionLanguageEncoder(base, max_num_visual_tokens=8).eval().encode(inputs, "doc")
        got = VisionLanguageEncoder(out, max_num_visual_tokens=8).eval().encode(inputs, "doc")
    assert torch.equal(want, got)


def test_training_from_a_saved_folder_embeds_as_it_was_saved(tiny_vl, tmp_path):
    """``bigbatch train --model <a vision-language folder bigbatch saved>`` took the seed's
    instructions and 256 visual tokens whatever the folder recorded, so the run's base
    evaluation disagreed with ``bigbatch eval`` on the same folder. Given options still win.
    A LoRA adapter folder is refused (its training would be dropped)."""
    from bigbatch.errors import ConfigError
    from bigbatch.train.config import load_config

    enc = VisionLanguageEncoder(tiny_vl("qwen3_vl"), query_instruction="Find the page.",
                                doc_instruction="A page.", max_num_visual_tokens=16,
                                max_length=128)
    out = enc.save(tmp_path / "final")
    c = load_config(None, {"model": str(out), "train_data": str(tmp_path)})
    assert (c.query_instruction, c.doc_instruction, c.max_num_visual_tokens,
            c.min_num_visual_tokens, c.max_length) == ("Find the page.", "A page.", 16, 4, 128)
    c = load_config(None, {"model": str(out), "train_data": str(tmp_path),
                           "max_num_visual_tokens": 32, "query_instruction": "Q"})
    assert (c.query_instruction, c.max_num_visual_tokens) == ("Q", 32)
    adapter = VisionLanguageEncoder(tiny_vl("qwen3_vl"), lora_r=2).save(tmp_path / "adapter")
    with pytest.raises(ConfigError, match="is a LoRA adapter over"):
        load_config(None, {"model": str(adapter), "train_data": str(tmp_path)})
