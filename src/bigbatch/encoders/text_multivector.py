"""A ColBERT-style multi-vector text encoder (late interaction): the text model's last hidden
states, a linear projection of each token to ``dim`` numbers (128), L2-normalised per token,
returned as :class:`bigbatch.TokenEmbeddings` for :class:`bigbatch.MaxSimInfoNCE`. Saved in
PyLate's layout, so ``pylate.models.ColBERT(path)`` (and sentence-transformers'
``MultiVectorEncoder``) load a saved folder with the same token embeddings, and a PyLate
folder loads here.

It embeds as PyLate 1.x (``pylate.models.ColBERT``) does:

- marker tokens ``"[Q] "`` / ``"[D] "`` are added to the tokenizer and inserted after the
  first token ([CLS]) of every query / document; texts are cut to ``length - 1`` tokens
  first, so a row holds at most ``length`` tokens. A marker's new embedding row starts as the
  mean of the rows of its text's own tokens (``[``, ``q``, ``]``), not at random as in PyLate:
  deterministic, so under LoRA (which leaves it frozen) an adapter needs no copy of it;
- documents: padding and punctuation (each character of ``string.punctuation`` that the
  tokenizer has as a token, the ``skiplist``) are masked: embedded, attended to, not scored;
- queries: with ``query_expansion`` (ColBERT's query augmentation) padded with the mask token
  ([MASK]; a model without one: its end-of-sequence token) to exactly ``query_length``
  tokens, all scored; the text does not attend to them (unless ``attend_to_expansion``), they
  attend to the text. Without it, queries are cut at ``query_length`` (default
  ``max_length``) and padding is masked;
- ``Linear(hidden, dim, bias=False)``, then L2 normalisation of every token.

Inputs (:meth:`MultiVectorTextEncoder.tokenize`): ``input_ids``, ``attention_mask`` (1: a
token of the row, expansion tokens included; what the engine trims and sorts chunks by),
``token_type_ids`` where the model has them, and ``skip_mask`` (documents: tokens embedded
but not scored) or ``expansion_mask`` (expanded queries: tokens the text does not attend to).
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..engine.embeddings import TokenEmbeddings
from ..errors import ConfigError
from .base import scored_rows, tokens_in_order
from .source import read_json
from .text import TextEncoder, check_texts

__all__ = ["MultiVectorTextEncoder", "multivector_settings", "QUERY_MARKER", "DOC_MARKER",
           "DEFAULT_DIM"]

QUERY_MARKER, DOC_MARKER = "[Q] ", "[D] "  # PyLate's defaults
DEFAULT_DIM = 128
_TRANSFORMER = "sentence_transformers.models.Transformer"
_DENSE = "pylate.models.Dense.Dense"
_IDENTITY = "torch.nn.modules.linear.Identity"
_DENSE_WEIGHTS = "model.safetensors"


def _json(path: Path) -> Any:
    return read_json(path, {}, mapping=False)  # (modules.json is a list)


def _dense_folder(path: Path) -> Path | None:
    """The projection's folder named by ``modules.json`` (a Dense module), or None."""
    modules = _json(path / "modules.json") if (path / "modules.json").exists() else []
    dense = [m for m in modules if str(m.get("type", "")).endswith("Dense")]
    return path / dense[0]["path"] if dense else None


def multivector_settings(path: str | os.PathLike) -> dict[str, Any] | None:
    """The :class:`MultiVectorTextEncoder` settings of a PyLate-layout folder (saved by PyLate
    or by bigbatch: a Dense module and a MaxSim ``config_sentence_transformers.json``); None
    for any other folder.

    Raises:
        ConfigError: a module or projection option the encoder cannot reproduce (a residual,
            an activation, more modules).
    """
    path = Path(path)
    cfg = _json(path / "config_sentence_transformers.json")
    dense = _dense_folder(path)
    if dense is None or not (cfg.get("similarity_fn_name") == "MaxSim" or
                             "document_length" in cfg):
        return None
    types = [m.get("type", "") for m in _json(path / "modules.json")]
    other = [t for t in types if not (t.endswith("Dense") or t.endswith("Transformer"))]
    dcfg = _json(dense / "config.json")
    if other or len(types) != 2:
        raise ConfigError(f"{path / 'modules.json'}: modules {types} are not supported; a "
                          f"multi-vector model is Transformer -> Dense")
    if dcfg.get("use_residual") or dcfg.get("activation_function", _IDENTITY) != _IDENTITY:
        raise ConfigError(f"{dense / 'config.json'}: a projection with an activation or a "
                          f"residual is not supported (bigbatch's is linear)")
    prompts = cfg.get("prompts") or {}
    out = {"dim": int(dcfg["out_features"]), "projection_bias": bool(dcfg.get("bias", True)),
           "max_length": int(cfg.get("document_length", 180)),
           "query_length": int(cfg.get("query_length", 32)),
           "query_expansion": bool(cfg.get("do_query_expansion", True)),
           "attend_to_expansion": bool(cfg.get("attend_to_expansion_tokens", False)),
           "skiplist": cfg.get("skiplist_words"),
           "query_prefix": prompts.get("query", ""),
           "doc_prefix": prompts.get("document", prompts.get("passage", ""))}
    for key, default, name in (("query_marker", QUERY_MARKER, "query_prefix"),
                               ("doc_marker", DOC_MARKER, "document_prefix")):
        out[key] = default if cfg.get(name) is None else cfg[name]
    return out


