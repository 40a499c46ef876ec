"""The contract every encoder (tower) fulfils, and what the text and vision-language encoders
share: pooling, LoRA, batched ``encode`` in input order, the cache key, saving the (adapter
or merged) weights, and query-side tuning's frozen document tower.

An encoder is an ``nn.Module`` and a GradCache tower: ``encoder(**inputs)`` maps one chunk
of model inputs to ``(rows, dim)`` embeddings. Everything the pipeline (training,
evaluation, mining, the corpus-embedding cache) asks of an encoder is declared once, in
:class:`EncoderBase`; :class:`~bigbatch.encoders.text.TextEncoder` and
:class:`~bigbatch.encoders.vision.VisionLanguageEncoder` implement it.

``side`` says which tower an input goes through: ``"query"`` or ``"doc"`` (the prefix or
instruction it gets, and in query-side tuning whether the frozen document tower embeds it).
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from .source import files_key, load_pretrained, model_reference
from .unwrap import saving_without_deepspeed

__all__ = ["EncoderBase", "FrozenDocTower", "pool", "SIDES", "check_side", "scored_rows",
           "tokens_in_order", "ADAPTER_FOLDER", "clip_for_tokenizer", "CHARS_PER_TOKEN_BOUND"]

SIDES = ("query", "doc")
ADAPTER_FOLDER = "adapter"  # final/adapter/: a LoRA run's adapter beside the merged weights
ADAPTER_README = """# LoRA adapter (peft)

The LoRA adapter this model was trained as; the folder above holds the same model with the
adapter merged into its base weights, which sentence-transformers, transformers and PyLate
load as they are. Load the adapter with peft, on the base model named by
`base_model_name_or_path` in `adapter_config.json`:

```python
from peft import PeftModel
from transformers import AutoModel

model = PeftModel.from_pretrained(AutoModel.from_pretrained(BASE_MODEL), "final/adapter")
```

transformers' own loader (`AutoModel.from_pretrained("final/adapter")`, and
sentence-transformers through it) drops the adapter's weights without an error in
transformers 5.0 to 5.5.4: load the folder above there.
"""

# characters a text keeps per token of its max length before it meets the tokenizer: a
# tokenizer reads a whole text before it truncates it (a 50 MB text: gigabytes, minutes),
# and no tokenizer's first tokens cover more than this many characters each (WordPiece
# makes a word of over 100 characters one [UNK]), so the cut never changes a token kept
CHARS_PER_TOKEN_BOUND = 1000


def clip_for_tokenizer(text: str, max_tokens: int) -> str:
    """``text`` cut to :data:`CHARS_PER_TOKEN_BOUND` characters per token of ``max_tokens``
    (itself when shorter): what a tokenizer that truncates to ``max_tokens`` reads."""
    limit = max(1, max_tokens) * CHARS_PER_TOKEN_BOUND
    return text if len(text) <= limit else text[:limit]


def check_side(side: str) -> None:
    """Raises ConfigError unless ``side`` is ``"query"`` or ``"doc"``."""
    if side not in SIDES:
        raise ConfigError(f"side must be 'query' or 'doc', got {side!r}")


def pool(hidden: Tensor, mask: Tensor, mode: str) -> Tensor:
    """Pool ``(rows, tokens, dim)`` hidden states by the attention mask: ``mean``, ``cls``
    (the first non-padding token) or ``last`` (the last non-padding token), whichever side
    the padding is on, as sentence-transformers pools."""
    if mode == "mean":
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)
    if mode == "cls":  # position 0 is padding in a left-padded row
        idx = mask.int().argmax(1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), idx]
    # last: the last non-padding token of each row, whichever side the padding is on
    t = mask.shape[1]
    idx = t - 1 - mask.flip(1).int().argmax(1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), idx]


def scored_rows(out: Any) -> list[Tensor]:
    """Per row of a multi-vector encoder's output (:class:`bigbatch.TokenEmbeddings`), its
    scored tokens' vectors ``(tokens, dim)``, float32 on the CPU."""
    values, mask = out.values.float().cpu(), out.mask.cpu()
    return [v[m] for v, m in zip(values, mask)]


