"""A ColQwen-style multi-vector page retriever (late interaction) over Qwen2-VL, Qwen2.5-VL and
Qwen3-VL: the last hidden states of every token, a linear projection to ``dim`` numbers
(128), L2-normalised per token, returned as :class:`bigbatch.TokenEmbeddings` for
:class:`bigbatch.MaxSimInfoNCE`.

As colpali-engine's ``ColQwen2`` / ``ColQwen2_5`` (``custom_text_proj``: ``Linear(hidden,
128)`` with a bias over ``last_hidden_state``, L2 per token, times the attention mask), with
one difference in what is scored: the prompt is bigbatch's (the vision-language encoder's
ChatML prompt with a system instruction, :mod:`bigbatch.encoders.vision`), and its head, the
system turn with the instruction and the user turn's header, is embedded and attended to but
not scored (``mask_instruction``, the default): an instruction shared by every query would
otherwise match itself in every document. Padding is never scored. The content (image tokens,
text) and the closing template tokens are.

The projection is a submodule of the model named ``custom_text_proj`` (colpali-engine's
name), so it is saved with the weights: in ``model.safetensors`` for full fine-tuning (the
keys ``custom_text_proj.weight`` / ``.bias`` beside the model's), and in the adapter for
LoRA (peft ``modules_to_save``: it always trains). A saved folder loads in bigbatch
(:func:`~bigbatch.encoders.load_encoder`) and its weights in colpali-engine's classes (see
docs/guides/multivector.md for the conditions).

Inputs: those of :meth:`VisionLanguageEncoder.collate` and ``skip_mask`` (True on the prompt
head's tokens: embedded, not scored).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..engine.embeddings import TokenEmbeddings
from ..errors import ConfigError
from .base import scored_rows, tokens_in_order
from .image_inputs import is_image_doc
from .vision import VisionLanguageEncoder

__all__ = ["MultiVectorVisionEncoder", "PROJECTION", "projection_weights"]

PROJECTION = "custom_text_proj"  # colpali-engine's attribute name
DEFAULT_DIM = 128


def projection_weights(path: str | os.PathLike) -> dict[str, Tensor]:
    """The ``custom_text_proj.*`` tensors of a model folder's safetensors files (one file or
    shards), keys without the prefix; empty when it has none."""
    from safetensors import safe_open

    out: dict[str, Tensor] = {}
    folder = Path(path)
    if not folder.is_dir():
        return out
    for f in sorted(folder.glob("*.safetensors")):
        if f.name.startswith("adapter_model"):
            continue
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                for prefix in (f"{PROJECTION}.", f"model.{PROJECTION}.",
                               f"base_model.model.{PROJECTION}."):
                    if key.startswith(prefix):
                        out[key.removeprefix(prefix)] = st.get_tensor(key)
    return out


class MultiVectorVisionEncoder(VisionLanguageEncoder):
    """One L2-normalised ``dim``-vector per token of a Qwen-VL prompt (ColQwen): module
    docstring.

    Args:
        model: a Qwen2-VL / Qwen2.5-VL / Qwen3-VL folder (its ``custom_text_proj`` weights
            load when it has them).
        dim: the projection's width (None: the folder's, else 128).
        mask_instruction: leave the prompt's head (system instruction, user header) out of
            the scored tokens.
        **kwargs: as for :class:`~bigbatch.encoders.VisionLanguageEncoder` (LoRA, vision
            tower, pixel budget, instructions); ``pooling`` may only be ``"multivector"``.

    Raises:
        ConfigError: a bad width, or one that differs from the folder's projection.
    """

    multi_vector = True

    def __init__(self, model: str | os.PathLike, *, dim: int | None = None,
                 mask_instruction: bool = True, pooling: str = "multivector",
                 **kwargs: Any) -> None:
        if pooling != "multivector":
            raise ConfigError(f"pooling of a multi-vector encoder is 'multivector', got "
                              f"{pooling!r}")
        if dim is not None and dim <= 0:
            raise ConfigError(f"dim must be > 0, got {dim}")
        object.__setattr__(self, "_wanted_dim", dim)  # read by _attach_projection
        kwargs.pop("normalize", None)  # every token is normalised
        super().__init__(model, **kwargs)
        self._attach_projection()
        self.pooling = "multivector"
        self.mask_instruction = mask_instruction

    # -------------------------------------------------------------- set-up
    def _attach_projection(self) -> None:
        """Put ``custom_text_proj`` on the model (once; before LoRA, which then trains and
        saves it fully), with the folder's weights when it has them."""
        core = self._core()
        if hasattr(core, PROJECTION):
            return
        saved = projection_weights(self.model_name)
        width = int(saved["weight"].shape[0]) if "weight" in saved else 0
        if self._wanted_dim and width and self._wanted_dim != width:
            raise ConfigError(f"{self.model_name}: its projection has {width} dimensions, "
                              f"but {self._wanted_dim} were asked for (--multivector-dim)")
        width = width or self._wanted_dim or DEFAULT_DIM
        hidden = core.get_input_embeddings().weight
        proj = nn.Linear(hidden.shape[1], width).to(dtype=hidden.dtype, device=hidden.device)
        if saved:
            try:
                proj.load_state_dict({k: v.to(hidden.dtype) for k, v in saved.items()})
            except RuntimeError as e:
                raise ConfigError(f"{self.model_name}: the projection's weights do not fit: "
                                  f"{e}") from e
        setattr(core, PROJECTION, proj)

    def _apply_lora(self, r: int, alpha: int, dropout: float,
                    targets: Sequence[str] | None) -> None:
        self._attach_projection()
        super()._apply_lora(r, alpha, dropout, targets)

    def _lora_modules_to_save(self) -> list[str] | None:
        return [PROJECTION] + (super()._lora_modules_to_save() or [])

    @property
    def projection(self) -> nn.Module:
        """The projection (under LoRA, peft's wrapper of the trained copy)."""
        return getattr(self._core(), PROJECTION)

    @property
    def dim(self) -> int:
        return int(getattr(self.projection, "out_features", None) or
                   self.projection.modules_to_save["default"].out_features)

    def use_base_doc_tower(self, base_model: str | os.PathLike | None = None) -> None:
        raise ConfigError("query-side tuning (a frozen document tower) is not supported for "
                          "multi-vector encoders")

    # -------------------------------------------------------------- inputs
    def collate(self, items: Sequence[Any], side: str = "doc") -> dict[str, Tensor]:
        """:meth:`VisionLanguageEncoder.collate`, with ``skip_mask``: the prompt head's
        tokens (right padding: the first ones of every row)."""
        out = super().collate(items, side)
        if self.mask_instruction:
            instruction = self.query_instruction if side == "query" else self.doc_instruction
            head = len(self._template_ids(instruction)[0])
            skip = torch.zeros_like(out["attention_mask"], dtype=torch.bool)
            skip[:, :head] = True
            out["skip_mask"] = skip
        return out

    # -------------------------------------------------------------- forward
    def forward(self, input_ids: Tensor, attention_mask: Tensor,
                pixel_values: Tensor | None = None, image_grid_thw: Tensor | None = None,
                mm_token_type_ids: Tensor | None = None,
                skip_mask: Tensor | None = None) -> TokenEmbeddings:
        return self._embed(self.model, input_ids, attention_mask, pixel_values,
                           image_grid_thw, mm_token_type_ids, skip_mask)

    def _embed(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
               pixel_values: Tensor | None = None, image_grid_thw: Tensor | None = None,
               mm_token_type_ids: Tensor | None = None,
               skip_mask: Tensor | None = None) -> TokenEmbeddings:
        hidden = self.hidden_states(model, input_ids, attention_mask, pixel_values,
                                    image_grid_thw, mm_token_type_ids)
        values = nn.functional.normalize(self.projection(hidden), dim=-1)
        mask = attention_mask != 0
        if skip_mask is not None:
            mask = mask & ~skip_mask
        return TokenEmbeddings(values, mask)

    def encode_tokens(self, items: Sequence[Any], side: str = "doc", batch_size: int = 16,
                      device: torch.device | str | None = None, progress: str | None = None,
                      autocast_dtype: torch.dtype | None = None
                      ) -> Iterator[tuple[list[int], list[Tensor]]]:
        """Embed texts and/or page images in batches (images first) in eval mode without
        gradient; yields each batch's item indices and, per item, its scored tokens' vectors
        ``(tokens, dim)`` (float32, on the CPU)."""
        order = sorted(range(len(items)), key=lambda i: (not is_image_doc(items[i]),
                                                         -len(str(items[i]))))
        for idx, out in self._encode_batches(items, side, batch_size, device, progress,
                                             autocast_dtype, order, self.collate, "item"):
            yield idx, scored_rows(out)

    def encode(self, items: Sequence[Any], side: str = "doc", batch_size: int = 16,
               device: torch.device | str | None = None, progress: str | None = None,
               autocast_dtype: torch.dtype | None = None) -> TokenEmbeddings:
        """The scored tokens of ``items`` as one TokenEmbeddings (float32, on the CPU, padded
        to the longest item), in input order."""
        return tokens_in_order(self.encode_tokens(items, side, batch_size, device, progress,
                                                  autocast_dtype), len(items), self.dim)

    # -------------------------------------------------------------- saving
    def settings(self) -> dict[str, Any]:
        out = {**super().settings(), "pooling": "multivector", "dim": self.dim,
               "mask_instruction": self.mask_instruction}
        out.pop("normalize", None)
        return out
