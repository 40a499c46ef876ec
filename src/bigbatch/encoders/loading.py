"""Load an encoder from what users have on disk: a bigbatch ``final/`` (weights or a LoRA
adapter), a checkpoint directory (its ``model/``), a sentence-transformers folder (pooling,
normalisation and prompts read from its config files), a PyLate (ColBERT) folder (a
:class:`~bigbatch.encoders.text_multivector.MultiVectorTextEncoder`), or a plain transformers model.
Qwen2-VL / Qwen2.5-VL / Qwen3-VL folders (and adapters over them) give a
:class:`~bigbatch.encoders.vision.VisionLanguageEncoder`."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..errors import ConfigError, shown
from .source import check_positions, read_json
from .text import TextEncoder
from .text_multivector import multivector_settings

__all__ = ["load_encoder", "st_settings"]

# sentence-transformers modules the text encoder reproduces exactly
_ST_MODULES = ("Transformer", "Pooling", "Normalize")
_ST_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last",
               "pooling_mode_mean_tokens": "mean"}


def st_settings(path: str | Path) -> dict[str, Any]:
    """Pooling, normalisation, max length and prompts from a sentence-transformers folder
    (empty for a plain transformers folder).

    Raises:
        ConfigError: the folder's pipeline is one the text encoder cannot reproduce (a Dense
            or other extra module, max / weighted / sqrt-length pooling, a prompt excluded
            from pooling): its embeddings would silently differ from the model's own.
    """
    path = Path(path)
    out: dict[str, Any] = {}
    modules = path / "modules.json"
    if modules.exists():
        listed = read_json(modules, mapping=False)
        if not isinstance(listed, list) or not all(isinstance(m, dict) for m in listed):
            raise ConfigError(f"{modules}: expected a list of modules (objects); the folder is "
                              f"damaged: copy or save it again")
        types = [str(m.get("type", "")) for m in listed]
        other = [t for t in types if t.rsplit(".", 1)[-1] not in _ST_MODULES]
        if other:
            raise ConfigError(f"{modules}: sentence-transformers module(s) {other} are not "
                              f"supported (bigbatch encodes Transformer -> Pooling -> "
                              f"Normalize); the embeddings would differ from the model's")
        out["normalize"] = any(t.endswith("Normalize") for t in types)
    pool = path / "1_Pooling" / "config.json"
    if pool.exists():
        cfg = read_json(pool)
        modes = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
        unsupported = [k for k in modes if k not in _ST_POOLING]
        if unsupported or len(modes) > 1:
            raise ConfigError(f"{pool}: pooling {modes} is not supported; bigbatch pools by "
                              f"one of mean, cls or last token")
        out["pooling"] = _ST_POOLING[modes[0]] if modes else "mean"
        if cfg.get("include_prompt") is False:
            if out["pooling"] != "mean":
                raise ConfigError(f"{pool}: include_prompt false (the prompt left out of "
                                  f"pooling) is supported with mean pooling only")
            out["exclude_prompt_from_pooling"] = True
    sbc = path / "sentence_bert_config.json"
    if sbc.exists():
        length = read_json(sbc).get("max_seq_length", 256)
        if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
            raise ConfigError(f"{sbc}: max_seq_length must be a positive integer, got "
                              f"{shown(length)}")
        out["max_length"] = length
    prompts = path / "config_sentence_transformers.json"
    if prompts.exists():
        p = read_json(prompts).get("prompts") or {}
        if not isinstance(p, dict):
            raise ConfigError(f"{prompts}: 'prompts' must map names to prompt texts")
        out["query_prefix"] = p.get("query", "")
        out["doc_prefix"] = p.get("document", p.get("passage", ""))
    return out


# settings only the vision-language encoder takes; it also takes the shared two after them
_VL_ONLY_KEYS = ("query_instruction", "doc_instruction", "max_num_visual_tokens",
                 "min_num_visual_tokens", "freeze_vision")
_VL_KEYS = _VL_ONLY_KEYS + ("max_length", "normalize")


def _load_vision_language(path: Path, meta: dict[str, Any], overrides: dict[str, Any]) -> Any:
    """A Qwen-VL folder: single-vector, or multi-vector (ColQwen) when its
    ``bigbatch_encoder.json`` says ``"pooling": "multivector"``."""
    from .vision import VisionLanguageEncoder
    from .vision_multivector import MultiVectorVisionEncoder

    settings = {k: meta[k] for k in _VL_KEYS if k in meta}
    settings.update({k: v for k, v in overrides.items() if v is not None and k in _VL_KEYS})
    cls: Any = VisionLanguageEncoder
    if meta.get("pooling") == "multivector":
        if overrides.get("pooling") not in (None, "multivector"):
            raise ConfigError(f"{path} is a multi-vector (ColQwen) model; --pooling "
                              f"{overrides['pooling']} does not apply to it")
        cls = MultiVectorVisionEncoder
        settings.pop("normalize", None)
        settings.update({k: meta[k] for k in ("dim", "mask_instruction") if k in meta})
    if _is_adapter(path, meta):
        settings["freeze_vision"] = True  # a trained vision tower comes with the adapter
        enc = _attach_adapter(cls(_adapter_base(path, meta), **settings), path)
    else:
        enc = cls(path, **settings)
    _restore_doc_tower(enc, meta)
    enc.tasks = _tasks(meta, path / "bigbatch_encoder.json")
    return enc


def _is_adapter(path: Path, meta: dict[str, Any]) -> bool:
    return bool(meta.get("lora")) or (path / "adapter_config.json").exists()


def _adapter_base(path: Path, meta: dict[str, Any]) -> str:
    """The base model an adapter folder was trained on.

    Raises:
        ConfigError: the base is missing (moved or deleted) or is not a full model.
    """
    from .source import check_model_source

    base = meta.get("base_model") or read_json(path / "adapter_config.json", {}).get(
        "base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: the adapter names no base model (adapter_config.json "
                          f"base_model_name_or_path)")
    try:
        check_model_source(base, option="base model", hub=True)
    except ConfigError as e:
        raise ConfigError(f"{path}: the adapter's {e}") from e
    return base


def _attach_adapter(enc: Any, path: Path) -> Any:
    """Load the peft adapter in ``path`` onto the encoder's base model (standard keys).
    An adapter whose keys do not match the model (peft only warns, and the model then runs
    without them) is refused: a training pipeline before bigbatch lost its training this way."""
    import warnings

    from peft import PeftModel

    from .source import hub_load_errors

    with warnings.catch_warnings(record=True) as caught, hub_load_errors(str(path)):
        warnings.simplefilter("always")
        enc.model = PeftModel.from_pretrained(enc.model, str(path))
    for w in caught:
        if "missing adapter keys" in str(w.message):
            raise ConfigError(f"{path}: the adapter's weights do not match the model "
                              f"{enc.model_name!r}: {str(w.message)[:500]}")
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    enc.lora_r = enc.model.peft_config["default"].r
    enc.model_name = str(path)
    return enc


def _load_multivector(path: Path, meta: dict[str, Any], settings: dict[str, Any]) -> Any:
    """A PyLate-layout folder (bigbatch's or PyLate's): weights or an adapter, and the
    projection."""
    from .text_multivector import MultiVectorTextEncoder

    if settings.get("pooling", "multivector") != "multivector":
        raise ConfigError(f"{path} is a multi-vector (ColBERT) model; --pooling "
                          f"{settings['pooling']} does not apply to it")
    if _is_adapter(path, meta):
        enc = _attach_adapter(MultiVectorTextEncoder(_adapter_base(path, meta), **settings),
                              path)
        enc.load_projection(path)
        return enc
    return MultiVectorTextEncoder(path, **settings)


def _restore_doc_tower(enc: Any, meta: dict[str, Any]) -> None:
    if meta.get("doc_tower") == "base":
        enc.use_base_doc_tower(None if enc.is_lora else meta.get("doc_base_model"))


def load_encoder(path: str | Path, **overrides: Any) -> Any:
    """A :class:`TextEncoder` for ``path`` (a :class:`VisionLanguageEncoder` for a Qwen-VL
    model); keyword overrides (pooling, max_length, query_prefix, doc_prefix, normalize, or
    the vision-language settings) win over what the folder says.

    Raises:
        ConfigError: the path does not exist or holds no model.
    """
    path = Path(path)
    if (path / "model").is_dir() and (path / "trainer_state.pt").exists():
        path = path / "model"  # a checkpoint directory
    if not path.exists():
        from .source import check_model_source
        check_model_source(path, hub=True)  # no such folder; a hub name not in the cache
        raise ConfigError(f"--model: no such folder: {path}")
    meta_file = path / "bigbatch_encoder.json"
    meta = read_json(meta_file, {})
    from .vision import is_vision_language_model

    if is_vision_language_model(path):
        return _load_vision_language(path, meta, overrides)
    given = {k: v for k, v in overrides.items() if v is not None}
    vl_only = sorted(k for k in given if k in _VL_ONLY_KEYS)
    if vl_only:
        raise ConfigError(f"{vl_only} apply to vision-language models only; {path} is a text "
                          f"model")
    multi = multivector_settings(path)
    if multi is not None:
        return _load_multivector(path, meta, {**multi, **given})
    settings = st_settings(path)
    for key in ("pooling", "normalize", "max_length", "query_prefix", "doc_prefix",
                "exclude_prompt_from_pooling"):
        if key in meta:
            settings[key] = meta[key]
    settings.update(given)
    if "max_length" in given and (path / "config.json").exists():  # asked for: refused
        cfg = read_json(path / "config.json")
        check_positions(given["max_length"], SimpleNamespace(**{
            k: cfg.get(k) for k in ("max_position_embeddings", "model_type")}), str(path))
    if _is_adapter(path, meta):
        enc = _attach_adapter(TextEncoder(_adapter_base(path, meta), **settings), path)
    else:
        if not (path / "config.json").exists():
            raise ConfigError(f"--model: {path} holds no transformers model (no config.json)")
        enc = TextEncoder(path, **settings)
    _restore_doc_tower(enc, meta)
    enc.tasks = _tasks(meta, meta_file)
    return enc


def _tasks(meta: dict[str, Any], where: Path) -> dict[str, dict[str, str]]:
    """The per-task prompts a bigbatch folder records (``{"task": {"query": ..., "doc":
    ...}}``), checked.

    Raises:
        ConfigError: ``tasks`` is not a mapping of task name to query/doc strings.
    """
    tasks = meta.get("tasks") or {}
    ok = isinstance(tasks, dict) and all(
        isinstance(v, dict) and all(k in ("query", "doc") and isinstance(x, str)
                                    for k, x in v.items()) for v in tasks.values())
    if not ok:
        raise ConfigError(f"{where}: 'tasks' must map each task name to its 'query' and "
                          f"'doc' prompts (strings)")
    return tasks
