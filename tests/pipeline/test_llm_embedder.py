"""The LLM-embedder recipe on a tiny random Qwen3 decoder: last-token pooling with left
padding and the end-of-text token, Qwen3-Embedding's instruction before queries, a trained
folder that sentence-transformers embeds alike, ``--attn-implementation`` reaching
``from_pretrained``, the recipes in configs/ valid, and the memory estimate per process
(the start line's, and the distributed guide's table)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_helpers import minilm_path, scifact_slice

from bigbatch.encoders.tiny import build_tiny_text
from bigbatch.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
INSTRUCTION = "Instruct: Given a scientific claim, retrieve documents that support it\nQuery: "


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_tiny_text(tmp_path_factory.mktemp("qwen3") / "model")


def test_last_pooling_pads_left_and_ends_every_text_with_the_end_of_text_token(qwen3):
    from transformers import AutoTokenizer

    from bigbatch.encoders import TextEncoder
    from bigbatch.encoders.text import end_with_eos

    base = AutoTokenizer.from_pretrained(qwen3)
    assert base("a")["input_ids"][-1] != base.eos_token_id  # a base model's tokenizer
    enc = TextEncoder(qwen3, pooling="last", max_length=12)
    tok = enc.tokenizer
    batch = enc.tokenize(["short", "a text long enough to be cut at twelve tokens"], "doc")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert tok.padding_side == "left" and mask[0, 0] == 0 and mask[1].all()
    assert (ids[:, -1] == tok.eos_token_id).all()  # also where the text was truncated
    assert not end_with_eos(tok)  # a tokenizer that ends texts already is left as it is
    bert = AutoTokenizer.from_pretrained(minilm_path())
    assert not end_with_eos(bert) and bert.padding_side == "right"  # no end-of-text token


def test_a_trained_decoder_embeds_alike_in_sentence_transformers(qwen3, tmp_path):
    from sentence_transformers import SentenceTransformer

    from bigbatch.encoders import load_encoder

    data = scifact_slice(tmp_path / "sf", n_train=16, n_test=4, n_extra_docs=10)
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "bigbatch.cli", "train", "--model", str(qwen3), "--train-data",
         str(data), "--pooling", "last", "--query-prefix", INSTRUCTION, "--lora-r", "4",
         "--lora-alpha", "8", "--batch-size", "8", "--grad-cache-chunk", "4", "--max-steps",
         "2", "--warmup-steps", "1", "--max-length", "48", "--save-steps", "0",
         "--no-eval-at-start", "--report-to", "none", "--attn-implementation", "eager",
         "--output-dir", str(out)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "BIGBATCH_NO_PROGRESS": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model state ~" in proc.stdout and "AdamW states" in proc.stdout
    final = out / "final"
    prompts = json.loads((final / "config_sentence_transformers.json").read_text())["prompts"]
    assert prompts["query"] == INSTRUCTION
    texts = ["cells divide", "a claim about proteins in tissue", "x"]
    st = SentenceTransformer(str(final), device="cpu")
    ours = load_encoder(final)
    for side, name in (("query", "query"), ("doc", None)):
        want = ours.encode(texts, side=side)
        got = st.encode(texts, prompt_name=name, convert_to_tensor=True)
        assert (got - want).abs().max().item() <= 1e-5, side


def test_attn_implementation_reaches_from_pretrained(qwen3, tmp_path):
    from bigbatch.encoders import TextEncoder
    from bigbatch.train import load_config

    enc = TextEncoder(qwen3, pooling="last", attn_implementation="eager")
    assert enc.model.config._attn_implementation == "eager"
    if importlib.util.find_spec("flash_attn") is None:
        from bigbatch.train.build import build_encoder

        config = load_config(None, {"model": str(qwen3), "output_dir": str(tmp_path / "o"),
                                    "train_data": str(scifact_slice(tmp_path / "sf")),
                                    "attn_implementation": "flash_attention_2"})
        with pytest.raises(ConfigError, match="flash_attention_2 needs the flash-attn"):
            build_encoder(config, [], 0)
    with pytest.raises(ConfigError, match="--attn-implementation: must be one of"):
        load_config(None, {"model": str(qwen3), "output_dir": str(tmp_path / "o"),
                           "train_data": str(scifact_slice(tmp_path / "sf")),
                           "attn_implementation": "fast"})


RECIPES = sorted((ROOT / "configs").glob("qwen3*.yaml"))


def test_there_is_a_recipe_for_each_model_lora_and_full():
    names = {p.stem for p in RECIPES}
    for model in ("qwen3-embedding-0.6b", "qwen3-embedding-4b", "qwen3-embedding-8b",
                  "qwen3-vl-embedding-2b", "qwen3-vl-embedding-8b"):
        assert {f"{model}-lora", f"{model}-full"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_each_recipe_is_a_valid_configuration(recipe, qwen3, tmp_path):
    from bigbatch.train import load_config

    # the model (a hub name) replaced by the tiny one: every other option as written
    config = load_config(recipe, {"model": str(qwen3), "output_dir": str(tmp_path / "o"),
                                  "train_data": str(scifact_slice(tmp_path / "sf"))})
    assert config.fsdp and config.dtype == "bfloat16" and config.gradient_checkpointing
    if "-vl-" not in recipe.stem:
        assert config.pooling == "last" and config.query_prefix.startswith("Instruct: ")
        assert config.query_prefix.endswith("\nQuery: ")
    assert config.full_finetune == recipe.stem.endswith("-full")


def test_model_state_per_process_is_split_by_sharding(qwen3):
    from bigbatch.encoders import TextEncoder
    from bigbatch.train.model_memory import model_memory
    from bigbatch.train.sharding import transformer_blocks

    full = TextEncoder(qwen3, pooling="last")
    whole = model_memory(full, full.trainable_parameters())
    quarter = model_memory(full, full.trainable_parameters(), processes=4, sharded=True,
                           blocks=transformer_blocks(full.model))
    params = sum(p.numel() * p.element_size() for p in full.parameters())
    assert whole.weights == whole.gradients == params and whole.optimizer_states == 2 * params
    assert params / 4 <= quarter.weights <= params / 4 + 4 * len(list(full.parameters()))
    assert quarter.gathered > 0 and whole.gathered == 0
    lora = TextEncoder(qwen3, pooling="last", lora_r=4, lora_alpha=8)
    adapters = model_memory(lora, lora.trainable_parameters())
    assert adapters.gradients == sum(p.numel() * 4 for n, p in lora.named_parameters()
                                     if "lora_" in n)


def test_the_guide_table_is_what_the_estimator_computes():
    spec = importlib.util.spec_from_file_location("llm_memory", ROOT / "bench" / "llm_memory.py")
    llm_memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(llm_memory)
    rows = [llm_memory.estimate(p) for p in RECIPES]
    guide = (ROOT / "docs" / "guides" / "distributed.md").read_text()
    for line in llm_memory.table(rows).splitlines()[2:]:
        assert line in guide, line
    # the counts are those of the published models
    params = {r["recipe"]: r["params"] for r in rows}
    assert 0.59e9 < params["qwen3-embedding-0.6b-full"] < 0.61e9
    assert 7.5e9 < params["qwen3-embedding-8b-full"] < 7.6e9
    assert all(r["total"] < 80e9 for r in rows)