class MultiVectorTextEncoder(TextEncoder):
    """One L2-normalised ``dim``-vector per token (ColBERT, PyLate's layout): module docstring.

    Args:
        model: a transformers model folder, or a PyLate-layout folder (its projection loads).
        dim: the projection's width (None: the folder's, else 128).
        max_length: documents' length in tokens, marker included.
        query_prefix, doc_prefix: text put before every query / document (prompts).
        query_marker, doc_marker: marker tokens ("" for none).
        query_length: queries' length in tokens (None: ``max_length``).
        query_expansion: pad queries with mask tokens to ``query_length``.
        attend_to_expansion: let every query token attend to the expansion tokens.
        skiplist: words of documents masked when they are one token (None: punctuation).
        projection_bias: the projection has a bias (PyLate: no).
        lora_r, lora_alpha, lora_dropout, lora_target_modules, gradient_checkpointing, dtype:
            as for :class:`~bigbatch.encoders.TextEncoder`; the projection always trains.
        attn_implementation: as for :class:`~bigbatch.encoders.TextEncoder`.
        pooling: only ``"multivector"`` (the saved settings name it).

    Raises:
        ConfigError: a bad option, or a projection of another width in the folder.
    """

    multi_vector = True

    def __init__(self, model: str | os.PathLike, *, dim: int | None = None,
                 max_length: int = 256, query_prefix: str = "", doc_prefix: str = "",
                 query_marker: str = QUERY_MARKER, doc_marker: str = DOC_MARKER,
                 query_length: int | None = None, query_expansion: bool = False,
                 attend_to_expansion: bool = False, skiplist: Sequence[str] | None = None,
                 projection_bias: bool = False, lora_r: int = 0, lora_alpha: int = 32,
                 lora_dropout: float = 0.0, lora_target_modules: Sequence[str] | None = None,
                 gradient_checkpointing: bool = False, dtype: torch.dtype | None = None,
                 pooling: str = "multivector", attn_implementation: str | None = None) -> None:
        super().__init__(model, max_length=max_length, query_prefix=query_prefix,
                         doc_prefix=doc_prefix, dtype=dtype,
                         attn_implementation=attn_implementation)
        if pooling != "multivector":
            raise ConfigError(f"pooling of a multi-vector encoder is 'multivector', got "
                              f"{pooling!r}")
        if query_length is not None and query_length <= 1:
            raise ConfigError(f"query_length must be > 1 (a marker and a token), got "
                              f"{query_length}")
        if query_expansion and query_length is None:
            raise ConfigError("query_expansion needs query_length (the padded length)")
        self.pooling = "multivector"
        self.query_marker, self.doc_marker = query_marker, doc_marker
        self.query_length, self.query_expansion = query_length, query_expansion
        self.attend_to_expansion = attend_to_expansion and query_expansion
        self.skiplist = list(string.punctuation) if skiplist is None else list(skiplist)
        self.tokenizer.padding_side = "right"  # the marker goes after the first token
        self._marker_ids = {"query": self._add_marker(query_marker),
                            "doc": self._add_marker(doc_marker)}
        tok = self.tokenizer
        self._skip_ids = sorted({i for i in tok.convert_tokens_to_ids(self.skiplist)
                                 if i is not None})
        self._expansion_id = next((i for i in (tok.mask_token_id, tok.eos_token_id,
                                               tok.pad_token_id) if i is not None), 0)
        if dim is not None and dim <= 0:
            raise ConfigError(f"dim must be > 0, got {dim}")
        folder = Path(self.model_name)
        dense = _dense_folder(folder)
        width = int(_json(dense / "config.json").get("out_features", 0)) if dense else 0
        if dim is not None and width and dim != width:
            raise ConfigError(f"{folder}: its projection has {width} dimensions, but "
                              f"{dim} were asked for (--multivector-dim)")
        width = width or dim or DEFAULT_DIM
        hidden = self.model.get_input_embeddings().weight
        self.projection = nn.Linear(hidden.shape[1], width, bias=projection_bias).to(
            dtype=hidden.dtype)
        self.load_projection(folder)
        if lora_r > 0:
            self._apply_lora(lora_r, lora_alpha, lora_dropout, lora_target_modules)
        if gradient_checkpointing:
            self._enable_gradient_checkpointing()

    # -------------------------------------------------------------- set-up
    def _add_marker(self, marker: str) -> int | None:
        """The marker's token id (None for no marker), added to the tokenizer and the input
        embeddings when new; the new row is the mean of the rows of the marker text's
        tokens."""
        if not marker:
            return None
        tok = self.tokenizer
        if marker in tok.get_vocab():
            return tok.convert_tokens_to_ids(marker)
        parts = tok(marker, add_special_tokens=False)["input_ids"] or [tok.unk_token_id or 0]
        tok.add_tokens([marker])
        new = tok.convert_tokens_to_ids(marker)
        emb = self.model.get_input_embeddings()
        if new >= emb.weight.shape[0]:
            self.model.resize_token_embeddings(new + 1, mean_resizing=False)
            emb = self.model.get_input_embeddings()
        with torch.no_grad():
            emb.weight[new] = emb.weight[parts].mean(0)
        return new

    def load_projection(self, folder: str | os.PathLike) -> None:
        """Load the projection's weights from a PyLate-layout folder's Dense module (a folder
        without one leaves them as they are).

        Raises:
            ConfigError: weights of another shape.
        """
        dense = _dense_folder(Path(folder))
        if dense is None or not (dense / _DENSE_WEIGHTS).exists():
            return
        from safetensors.torch import load_file

        saved = load_file(str(dense / _DENSE_WEIGHTS))
        state = {k.removeprefix("linear."): v for k, v in saved.items()}
        try:
            self.projection.load_state_dict(state)
        except RuntimeError as e:
            raise ConfigError(f"{dense}: the projection's weights do not fit: {e}") from e

    def use_base_doc_tower(self, base_model: str | os.PathLike | None = None) -> None:
        raise ConfigError("query-side tuning (a frozen document tower) is not supported for "
                          "multi-vector encoders")

    # -------------------------------------------------------------- forward
    def tokenize(self, texts: Sequence[str], side: str = "doc",
                 max_length: int | None = None, block: int = 2048) -> dict[str, Tensor]:
        """Tokenize ``texts`` as queries or documents: prefix, marker and masks (module
        docstring). ``max_length``: cut there instead (not expanded queries)."""
        query = side == "query"
        expand = query and self.query_expansion
        length = self.query_length if expand else \
            max_length or (self.query_length if query else None) or self.max_length
        marker = self._marker_ids["query" if query else "doc"]
        inner = length - (marker is not None)
        enc = super().tokenize([t.strip() for t in texts], side, max_length=inner, block=block)
        if expand:
            extra = inner - enc["input_ids"].shape[1]
            enc = {k: nn.functional.pad(v, (0, extra)) for k, v in enc.items()}
            added = enc["attention_mask"] == 0
            enc["input_ids"] = enc["input_ids"].masked_fill(added, self._expansion_id)
            enc["attention_mask"] = torch.ones_like(enc["attention_mask"])
            enc["expansion_mask"] = added
        elif not query and self._skip_ids:
            enc["skip_mask"] = torch.isin(enc["input_ids"], torch.tensor(self._skip_ids))
        if marker is not None:
            fill = {"input_ids": marker, "attention_mask": 1}
            enc = {k: torch.cat([v[:, :1], torch.full_like(v[:, :1], fill.get(k, 0)), v[:, 1:]],
                                1) for k, v in enc.items()}
        return enc

    def forward(self, input_ids: Tensor, attention_mask: Tensor,
                token_type_ids: Tensor | None = None, skip_mask: Tensor | None = None,
                expansion_mask: Tensor | None = None) -> TokenEmbeddings:
        return self._embed(self.model, input_ids, attention_mask, token_type_ids, skip_mask,
                           expansion_mask)

    def _embed(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
               token_type_ids: Tensor | None = None, skip_mask: Tensor | None = None,
               expansion_mask: Tensor | None = None) -> TokenEmbeddings:
        attend = attention_mask
        if expansion_mask is not None and not self.attend_to_expansion:
            attend = attention_mask.masked_fill(expansion_mask, 0)
        kwargs = {"input_ids": input_ids, "attention_mask": attend}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        hidden = model(**kwargs).last_hidden_state
        values = nn.functional.normalize(self.projection(hidden), dim=-1)
        mask = attention_mask != 0
        if skip_mask is not None:
            mask = mask & ~skip_mask
        return TokenEmbeddings(values, mask)

    def encode_tokens(self, texts: Sequence[str], side: str = "doc", batch_size: int = 64,
                      device: torch.device | str | None = None, progress: str | None = None,
                      autocast_dtype: torch.dtype | None = None
                      ) -> Iterator[tuple[list[int], list[Tensor]]]:
        """Embed ``texts`` in batches (longest first) in eval mode without gradient; yields
        each batch's text indices and, per text, its scored tokens' vectors ``(tokens, dim)``
        (float32, on the CPU)."""
        check_texts(texts)
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        for idx, out in self._encode_batches(texts, side, batch_size, device, progress,
                                             autocast_dtype, order, self.tokenize, "text"):
            yield idx, scored_rows(out)

    def encode(self, texts: Sequence[str], side: str = "doc", batch_size: int = 64,
               device: torch.device | str | None = None, progress: str | None = None,
               autocast_dtype: torch.dtype | None = None) -> TokenEmbeddings:
        """The scored tokens of ``texts`` as one TokenEmbeddings (float32, on the CPU, padded
        to the longest text), in input order."""
        return tokens_in_order(self.encode_tokens(texts, side, batch_size, device, progress,
                                                  autocast_dtype), len(texts),
                               self.projection.out_features)

    # -------------------------------------------------------------- saving
    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "pooling": "multivector",
                "dim": self.projection.out_features,
                "projection_bias": self.projection.bias is not None,
                "query_marker": self.query_marker, "doc_marker": self.doc_marker,
                "query_length": self.query_length, "query_expansion": self.query_expansion,
                "attend_to_expansion": self.attend_to_expansion, "skiplist": self.skiplist}

    def _adapter_save_options(self) -> dict[str, Any]:
        # the markers' rows are recomputed from the base model (frozen under LoRA): peft
        # would otherwise save the whole resized embedding matrix with the adapter
        return {"save_embedding_layers": False}

    def _save_extras(self, path: Path) -> None:
        """PyLate's files: ``modules.json`` (Transformer -> Dense), the projection in
        ``1_Dense``, and ``config_sentence_transformers.json`` with PyLate's keys."""
        from safetensors.torch import save_file

        modules = [{"idx": 0, "name": "0", "path": "", "type": _TRANSFORMER},
                   {"idx": 1, "name": "1", "path": "1_Dense", "type": _DENSE}]
        (path / "modules.json").write_text(json.dumps(modules, indent=2))
        dense = path / "1_Dense"
        dense.mkdir(exist_ok=True)
        proj = self.projection
        # no "use_residual" key: PyLate 1.2 (what pip gives beside torch 2.13) fails on it,
        # and PyLate 1.6 reads its absence as false
        (dense / "config.json").write_text(json.dumps({
            "in_features": proj.in_features, "out_features": proj.out_features,
            "bias": proj.bias is not None, "activation_function": _IDENTITY}, indent=2))
        save_file({f"linear.{k}": v.detach().cpu().contiguous()
                   for k, v in proj.state_dict().items()}, str(dense / _DENSE_WEIGHTS))
        (path / "sentence_bert_config.json").write_text(json.dumps(
            {"max_seq_length": self.max_length, "do_lower_case": False}, indent=2))
        (path / "config_sentence_transformers.json").write_text(json.dumps({
            "prompts": {"query": self.query_prefix, "document": self.doc_prefix},
            "default_prompt_name": None, "similarity_fn_name": "MaxSim",
            "query_prefix": self.query_marker, "document_prefix": self.doc_marker,
            "query_length": self.query_length or self.max_length,
            "document_length": self.max_length,
            "attend_to_expansion_tokens": self.attend_to_expansion,
            "skiplist_words": self.skiplist, "do_query_expansion": self.query_expansion},
            indent=2))
