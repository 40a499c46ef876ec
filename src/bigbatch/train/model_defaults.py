"""The options a model folder gives when the user leaves them out, so that a model trains as
it embeds (and as ``bigbatch eval`` / ``mine`` embed with it): a sentence-transformers
folder's pooling, max length and prompts, a multi-vector (PyLate-layout) folder's settings,
the ``bigbatch_encoder.json`` of a vision-language folder bigbatch saved, and the token
positions of a text model (the default max length is cut to them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["model_defaults", "model_positions"]

# what a sentence-transformers model folder says about how it embeds
_ST_KEYS = ("pooling", "max_length", "query_prefix", "doc_prefix")
# what a vision-language folder bigbatch saved says about how it embeds
_VL_KEYS = ("query_instruction", "doc_instruction", "max_num_visual_tokens",
            "min_num_visual_tokens", "max_length")


def model_defaults(values: dict[str, Any], default_max_length: int) -> dict[str, Any]:
    """Options the user did not set, taken from a text model folder's sentence-transformers
    configuration (pooling, max length, query/document prompts), or from the
    ``bigbatch_encoder.json`` of a vision-language folder bigbatch saved (instructions, pixel
    budget, max length), so a model trains as it embeds, and as ``bigbatch mine`` / ``eval``
    embed with it; left out, the max length is ``default_max_length`` cut to the model's
    positions when it has fewer."""
    model = values.get("model")
    if not model or not Path(model).is_dir():
        return values
    from ..encoders.loading import st_settings
    from ..encoders.vision import is_vision_language_model

    if values.get("encoder") == "vision-language" or is_vision_language_model(model):
        meta = Path(model) / "bigbatch_encoder.json"
        if not meta.exists() or all(k in values for k in _VL_KEYS):
            return values
        import json
        try:
            found = json.loads(meta.read_text())
        except ValueError as e:
            raise ConfigError(f"{meta}: not valid JSON: {e}") from e
        return {**{k: found[k] for k in _VL_KEYS if found.get(k) is not None}, **values}
    multi = _multivector_defaults(Path(model))
    if multi is not None:  # (another --pooling: the transformer alone, pooled as asked)
        return {**multi, **values} if values.get("pooling", "multivector") == "multivector" \
            else values
    if all(k in values for k in _ST_KEYS):
        return values
    try:
        found = st_settings(model)
    except ConfigError as e:
        raise ConfigError(f"{e}. To fine-tune the transformer alone, give --pooling, "
                          f"--max-length, --query-prefix and --doc-prefix explicitly") from e
    out = {**{k: found[k] for k in _ST_KEYS if k in found}, **values}
    if "max_length" not in out:  # the default, cut to the model's positions when it has fewer
        positions = _model_positions(Path(model))
        if positions is not None and positions < default_max_length:
            out["max_length"] = positions
    return out


def _multivector_defaults(model: Path) -> dict[str, Any] | None:
    """The options a multi-vector (PyLate-layout) folder gives, or None for another folder."""
    from ..encoders.text_multivector import multivector_settings

    found = multivector_settings(model)
    if found is None:
        return None
    return {"pooling": "multivector", "multivector_dim": found["dim"],
            "max_length": found["max_length"], "query_prefix": found["query_prefix"],
            "doc_prefix": found["doc_prefix"],
            "query_length": found["query_length"] if found["query_expansion"] else 0}


def model_positions(max_position_embeddings: Any, model_type: Any) -> int | None:
    """How many token positions a text model's configuration gives (RoBERTa-family models
    lose two to the padding offset: their positions start after the padding index), or None
    when it does not say."""
    if not isinstance(max_position_embeddings, int):
        return None
    return max_position_embeddings - (2 if "roberta" in str(model_type or "") else 0)


def _model_positions(model: Path) -> int | None:
    """:func:`model_positions` of a model folder's ``config.json`` (None without one)."""
    import json

    try:
        cfg = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return model_positions(cfg.get("max_position_embeddings"), cfg.get("model_type"))
