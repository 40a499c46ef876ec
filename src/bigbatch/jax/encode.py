"""A Flax sentence encoder as bigbatch's evaluation and mining code expect one: ``encode(texts,
side, batch_size, device, progress)`` returning float32 embeddings (a NumPy array, which the
retrieval code takes as it takes a tensor), so :func:`bigbatch.retrieval.evaluate.evaluate_beir`
scores a JAX model exactly as it scores a PyTorch one. Nothing here imports torch.

Texts are tokenized with the model folder's ``tokenizer.json`` (the ``tokenizers`` library,
the fast tokenizer transformers itself runs: the same token ids), embedded longest first
in batches of ``batch_size`` rows, each batch padded to a multiple of 32 tokens (and short
batches to ``batch_size`` rows), so the jitted forward pass compiles for a handful of shapes
only; padding never changes an embedding (masked tokens are left out of the attention and
the mean).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FlaxTextEncoder", "load_tokenizer"]

BUCKET = 32  # tokens: batches are padded to a multiple of this


class _FastTokenizer:
    """A ``tokenizer.json`` (the ``tokenizers`` library) called as transformers' tokenizers
    are called here: padded to the batch's longest with the folder's padding token, cut at
    ``max_length``, NumPy arrays."""

    def __init__(self, folder: Path) -> None:
        import json

        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = folder / "tokenizer_config.json"  # where transformers reads the pad token
        pad = json.loads(config.read_text(encoding="utf-8")).get("pad_token") \
            if config.is_file() else None
        pad = pad.get("content") if isinstance(pad, dict) else pad
        pad_id = self.tokenizer.token_to_id(pad) if pad else None
        if pad_id is None:  # the padding tokenizer.json was saved with, else id 0
            pad_id = (self.tokenizer.padding or {}).get("pad_id", 0)
        self.tokenizer.enable_padding(pad_id=pad_id,  # to the longest of each batch
                                      pad_token=self.tokenizer.id_to_token(pad_id) or "")

    def __call__(self, texts: list[str], padding: bool, truncation: bool, max_length: int,
                 return_tensors: str) -> dict[str, np.ndarray]:
        self.tokenizer.enable_truncation(max_length)
        enc = self.tokenizer.encode_batch(texts)

        def column(name: str) -> np.ndarray:
            return np.array([getattr(e, name) for e in enc], np.int64).reshape(len(enc), -1)

        return {"input_ids": column("ids"), "attention_mask": column("attention_mask"),
                "token_type_ids": column("type_ids")}


def load_tokenizer(folder: str | Path) -> Any:
    """The tokenizer of a model folder: its ``tokenizer.json`` read by the ``tokenizers``
    library (no torch), else transformers' ``AutoTokenizer``."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        return _FastTokenizer(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


class FlaxTextEncoder:
    """A Flax model and its parameters behind bigbatch's ``encode`` interface.

    Args:
        model: a Flax module ``apply(variables, input_ids, attention_mask, token_type_ids)``
            returning ``(rows, dim)`` (e.g. :class:`bigbatch.jax.bert.BertEncoder`).
        params: its parameters (replace ``self.params`` after training to evaluate them).
        tokenizer: a model folder (its ``tokenizer.json``; a folder without one is read by
            transformers' ``AutoTokenizer``, which imports torch where it is installed), or a
            tokenizer called as transformers' are (``tokenizer(texts, padding=True,
            truncation=True, max_length=..., return_tensors="np")``).
        max_length: tokens per text (longer texts are cut).

    Example::

        model, params = load_bert(path)
        encoder = FlaxTextEncoder(model, params, path, max_length=256)
        metrics = bigbatch.retrieval.evaluate.evaluate_beir(encoder, "scifact", "test")
    """

    multi_vector = False

    def __init__(self, model: Any, params: Any, tokenizer: Any, max_length: int = 256) -> None:
        if isinstance(tokenizer, (str, Path)):
            tokenizer = load_tokenizer(tokenizer)
        self.model, self.params, self.tokenizer = model, params, tokenizer
        self.max_length = max_length
        self._apply = jax.jit(lambda p, ids, mask, types: model.apply({"params": p}, ids, mask,
                                                                      types))

    def tokenize(self, texts: Sequence[str], max_length: int | None = None) -> dict[str, np.ndarray]:
        """Token ids, attention mask and token types of ``texts``, padded to their longest."""
        enc = self.tokenizer(list(texts), padding=True, truncation=True,
                             max_length=max_length or self.max_length, return_tensors="np")
        keys = ("input_ids", "attention_mask", "token_type_ids")
        out = {k: np.asarray(enc[k], np.int32) for k in keys if k in enc}
        out.setdefault("token_type_ids", np.zeros_like(out["input_ids"]))
        return out

    def encode(self, texts: Sequence[str], side: str = "doc", batch_size: int = 64,
               device: Any = None, progress: str | None = None) -> np.ndarray:
        """``(len(texts), dim)`` float32 embeddings in the order of ``texts`` (``side``
        and ``device`` are accepted for bigbatch's interface; both towers are this model)."""
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out: np.ndarray | None = None
        for lo in range(0, len(order), batch_size):
            rows = order[lo:lo + batch_size]
            enc = self.tokenize([texts[i] for i in rows])
            width = min(-(-enc["input_ids"].shape[1] // BUCKET) * BUCKET, self.max_length)
            pad = ((0, batch_size - len(rows)), (0, width - enc["input_ids"].shape[1]))
            arrays = [np.pad(enc[k], pad) for k in ("input_ids", "attention_mask",
                                                   "token_type_ids")]
            arrays[1][len(rows):, 0] = 1  # padding rows: one token, so their mean is defined
            emb = np.asarray(self._apply(self.params, *map(jnp.asarray, arrays)), np.float32)
            if out is None:
                out = np.empty((len(texts), emb.shape[1]), np.float32)
            out[rows] = emb[:len(rows)]
        return out if out is not None else np.empty((0, 0), np.float32)
