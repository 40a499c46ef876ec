"""The text encoder: pooling modes, prefixes, gradient checkpointing composed with the cache,
and saved outputs that load in transformers (+ peft) and sentence-transformers with the same
embeddings, for LoRA, merged LoRA and full fine-tuning."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import grads_of, max_rel_err, zero_grads
from pipeline_helpers import minilm_path, tiny_bert

import bigbatch as bb
from bigbatch.encoders import TextEncoder, default_lora_targets
from bigbatch.errors import ConfigError

TEXTS = ["a short one", "a somewhat longer sentence about proteins and cells",
         "tumor suppression by p53"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_bert(tmp_path_factory.mktemp("tiny") / "bert", dropout=0.0)


def test_pooling_modes(tiny):
    enc = TextEncoder(tiny, pooling="mean", normalize=False)
    batch = enc.tokenize(TEXTS)
    hidden = enc.model(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).float()
    assert torch.allclose(enc(**batch), (hidden * m).sum(1) / m.sum(1), atol=1e-6)
    enc.pooling = "cls"
    assert torch.allclose(enc(**batch), hidden[:, 0])
    enc.pooling = "last"
    lengths = batch["attention_mask"].sum(1)
    assert torch.allclose(enc(**batch), hidden[torch.arange(3), lengths - 1])
    # left padding: the last token is the final column for every row
    enc.tokenizer.padding_side = "left"
    left = enc.tokenize(TEXTS)
    assert (left["attention_mask"][:, -1] == 1).all()
    out = enc(**left)
    assert torch.allclose(out, enc.model(**left).last_hidden_state[:, -1])
    with pytest.raises(ConfigError, match="pooling"):
        TextEncoder(tiny, pooling="max")


def test_prefixes_and_normalisation(tiny):
    enc = TextEncoder(tiny, query_prefix="query: ", doc_prefix="passage: ")
    q = enc.tokenize(["x"], side="query")["input_ids"][0].tolist()
    assert enc.tokenizer.decode(q, skip_special_tokens=True).replace(" ", "") == "query:x"
    e = enc.encode(TEXTS, side="doc", batch_size=2)
    assert e.shape == (3, 32) and torch.allclose(e.norm(dim=1), torch.ones(3), atol=1e-5)


def test_lora_defaults_and_errors(tiny):
    assert default_lora_targets("bert") == ["query", "key", "value", "dense"]
    assert default_lora_targets("qwen3") == ["q_proj", "k_proj", "v_proj", "o_proj"]
    enc = TextEncoder(tiny, lora_r=4, lora_alpha=8)
    trainable = [n for n, p in enc.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with pytest.raises(ConfigError, match="do not fit"):
        TextEncoder(tiny, lora_r=4, lora_target_modules=["no_such_module"])


def test_gradient_checkpointing_composes_with_the_cache(tiny):
    grads = {}
    for gc in (False, True):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # no deprecated transformers call
            enc = TextEncoder(tiny, gradient_checkpointing=gc).double()
        enc.train()
        loss_fn = bb.InfoNCE().double()
        q = enc.tokenize(TEXTS, "query")
        d = enc.tokenize(TEXTS[::-1] * 2)
        cache = bb.GradCache({"query": enc, "doc": enc}, loss_fn, chunk_size=2)
        zero_grads(enc, loss_fn)
        cache.step(query=q, doc=d)
        grads[gc] = grads_of(enc, loss_fn)
    assert max_rel_err(grads[True], grads[False]) <= 1e-10


def _trained(tiny, lora):
    torch.manual_seed(0)
    enc = TextEncoder(tiny, lora_r=4 if lora else 0, lora_alpha=8, query_prefix="query: ",
                      doc_prefix="passage: ", max_length=64)
    # move the weights away from the base so a silently unloaded adapter would show
    with torch.no_grad():
        for n, p in enc.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return enc.eval()


def _hf_embed(model, tok, texts, prefix):
    batch = tok([prefix + t for t in texts], padding=True, truncation=True, max_length=64,
                return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)


@pytest.mark.parametrize("mode", ["full", "lora", "lora-merged"])
def test_saved_model_loads_in_transformers_peft_and_sentence_transformers(tiny, tmp_path, mode):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    enc = _trained(tiny, lora=mode != "full")
    ours_q = enc.encode(TEXTS, side="query")
    ours_d = enc.encode(TEXTS, side="doc")
    out = enc.save(tmp_path / "final", merge_lora=mode == "lora-merged")

    tok = AutoTokenizer.from_pretrained(out)
    if mode == "lora":
        from peft import PeftModel
        assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
        model = PeftModel.from_pretrained(AutoModel.from_pretrained(tiny), out)
        # transformers' own peft integration loads the adapter folder directly, too
        direct = AutoModel.from_pretrained(out)
        assert torch.allclose(_hf_embed(direct, tok, TEXTS, "passage: "), ours_d, atol=1e-5)
    else:
        model = AutoModel.from_pretrained(out)
    assert torch.allclose(_hf_embed(model, tok, TEXTS, "passage: "), ours_d, atol=1e-5)
    base = _hf_embed(AutoModel.from_pretrained(tiny), tok, TEXTS, "passage: ")
    assert not torch.allclose(base, ours_d, atol=1e-3)  # the fine-tuning is really in there

    st = SentenceTransformer(str(out), device="cpu")
    st_q = torch.tensor(st.encode(TEXTS, prompt_name="query"))
    st_d = torch.tensor(st.encode(TEXTS, prompt_name="document"))
    assert torch.allclose(st_q, ours_q, atol=1e-5)
    assert torch.allclose(st_d, ours_d, atol=1e-5)


@pytest.mark.parametrize("side", ["right", "left"])
def test_tokenize_in_blocks_equals_one_call(side):
    enc = TextEncoder(minilm_path(), max_length=40)
    enc.tokenizer.padding_side = side
    texts = ["short", "a much longer text " * 10, "mid length text here", "x y"] * 5
    whole = enc.tokenize(texts, block=10_000)
    blocks = enc.tokenize(texts, block=3)
    assert whole.keys() == blocks.keys()
    assert all(torch.equal(whole[k], blocks[k]) for k in whole)


def test_weights_that_did_not_load_are_refused(tiny, tmp_path):
    """A base checkpoint missing a weight, or an adapter whose keys do not match the model,
    is an error naming the keys, never a model that silently runs on random or zero values
    (the seed pipeline lost a training run to adapter keys that did not load)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from bigbatch.encoders import load_encoder

    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    weights = load_file(broken / "model.safetensors")
    key = next(k for k in weights if "layer.1.attention.self.query.weight" in k)
    del weights[key]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"1 weight\(s\) of BertModel were not loaded.*"
                                          r"layer\.1\.attention\.self\.query\.weight"):
        TextEncoder(broken)

    no_pooler = tmp_path / "no_pooler"  # sentence-transformers folders carry no pooler
    shutil.copytree(tiny, no_pooler)
    weights = {k: v for k, v in load_file(tiny / "model.safetensors").items()
               if "pooler" not in k}
    save_file(weights, no_pooler / "model.safetensors", metadata={"format": "pt"})
    TextEncoder(no_pooler)

    out = _trained(tiny, lora=True).save(tmp_path / "adapter")
    load_encoder(out)  # loads as saved
    adapter = load_file(out / "adapter_model.safetensors")
    renamed = {k.replace("encoder.layer", "encoder.layers"): v for k, v in adapter.items()}
    save_file(renamed, out / "adapter_model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="adapter's weights do not match"):
        load_encoder(out)


def test_vision_flags_on_a_text_model_are_an_error(tiny):
    from bigbatch.encoders import load_encoder

    with pytest.raises(ConfigError, match=r"\['max_num_visual_tokens'\] apply to "
                                          r"vision-language models only"):
        load_encoder(tiny, max_num_visual_tokens=16)
    assert load_encoder(tiny, max_length=20).max_length == 20


@pytest.mark.parametrize("mode", ["full", "lora", "lora-merged"])
def test_query_side_tuned_folder_reloads_its_frozen_document_tower(tiny, tmp_path, mode):
    """Query-side tuning embeds documents with the base weights; the saved folder must reload
    that tower in every save mode (a merged LoRA save used to record no base model, and the
    reloaded encoder then embedded documents with the fine-tuned weights)."""
    from bigbatch.encoders import load_encoder

    enc = TextEncoder(tiny, lora_r=4 if mode != "full" else 0, lora_alpha=8, max_length=64)
    enc.use_base_doc_tower()
    base_docs = enc.encode(TEXTS, side="doc")
    with torch.no_grad():  # "training": move the trainable weights away from the base
        for p in enc.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    queries = enc.encode(TEXTS, side="query")
    assert torch.allclose(enc.encode(TEXTS, side="doc"), base_docs, atol=1e-6)
    out = enc.save(tmp_path / "final", merge_lora=mode == "lora-merged")
    back = load_encoder(out)
    assert back.doc_tower == "base"
    assert torch.allclose(back.encode(TEXTS, side="query"), queries, atol=1e-5)
    assert torch.allclose(back.encode(TEXTS, side="doc"), base_docs, atol=1e-5)
    assert not torch.allclose(queries, base_docs, atol=1e-3)  # the tuning is really in there


def test_saved_folder_names_its_base_model_by_absolute_path(tiny, tmp_path, monkeypatch):
    """A model given by a relative path is recorded as an absolute one, so the adapter (and
    ``bigbatch_encoder.json``) load from any working directory, as peft and
    sentence-transformers load them."""
    import json
    import shutil

    from sentence_transformers import SentenceTransformer

    from bigbatch.encoders import load_encoder

    shutil.copytree(tiny, tmp_path / "models" / "bert")
    monkeypatch.chdir(tmp_path)
    enc = _trained("models/bert", lora=True)
    ours = enc.encode(TEXTS, side="doc")
    out = enc.save(tmp_path / "final")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    recorded = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str(tmp_path / "models" / "bert")
    assert json.loads((out / "bigbatch_encoder.json").read_text())["base_model"] == recorded
    assert torch.allclose(load_encoder(out).encode(TEXTS, side="doc"), ours, atol=1e-5)
    st = SentenceTransformer(str(out), device="cpu")
    assert torch.allclose(torch.tensor(st.encode(TEXTS, prompt_name="document")), ours, atol=1e-5)


@pytest.mark.parametrize("keep_adapter", [True, False])
def test_a_lora_final_folder_is_full_weights_with_the_adapter_beside(tiny, tmp_path,
                                                                      keep_adapter):
    """Trap 1 of issue 34: a LoRA ``final/`` that was an adapter folder loaded as the base
    model in transformers 5.0-5.5.4 (and sentence-transformers over them), the adapter's
    keys only listed as unexpected. ``save_final`` writes full weights there, which every
    version reads alike (no ``adapter_config.json`` for a loader to follow), and the peft
    adapter alone in ``final/adapter/`` (none with ``keep_adapter=False``,
    ``--merge-lora``)."""
    import json

    from peft import PeftModel
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    from bigbatch.encoders import load_encoder

    enc = _trained(tiny, lora=True)
    ours_q, ours_d = enc.encode(TEXTS, side="query"), enc.encode(TEXTS, side="doc")
    out = enc.save_final(tmp_path / "final", keep_adapter=keep_adapter)
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    assert not (out / "adapter_config.json").exists()
    meta = json.loads((out / "bigbatch_encoder.json").read_text())
    assert meta["lora"] is False and meta.get("adapter") == ("adapter" if keep_adapter else None)
    tok = AutoTokenizer.from_pretrained(out)
    # merging adds B @ A into W once: equal to the unmerged model to float32 rounding
    plain = _hf_embed(AutoModel.from_pretrained(out), tok, TEXTS, "passage: ")
    assert torch.allclose(plain, ours_d, atol=1e-5)
    st = SentenceTransformer(str(out), device="cpu")
    assert torch.allclose(torch.tensor(st.encode(TEXTS, prompt_name="query")), ours_q, atol=1e-5)
    reloaded = load_encoder(out)
    assert not reloaded.is_lora  # the merged weights, as the clients read them
    assert torch.equal(reloaded.encode(TEXTS, side="doc"),
                       torch.tensor(st.encode(TEXTS, prompt_name="document")))
    adapter = out / "adapter"
    if not keep_adapter:
        assert not adapter.exists()
        return
    # the adapter alone: peft loads it on the base; no folder loader takes it for a model
    assert sorted(p.name for p in adapter.iterdir()) == ["README.md", "adapter_config.json",
                                                         "adapter_model.safetensors"]
    peft = PeftModel.from_pretrained(AutoModel.from_pretrained(tiny), adapter)
    assert torch.allclose(_hf_embed(peft, tok, TEXTS, "passage: "), ours_d, atol=1e-5)
    assert str(tmp_path) not in (adapter / "README.md").read_text()


@pytest.mark.parametrize("lora_r", [4, 0])
def test_an_adapter_folder_is_refused_as_a_model_to_train(tiny, tmp_path, lora_r):
    """A LoRA run's ``final/`` is an adapter, not a model: transformers loads it with the
    adapter frozen, so a new LoRA of the same name replaced it (its training silently gone,
    training restarted from the base) and full fine-tuning had nothing to train. Refused,
    naming the base model, as are a checkpoint directory and a path that does not exist."""
    from bigbatch.train.config import load_config

    out = _trained(tiny, lora=True).save(tmp_path / "final")
    with pytest.raises(ConfigError, match=r"final is a LoRA adapter over .*bert"):
        TextEncoder(out, lora_r=lora_r, max_length=64)
    with pytest.raises(ConfigError, match="--model: .* is a LoRA adapter"):
        load_config(None, {"model": str(out), "train_data": str(tmp_path)})
    ckpt = tmp_path / "run" / "checkpoint-000002"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="checkpoint directory; give its model folder"):
        TextEncoder(ckpt)
    with pytest.raises(ConfigError, match="--model: no such folder: .*nowhere"):
        TextEncoder(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="holds no transformers model"):
        TextEncoder(tmp_path / "run")


