"""What the text and vision-language encoders share: pooling, batched ``encode`` in input
order, saving the (adapter or merged) weights and tokenizer, and query-side tuning's frozen
document tower (:class:`EncoderBase`, :class:`FrozenDocTower`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["EncoderBase", "FrozenDocTower", "pool", "load_pretrained", "model_reference",
           "check_model_source", "hub_load_errors"]


def model_reference(model: str | os.PathLike) -> str:
    """How a base model is recorded in saved folders (``base_model``, the adapter's
    ``base_model_name_or_path``): an existing local folder as its absolute path, so the
    folder loads from any working directory; a hub name as given."""
    path = Path(model)
    return str(path.resolve()) if path.exists() else str(model)


def check_model_source(model: str | os.PathLike, option: str = "--model") -> None:
    """Refuse a model source that is not a full transformers model, before anything loads.

    A local folder must hold ``config.json``. A LoRA adapter folder (a LoRA run's ``final/``
    or ``checkpoint-N/model``) is not one: transformers would load it with the adapter
    frozen, and a new adapter of the same name would silently replace it, so training would
    start from the base model and lose the adapter's training. A path that does not exist is
    refused too; a hub name (``namespace/name``) is left to transformers.

    Raises:
        ConfigError: naming ``option``, the path and what to give instead.
    """
    import json

    from ..errors import ConfigError

    text = str(model)
    p = Path(model).expanduser()
    if p.is_dir():
        if (p / "config.json").exists():
            return
        adapter = p / "adapter_config.json"
        if adapter.exists():
            try:
                base = json.loads(adapter.read_text()).get("base_model_name_or_path")
            except (OSError, ValueError):
                base = None
            raise ConfigError(
                f"{option}: {text} is a LoRA adapter over {base or 'an unknown base model'}, "
                f"not a full model (a new adapter on it would replace it and drop its "
                f"training). To train from it, give its base model, --resume the run it came "
                f"from, or use a run saved with --merge-lora (full weights)")
        if (p / "model").is_dir() and (p / "trainer_state.pt").exists():
            raise ConfigError(f"{option}: {text} is a bigbatch checkpoint directory; give its "
                              f"model folder {p / 'model'} (or --resume {p.parent} to continue "
                              f"the run)")
        raise ConfigError(f"{option}: {text} holds no transformers model (no config.json)")
    if p.exists():
        raise ConfigError(f"{option}: {text} is a file; give a model folder")
    looks_local = p.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1 \
        or (os.sep != "/" and os.sep in text)
    if looks_local:
        raise ConfigError(f"{option}: {text} does not exist")


@contextlib.contextmanager
def hub_load_errors(name: str) -> Iterator[None]:
    """Turn transformers' OSError for a source it cannot load (a hub name not in the cache
    while offline or with no network, a folder without the files) into a ConfigError
    naming the source, instead of a traceback."""
    from ..errors import ConfigError

    try:
        yield
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{name}: transformers could not load it: {first}") from e


def load_pretrained(name: str, allowed_missing: tuple[str, ...] = (), **kwargs: Any) -> nn.Module:
    """``AutoModel.from_pretrained(name)`` that refuses a checkpoint whose weights did not all
    load: a missing or wrongly shaped weight would otherwise start from random values and
    train silently from there. ``allowed_missing``: key prefixes never used (BERT's pooler).
    Task-head weights in the checkpoint (``lm_head``) are unused and ignored.

    Raises:
        ConfigError: naming the first missing or mismatched keys and how many there are.
    """
    from transformers import AutoModel

    from ..errors import ConfigError

    with hub_load_errors(name):
        model, info = AutoModel.from_pretrained(name, output_loading_info=True, **kwargs)
    bad = [k for k in info.get("missing_keys", ()) if not k.startswith(allowed_missing)]
    bad += [str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys", ())]
    if bad:
        shown = ", ".join(sorted(bad)[:5]) + (", ..." if len(bad) > 5 else "")
        raise ConfigError(f"{name}: {len(bad)} weight(s) of {type(model).__name__} were not "
                          f"loaded from the checkpoint ({shown}); they would start from random "
                          f"values. Is this the model folder you meant?")
    return model


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


class EncoderBase:
    """Shared encoder behaviour; subclasses set ``model``, ``tokenizer``, ``model_name``
    (where the weights came from: the base model, or the adapter folder once one is attached),
    ``base_model_name`` (the base model the weights or adapter sit on), ``lora_r`` and
    implement ``_embed(model, **inputs)``.

    Query-side tuning: documents embedded by the frozen initial weights.

    With LoRA the frozen document tower is the model with its adapter disabled (no copy);
    with full fine-tuning it is a frozen copy of the weights taken when
    :meth:`use_base_doc_tower` is called. Saved folders record it, and ``encode(kind="doc")``
    honours it, so retrieval after training embeds documents as training did.
    """

    doc_tower = "shared"
    _allowed_missing: tuple[str, ...] = ()  # checkpoint keys the encoder never uses
    _doc_base: nn.Module | None = None
    _doc_base_name: str | None = None

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

    @property
    def is_lora(self) -> bool:
        return self.lora_r > 0

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

    @torch.no_grad()
    def _encode(self, items: Sequence[Any], kind: str, batch_size: int,
                device: torch.device | str | None, progress: str | None,
                autocast_dtype: torch.dtype | None, order: list[int],
                make_batch: Callable[[list, str], dict[str, Tensor]], unit: str) -> Tensor:
        """Embed ``items`` in batches taken in ``order``; float32 on the CPU, input order."""
        from .._progress import progress_bar

        was_training = self.training
        self.eval()
        device = torch.device(device) if device is not None else next(self.parameters()).device
        out: list[Tensor] = []
        bar = progress_bar(total=len(items), desc=progress, unit=unit) if progress else None
        for lo in range(0, len(order), batch_size):
            idx = order[lo:lo + batch_size]
            batch = {k: v.to(device) for k, v in make_batch([items[i] for i in idx], kind).items()}
            ctx = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else \
                torch.autocast(device.type, enabled=False)
            with ctx:
                emb = self.embed_doc_frozen(**batch) if kind == "doc" and \
                    self.doc_tower == "base" else self(**batch)
            out.append(emb.float().cpu())
            if bar is not None:
                bar.update(len(idx))
        if bar is not None:
            bar.close()
        self.train(was_training)
        emb = torch.cat(out) if out else torch.empty(0, 0)
        result = torch.empty_like(emb)
        result[torch.tensor(order, dtype=torch.long)] = emb
        return result

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
        model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        return path

    def frozen_doc_tower(self) -> "FrozenDocTower":
        return FrozenDocTower(self)

    def frozen_doc_meta(self) -> dict[str, Any]:
        return {"doc_tower": self.doc_tower, "doc_base_model": self._doc_base_name}


class FrozenDocTower(nn.Module):
    """A GradCache tower that embeds documents with an encoder's frozen document tower. It
    owns no parameters, so the engine embeds its chunks once, without gradient or replay."""

    def __init__(self, encoder: EncoderBase) -> None:
        super().__init__()
        object.__setattr__(self, "encoder", encoder)  # not registered: no parameters here

    def forward(self, **inputs: Tensor) -> Tensor:
        return self.encoder.embed_doc_frozen(**inputs)