def tokens_in_order(batches: Iterator[tuple[list[int], list[Tensor]]], n: int,
                    dim: int) -> Any:
    """The ``n`` items' scored tokens from ``(indices, rows)`` batches (an encoder's
    ``encode_tokens``) as one :class:`bigbatch.TokenEmbeddings` padded to the longest item,
    in input order."""
    from ..engine.embeddings import stack_rows

    rows: list[Tensor] = [torch.empty(0)] * n
    for idx, vectors in batches:
        for i, v in zip(idx, vectors):
            rows[i] = v
    return stack_rows(rows, dim)


class EncoderBase(nn.Module, ABC):
    """The encoder contract, with the behaviour the text and vision-language encoders share.

    A subclass sets, in its ``__init__``: ``model`` (the transformers model, under peft with
    LoRA), ``tokenizer``, ``model_name`` (where the weights came from: the base model, or the
    adapter folder once one is attached), ``base_model_name`` (the base model the weights or
    adapter sit on), ``lora_r`` (0: full fine-tuning), ``max_length`` and ``normalize``; and
    implements the abstract methods below:

    - ``forward(**inputs)`` / ``_embed(model, **inputs)``: one chunk of model inputs to
      ``(rows, dim)`` embeddings (``_embed`` also runs the frozen document tower);
    - :meth:`step_inputs`: what GradCache is given for one side of a training step;
    - :meth:`collate_fns`: the per-chunk collate functions GradCache calls (or None);
    - :meth:`encode`: embeddings of many items, in input order, without gradient;
    - :meth:`settings`: the settings that decide the embeddings (saved and in the cache key);
    - :meth:`_save_extras`: files besides the weights and tokenizer that :meth:`save` writes;
    - :meth:`_default_lora_targets`: the modules LoRA adapts unless told otherwise.

    Shared here: :meth:`cache_key`, :meth:`save`, LoRA (:meth:`_apply_lora`), gradient
    checkpointing, and query-side tuning's frozen document tower: documents embedded by the
    frozen initial weights. With LoRA that tower is the model with its adapter disabled (no
    copy); with full fine-tuning it is a frozen copy of the weights taken when
    :meth:`use_base_doc_tower` is called. Saved folders record it, and
    ``encode(side="doc")`` honours it, so retrieval after training embeds documents as
    training did.
    """

    encoder_type: ClassVar[str]  # "text" or "vision-language" (what --encoder names)
    # True: one vector per token (TokenEmbeddings, late interaction): forward and encode return
    # TokenEmbeddings, and encode_tokens yields each text's unmasked token vectors
    multi_vector: ClassVar[bool] = False
    doc_tower = "shared"
    _allowed_missing: tuple[str, ...] = ()  # checkpoint keys the encoder never uses
    _doc_base: nn.Module | None = None
    _doc_base_name: str | None = None
    # the attribute holding each side's prompt: a text prefix, or a vision-language system
    # instruction (what --query-prefix / --query-instruction set)
    prompt_attrs: ClassVar[dict[str, str]] = {"query": "query_prefix", "doc": "doc_prefix"}
    # per-task prompts ({"scifact": {"query": ..., "doc": ...}}): saved with the model, so
    # evaluation and the saved folder embed each task as training did
    tasks: dict[str, dict[str, str]]

    # ------------------------------------------------------------------ contract
    @abstractmethod
    def forward(self, **inputs: Tensor) -> Tensor:
        """Embeddings ``(rows, dim)`` of one chunk of model inputs (the trained tower)."""

    @abstractmethod
    def _embed(self, model: nn.Module, **inputs: Tensor) -> Tensor:
        """Embeddings of one chunk of model inputs by ``model`` (this encoder's model, or the
        frozen document tower's)."""

    @abstractmethod
    def step_inputs(self, items: Sequence[Any], side: str,
                    max_length: int | None = None) -> Any:
        """What GradCache is given for ``side`` of one training step: model inputs (a dict of
        tensors) or the raw items, which :meth:`collate_fns` turn into inputs per chunk.
        ``max_length``: truncation for this step's items, where the encoder has one."""

    @abstractmethod
    def collate_fns(self) -> dict[str, Callable[[Sequence[Any]], dict[str, Tensor]]] | None:
        """GradCache's per-chunk collate functions by side (``{"query": f, "doc": g}``), or
        None when :meth:`step_inputs` gives model inputs already."""

    @abstractmethod
    def encode(self, items: Sequence[Any], side: str = "doc", batch_size: int = 64,
               device: torch.device | str | None = None, progress: str | None = None,
               autocast_dtype: torch.dtype | None = None) -> Tensor:
        """Float32 embeddings on the CPU, in input order, of ``items`` embedded as ``side``
        in batches of ``batch_size``, in eval mode and without gradient. Documents go through
        the frozen document tower in query-side-tune mode. ``progress``: a progress bar's
        label (None: no bar)."""

    @abstractmethod
    def settings(self) -> dict[str, Any]:
        """The settings that decide the embeddings besides the weights (pooling, prompts,
        lengths), as recorded in ``bigbatch_encoder.json`` and in :meth:`cache_key`."""

    @abstractmethod
    def _save_extras(self, path: Path) -> None:
        """Write what :meth:`save` adds beside the weights and tokenizer in ``path``."""

    # ------------------------------------------------------------------ prompts and tasks
    def prompts(self) -> dict[str, str]:
        """The prompts in effect: ``{"query": ..., "doc": ...}`` (prefixes of a text encoder,
        system instructions of a vision-language one)."""
        return {side: getattr(self, attr) for side, attr in self.prompt_attrs.items()}

    @contextmanager
    def using_prompts(self, query: str | None = None, doc: str | None = None) -> Iterator[None]:
        """Embed with these prompts inside the ``with`` block (None: keep that side's), then
        restore the encoder's own. Training wraps each step of a source in its prompts
        (tokenization and, for raw inputs, every chunk's collation and replay), evaluation
        each task in its own."""
        saved = self.prompts()
        try:
            for side, value in (("query", query), ("doc", doc)):
                if value is not None:
                    self.check_prompt(self.prompt_attrs[side], value)
                    setattr(self, self.prompt_attrs[side], value)
            yield
        finally:
            for side, value in saved.items():
                setattr(self, self.prompt_attrs[side], value)

    def check_prompt(self, name: str, text: str) -> None:
        """Refuse a prompt this encoder cannot use (``name``: the option that set it); any
        text is a text encoder's prefix."""

    def task_prompts(self, task: str | None) -> dict[str, str]:
        """The prompts of ``task`` (one of :attr:`tasks`), else the encoder's own."""
        own = self.prompts()
        return {**own, **getattr(self, "tasks", {}).get(task or "", {})}

    # ------------------------------------------------------------------ identity and saving
    def cache_key(self) -> dict[str, Any]:
        """What identifies this encoder's embeddings (the corpus-embedding cache's key): its
        weights' files (name, size, modification time; an adapter's base model's too), its
        :meth:`settings` and its document tower."""
        name = Path(str(self.model_name))
        base = self.base_model_name if self.base_model_name != self.model_name else None
        return {"model": str(name.resolve()) if name.exists() else str(name),
                "files": files_key(name), "base": files_key(base) if base else None,
                **self.settings(), **self.frozen_doc_meta()}

    def save(self, path: str | os.PathLike, merge_lora: bool = False) -> Path:
        """Write the weights (a peft adapter, or with ``merge_lora`` or full fine-tuning the
        full weights), the tokenizer, the encoder's own files and ``bigbatch_encoder.json``
        (its settings and document tower) to ``path``: a folder that
        :func:`~bigbatch.encoders.load_encoder` loads with the same embeddings. Returns
        ``path``."""
        path = self._save_model(path, merge_lora)
        self._save_extras(path)
        meta = {**self.settings(), "lora": self.is_lora and not merge_lora,
                "base_model": self.base_model_name, **self.frozen_doc_meta()}
        if getattr(self, "matryoshka_dims", None):  # the widths it was trained at
            meta["matryoshka_dims"] = list(self.matryoshka_dims)
        if getattr(self, "tasks", None):
            meta["tasks"] = self.tasks
        (path / "bigbatch_encoder.json").write_text(json.dumps(meta, indent=2))
        return path

    def save_final(self, path: str | os.PathLike, keep_adapter: bool = True) -> Path:
        """Write a run's ``final/``: full weights (a LoRA adapter merged into its base), so
        that every loader reads the trained model the same way, whatever its version
        (transformers 5.0 to 5.5.4, sentence-transformers over them and PyLate 1.6 load an
        adapter folder as its base model, without an error); and, for a LoRA encoder with
        ``keep_adapter``, the peft adapter alone in ``path/adapter/`` (``adapter_config.json``,
        ``adapter_model.safetensors``) for ``PeftModel.from_pretrained(base, path/adapter)``.
        ``bigbatch_encoder.json`` names that folder (``"adapter": "adapter"``). Returns
        ``path``."""
        path = self.save(path, merge_lora=True)
        if self.is_lora and keep_adapter:
            self.save_adapter(path / ADAPTER_FOLDER)
            meta_file = path / "bigbatch_encoder.json"
            meta = json.loads(meta_file.read_text())
            meta["adapter"] = ADAPTER_FOLDER
            meta_file.write_text(json.dumps(meta, indent=2))
        return path

    def save_adapter(self, path: str | os.PathLike) -> Path:
        """Write the peft adapter alone (no tokenizer, no sentence-transformers files, so no
        folder loader takes it for a model) and a ``README.md`` saying how to load it.

        Raises:
            ConfigError: the encoder has no adapter (full fine-tuning).
        """
        if not self.is_lora:
            raise ConfigError("save_adapter: this encoder is fully fine-tuned; it has no "
                              "LoRA adapter")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, safe_serialization=True,
                                   **self._adapter_save_options())
        (path / "README.md").write_text(ADAPTER_README)  # in place of peft's, which names paths
        return path

    def _save_model(self, path: str | os.PathLike, merge_lora: bool) -> Path:
        """Write the weights (a peft adapter, or merged/full weights) and the tokenizer."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no "Writing model shards" bar for every checkpoint
        model = self.model
        if self.is_lora and merge_lora:
            import copy
            model = copy.deepcopy(model).merge_and_unload()
        options = self._adapter_save_options() if self.is_lora and not merge_lora else {}
        with saving_without_deepspeed():  # no DeepSpeed import in a run that does not use it
            model.save_pretrained(path, safe_serialization=True, **options)
        self.tokenizer.save_pretrained(path)
        return path

    def _adapter_save_options(self) -> dict[str, Any]:
        """Keyword arguments of peft's ``save_pretrained`` when an adapter is saved."""
        return {}

    # ------------------------------------------------------------------ training set-up
    @property
    def is_lora(self) -> bool:
        return self.lora_r > 0

    @abstractmethod
    def _default_lora_targets(self) -> list[str] | str:
        """LoRA's target modules when none are given (module names, or a regex)."""

    def _lora_modules_to_save(self) -> list[str] | None:
        """Modules trained fully and saved with the adapter (peft ``modules_to_save``)."""
        return None

    def _apply_lora(self, r: int, alpha: int, dropout: float,
                    targets: Sequence[str] | None) -> None:
        """Put a LoRA adapter (peft) of rank ``r`` on ``targets`` (default:
        :meth:`_default_lora_targets`); the rest of the model is frozen.

        Raises:
            ConfigError: ``alpha`` is not positive, or the targets do not fit the model.
        """
        from peft import LoraConfig, get_peft_model

        if alpha <= 0:
            raise ConfigError(f"lora_alpha must be > 0 with LoRA, got {alpha}")
        targets = list(targets) if targets else self._default_lora_targets()
        config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                            bias="none", modules_to_save=self._lora_modules_to_save())
        try:
            self.model = get_peft_model(self.model, config)
        except ValueError as e:
            raise ConfigError(f"LoRA target modules {targets} do not fit this model: {e}") from e
        self.lora_r = r

    def _enable_gradient_checkpointing(self) -> None:
        """Recompute activations in backward (non-reentrant, so it composes with the cache's
        replay); under LoRA the frozen embeddings' outputs must still require grad."""
        enable = getattr(self.model, "activation_checkpointing_enable", None)
        if enable is not None:  # transformers 5.x's name; the old one warns and goes in v6
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.is_lora:
            self.model.enable_input_require_grads()

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ query-side tuning
    def use_base_doc_tower(self, base_model: str | os.PathLike | None = None) -> None:
        """Embed documents with the frozen base weights from now on (call after ``.to()``).
        ``base_model``: load them from this path instead of copying the current weights."""
        import copy

        self.doc_tower = "base"
        if self.is_lora:  # the adapter disabled; named so that a merged save can reload it
            self._doc_base_name = self.base_model_name
            return
        if base_model is not None:
            base = load_pretrained(str(base_model), self._allowed_missing).to(
                next(self.parameters()).device)
            self._doc_base_name = model_reference(base_model)
        else:
            base = copy.deepcopy(self.model)
            self._doc_base_name = self.base_model_name
        base.requires_grad_(False).eval()
        object.__setattr__(self, "_doc_base", base)  # not a submodule: never trained or saved

    @torch.no_grad()
    def embed_doc_frozen(self, **inputs: Tensor) -> Tensor:
        """Document embeddings from the frozen tower, without gradient, in eval mode."""
        was = self.training
        self.eval()
        try:
            if self._doc_base is not None:
                return self._embed(self._doc_base, **inputs)
            if self.is_lora:
                with self.model.disable_adapter():
                    return self._embed(self.model, **inputs)
            return self._embed(self.model, **inputs)
        finally:
            self.train(was)

    def frozen_doc_tower(self) -> "FrozenDocTower":
        return FrozenDocTower(self)

    def frozen_doc_meta(self) -> dict[str, Any]:
        return {"doc_tower": self.doc_tower, "doc_base_model": self._doc_base_name}

    # ------------------------------------------------------------------ encoding
    @torch.no_grad()
    def _encode_batches(self, items: Sequence[Any], side: str, batch_size: int,
                        device: torch.device | str | None, progress: str | None,
                        autocast_dtype: torch.dtype | None, order: list[int],
                        make_batch: Callable[[list, str], dict[str, Tensor]],
                        unit: str) -> Iterator[tuple[list[int], Any]]:
        """Embed ``items`` in batches taken in ``order`` (eval mode, no gradient); yields each
        batch's item indices with the encoder's output for it, on the encoding device."""
        from .._progress import progress_bar

        was_training = self.training
        self.eval()
        device = torch.device(device) if device is not None else next(self.parameters()).device
        bar = progress_bar(total=len(items), desc=progress, unit=unit) if progress else None
        try:
            for lo in range(0, len(order), batch_size):
                idx = order[lo:lo + batch_size]
                batch = {k: v.to(device)
                         for k, v in make_batch([items[i] for i in idx], side).items()}
                ctx = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else \
                    torch.autocast(device.type, enabled=False)
                with ctx:
                    out = self.embed_doc_frozen(**batch) if side == "doc" and \
                        self.doc_tower == "base" else self(**batch)
                yield idx, out
                if bar is not None:
                    bar.update(len(idx))
        finally:
            if bar is not None:
                bar.close()
            self.train(was_training)

    def _encode(self, items: Sequence[Any], side: str, batch_size: int,
                device: torch.device | str | None, progress: str | None,
                autocast_dtype: torch.dtype | None, order: list[int],
                make_batch: Callable[[list, str], dict[str, Tensor]], unit: str) -> Tensor:
        """Embed ``items`` in batches taken in ``order``; float32 on the CPU, input order."""
        out = [emb.float().cpu() for _, emb in self._encode_batches(
            items, side, batch_size, device, progress, autocast_dtype, order, make_batch, unit)]
        emb = torch.cat(out) if out else torch.empty(0, 0)
        result = torch.empty_like(emb)
        result[torch.tensor(order, dtype=torch.long)] = emb
        return result


class FrozenDocTower(nn.Module):
    """A GradCache tower that embeds documents with an encoder's frozen document tower. It
    owns no parameters, so the engine embeds its chunks once, without gradient or replay."""

    def __init__(self, encoder: EncoderBase) -> None:
        super().__init__()
        object.__setattr__(self, "encoder", encoder)  # not registered: no parameters here

    def forward(self, **inputs: Tensor) -> Tensor:
        return self.encoder.embed_doc_frozen(**inputs)