def test_an_adapter_whose_base_is_gone_is_a_clear_error(tiny, tmp_path):
    import json
    import shutil

    from bigbatch.encoders import load_encoder

    shutil.copytree(tiny, tmp_path / "bert")
    out = _trained(tmp_path / "bert", lora=True).save(tmp_path / "final")
    shutil.rmtree(tmp_path / "bert")
    with pytest.raises(ConfigError, match=r"final: the adapter's base model: no such folder: "
                                          r".*bert"):
        load_encoder(out)
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]


def test_cls_pooling_of_left_padded_rows_matches_sentence_transformers(tiny, tmp_path):
    """``cls`` took column 0, which is padding in a left-padded row: the saved folder's
    embeddings differed from sentence-transformers' (which pools the first real token)."""
    from sentence_transformers import SentenceTransformer

    enc = TextEncoder(tiny, pooling="cls", max_length=64).eval()
    enc.tokenizer.padding_side = "left"
    tokens = enc.tokenize(TEXTS)
    first = tokens["attention_mask"].int().argmax(1)
    assert (first > 0).any()  # some rows really are left-padded
    hidden = enc.model(**tokens).last_hidden_state
    want = torch.nn.functional.normalize(hidden[torch.arange(3), first], dim=-1)
    assert torch.allclose(enc(**tokens), want, atol=1e-6)
    batch = enc.encode(TEXTS)
    st = SentenceTransformer(str(enc.save(tmp_path / "final")), device="cpu")
    assert st.tokenizer.padding_side == "left"
    assert torch.allclose(torch.tensor(st.encode(TEXTS)), batch, atol=1e-5)


def test_a_hub_name_that_cannot_be_loaded_is_a_config_error(monkeypatch, tmp_path):
    """Offline (as here) a hub name not in the cache was a transformers OSError traceback."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="no-such-org/no-such-model is no local folder and is not "
                                          "in the Hugging Face cache, and HF_HUB_OFFLINE is set"):
        TextEncoder("no-such-org/no-such-model")
