"""bigbatch.jax runs without torch: importing it, loading a BERT, tokenizing, embedding and a
cached step import no torch module (the import-linter contract ``jax-without-torch`` checks
bigbatch's own imports; this checks what runs, libraries included). Its tokenizer reads
``tokenizer.json`` and gives transformers' token ids."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pipeline_helpers import minilm_path, tiny_bert

ROOT = Path(__file__).resolve().parents[2]

RUN = """
import sys
import jax
import jax.numpy as jnp
import numpy as np
import bigbatch.jax
from bigbatch.jax import InfoNCE, cached_value_and_grad
from bigbatch.jax.bert import bert_embed_fn, load_bert
from bigbatch.jax.encode import FlaxTextEncoder

folder = sys.argv[1]
model, params = load_bert(folder)
encoder = FlaxTextEncoder(model, params, folder, max_length=16)
emb = encoder.encode(["a short text", "another, longer text than that one", "x"], batch_size=2)
assert isinstance(emb, np.ndarray) and emb.shape[0] == 3, emb
batch = {side: encoder.tokenize(["one", "two words", "three words here", "four"])
         for side in ("query", "doc")}
loss = InfoNCE(temperature=0.05)
step = cached_value_and_grad(bert_embed_fn(model), loss, chunk_size=3)
value, _, _ = step({"model": params, **loss.init_params()}, batch, jax.random.key(0))
assert np.isfinite(float(value))
print("torch modules:", sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


@pytest.mark.slow
def test_the_step_the_encoder_and_the_loss_run_without_torch(tmp_path):
    folder = tiny_bert(tmp_path / "bert")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", RUN, str(folder)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch modules: []" in out.stdout, out.stdout


def test_importing_the_loss_layout_rules_imports_no_torch():
    """bigbatch.losses resolves its names when first used: its torch-free module alone."""
    code = "import sys, bigbatch.losses.layout; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


@pytest.mark.parametrize("max_length", [8, 256])
def test_the_tokenizer_gives_transformers_ids(max_length):
    from transformers import AutoTokenizer

    from bigbatch.jax.encode import load_tokenizer

    texts = ["A short claim about cells.", "Café naïve résumé — ÜNÏCÖDÉ", "東京タワーは 333 m",
             "", " ".join(["word"] * 600), "tabs\tand\nnew lines", "MiXeD CaSe 123.45%"]
    ours = load_tokenizer(minilm_path())(texts, padding=True, truncation=True,
                                         max_length=max_length, return_tensors="np")
    theirs = AutoTokenizer.from_pretrained(str(minilm_path()))(
        texts, padding=True, truncation=True, max_length=max_length, return_tensors="np")
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        np.testing.assert_array_equal(ours[key], theirs[key])
