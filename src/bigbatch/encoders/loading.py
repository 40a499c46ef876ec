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

__all__ = ["load_encoder", "st_settings", "st_modules", "st_pooling", "st_max_length",
           "st_check_width", "check_colpali_folder"]

# sentence-transformers modules the text encoder reproduces exactly
_ST_MODULES = ("Transformer", "Pooling", "Normalize")
_ST_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last",
               "pooling_mode_mean_tokens": "mean"}
# sentence-transformers 6's pooling_mode names of the same three
_ST_POOLING_NAMES = {"cls": "cls", "last": "lasttoken", "mean": "mean"}
_ST_TEXT_MODALITY = {"method": "forward", "method_output_name": "last_hidden_state"}
_NO_LIMIT = 10 ** 6  # a tokenizer's model_max_length above this means "no limit" (1e30)


def st_settings(path: str | Path) -> dict[str, Any]:
    """Pooling, normalisation, max length and prompts from a sentence-transformers folder
    (empty for a plain transformers folder), read as sentence-transformers 3 to 6 read them:
    the module types of ``modules.json``, the pooling of either layout (``pooling_mode``, or
    the older ``pooling_mode_*`` flags), the max length of :func:`st_max_length`.

    Raises:
        ConfigError: the folder's pipeline is one the text encoder cannot reproduce (a Dense,
            Router or other extra module, max / weighted / sqrt-length pooling or several
            modes, a prompt excluded from pooling with other than mean pooling, the
            transformer in a subfolder or for another task): its embeddings would silently
            differ from the model's own.
    """
    path = Path(path)
    out: dict[str, Any] = {}
    modules = path / "modules.json"
    if not modules.exists():
        # no sentence-transformers pipeline; a max length it names still counts (and a damaged
        # file is named, not passed over)
        if (path / "sentence_bert_config.json").exists() and \
                (length := st_max_length(path)) is not None:
            out["max_length"] = length
        return out
    entries = st_modules(path)
    out["normalize"] = any(kind == "Normalize" for kind, _ in entries)
    pool = next((path / sub / "config.json" for kind, sub in entries if kind == "Pooling"),
                None)
    if pool is not None and pool.exists():
        cfg = read_json(pool, {})
        out["pooling"] = st_pooling(cfg, pool)
        if cfg.get("include_prompt") is False:
            if out["pooling"] != "mean":
                raise ConfigError(f"{pool}: include_prompt false (the prompt left out of "
                                  f"pooling) is supported with mean pooling only")
            out["exclude_prompt_from_pooling"] = True
        st_check_width(path, cfg, pool)
    length = st_max_length(path)
    if length is not None:
        out["max_length"] = length
    prompts = path / "config_sentence_transformers.json"
    if prompts.exists():
        p = read_json(prompts, {}).get("prompts") or {}
        out["query_prefix"] = p.get("query", "")
        out["doc_prefix"] = p.get("document", p.get("passage", ""))
    return out


def st_modules(path: str | Path) -> list[tuple[str, str]]:
    """``(kind, folder)`` of each module in a sentence-transformers folder's ``modules.json``
    (kind: the class name, ``Transformer``, ``Pooling`` or ``Normalize``, in any of the module
    paths sentence-transformers 3 to 6 write), checked to be a pipeline the text encoder
    reproduces: a Transformer at the folder's root, then Pooling, then optionally Normalize.

    Raises:
        ConfigError: naming the module(s) or the layout that is not supported.
    """
    modules = Path(path) / "modules.json"
    listed = read_json(modules, mapping=False)
    if not isinstance(listed, list) or not all(isinstance(m, dict) for m in listed):
        raise ConfigError(f"{modules}: expected a list of modules (objects); the folder is "
                          f"damaged: copy or save it again")
    entries = [(str(m.get("type", "")).rsplit(".", 1)[-1], str(m.get("path", "")))
               for m in listed]
    other = [m.get("type", "") for m, (kind, _) in zip(listed, entries)
             if kind not in _ST_MODULES]
    if other:
        raise ConfigError(f"{modules}: sentence-transformers module(s) {other} are not "
                          f"supported (bigbatch encodes Transformer -> Pooling -> "
                          f"Normalize); the embeddings would differ from the model's")
    kinds = [kind for kind, _ in entries]
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise ConfigError(f"{modules}: modules {kinds} are not supported; bigbatch encodes "
                          f"Transformer -> Pooling, optionally -> Normalize")
    if entries[0][1] not in ("", "."):
        raise ConfigError(f"{modules}: the transformer is in the subfolder "
                          f"{entries[0][1]!r} (an old sentence-transformers layout), which is "
                          f"not supported: load the model in sentence-transformers and save it "
                          f"again")
    _check_st_transformer(Path(path))
    return entries


def _check_st_transformer(path: Path) -> None:
    """Refuse a sentence-transformers 6 Transformer module bigbatch would embed differently:
    another task than feature extraction, text not embedded by ``forward`` ->
    ``last_hidden_state``, or lowercasing the tokenizer does not do."""
    sbc = path / "sentence_bert_config.json"
    cfg = read_json(sbc, {})
    task = cfg.get("transformer_task", "feature-extraction")
    if task != "feature-extraction":
        raise ConfigError(f"{sbc}: transformer_task {task!r} is not supported; bigbatch embeds "
                          f"with the model's last hidden states (feature-extraction)")
    text = (cfg.get("modality_config") or {}).get("text", _ST_TEXT_MODALITY)
    if {k: text.get(k) for k in _ST_TEXT_MODALITY} != _ST_TEXT_MODALITY:
        raise ConfigError(f"{sbc}: text embedded by {text} is not supported; bigbatch embeds "
                          f"text by {_ST_TEXT_MODALITY}")
    if cfg.get("do_lower_case") and not read_json(path / "tokenizer_config.json", {}).get(
            "do_lower_case"):
        raise ConfigError(f"{sbc}: do_lower_case (sentence-transformers lower-cases the "
                          f"texts itself) is not supported for a tokenizer that does not: "
                          f"the texts would be embedded differently")


def st_pooling(cfg: dict[str, Any], where: Path) -> str:
    """The text encoder's pooling for a sentence-transformers Pooling ``config.json``: its
    ``pooling_mode`` (sentence-transformers 6), else the ``pooling_mode_*`` flags (earlier
    versions; 6 reads them when ``pooling_mode`` is absent); mean when neither says.

    Raises:
        ConfigError: a mode the encoder does not pool by, or several at once.
    """
    mode = cfg.get("pooling_mode")
    if mode is not None:
        modes = [mode] if isinstance(mode, str) else list(mode) if isinstance(
            mode, list) else [str(mode)]
        names = {v: k for k, v in _ST_POOLING_NAMES.items()}
        label = "pooling_mode"
    else:
        modes = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
        names = {k: _ST_POOLING[k] for k in _ST_POOLING}
        label = "pooling"
    unsupported = [m for m in modes if m not in names]
    if unsupported or len(modes) > 1:
        raise ConfigError(f"{where}: {label} {modes} is not supported; bigbatch pools by "
                          f"one of mean, cls or last token")
    return names[modes[0]] if modes else "mean"


def st_check_width(path: Path, cfg: dict[str, Any], where: Path) -> None:
    """Refuse a Pooling module whose ``embedding_dimension`` (``word_embedding_dimension``
    before sentence-transformers 6) is not the transformer's hidden size."""
    width = cfg.get("embedding_dimension", cfg.get("word_embedding_dimension"))
    hidden = read_json(path / "config.json", {}).get("hidden_size")
    if isinstance(width, int) and isinstance(hidden, int) and width != hidden:
        raise ConfigError(f"{where}: embedding_dimension {width} is not the model's hidden "
                          f"size {hidden} ({path / 'config.json'}); the folder is "
                          f"inconsistent")


def st_max_length(path: str | Path) -> int | None:
    """The max length sentence-transformers embeds a folder's texts at: ``max_seq_length``
    of ``sentence_bert_config.json`` (the layout before sentence-transformers 6); else the
    tokenizer's ``model_max_length`` (where sentence-transformers 6 keeps it:
    ``processor_kwargs`` or ``tokenizer_config.json``), cut to the model's
    ``max_position_embeddings`` unless ``processor_kwargs`` set it, as sentence-transformers
    3 to 6 do. None when nothing says (or only a tokenizer's "no limit" value does)."""
    path = Path(path)
    sbc = path / "sentence_bert_config.json"
    cfg = read_json(sbc, {})
    length = cfg.get("max_seq_length")
    if length is not None:
        if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
            raise ConfigError(f"{sbc}: max_seq_length must be a positive integer, got "
                              f"{shown(length)}")
        return length
    kwargs = cfg.get("processor_kwargs") or cfg.get("tokenizer_args") or {}
    if isinstance(kwargs.get("model_max_length"), int):
        return int(kwargs["model_max_length"])
    length = read_json(path / "tokenizer_config.json", {}).get("model_max_length")
    positions = read_json(path / "config.json", {}).get("max_position_embeddings")
    if isinstance(positions, int) and positions != -1:
        length = min(length, positions) if isinstance(length, (int, float)) else positions
    if not isinstance(length, (int, float)) or length > _NO_LIMIT:
        return None
    return int(length)


# settings only the vision-language encoder takes; it also takes the shared two after them
_VL_ONLY_KEYS = ("query_instruction", "doc_instruction", "max_num_visual_tokens",
                 "min_num_visual_tokens", "freeze_vision")
_VL_KEYS = _VL_ONLY_KEYS + ("max_length", "normalize")


def _load_vision_language(path: Path, meta: dict[str, Any], overrides: dict[str, Any],
                          adapter: Path | None = None) -> Any:
    """A Qwen-VL folder: single-vector, or multi-vector (ColQwen) when its
    ``bigbatch_encoder.json`` says ``"pooling": "multivector"``; ``adapter``: the adapter
    folder put on the base model instead of the folder's weights."""
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
    if adapter is not None or _is_adapter(path, meta):
        settings["freeze_vision"] = True  # a trained vision tower comes with the adapter
        enc = _attach_adapter(cls(_adapter_base(path, meta), **settings), adapter or path)
    else:
        enc = cls(path, **settings)
    _restore_doc_tower(enc, meta)
    enc.tasks = _tasks(meta, path / "bigbatch_encoder.json")
    return enc


def check_colpali_folder(path: Path, meta: dict[str, Any]) -> None:
    """Refuse a Qwen-VL folder with a ColQwen projection (``custom_text_proj``, as
    colpali-engine's ``ColQwen2`` / ``ColQwen2_5`` save it) that bigbatch did not write: read
    as a vision-language model it would lose the projection and pool one vector, and
    bigbatch does not reproduce colpali-engine's processor prompts (its query augmentation
    tokens, its page prompt), so its embeddings would silently differ from the model's.

    Raises:
        ConfigError: naming the folder, what is not supported and what to do.
    """
    if meta:
        return  # bigbatch's own folder: bigbatch_encoder.json says how it embeds
    from .vision_multivector import projection_weights

    if projection_weights(path):
        raise ConfigError(f"{path}: a ColQwen-style model (custom_text_proj, as colpali-engine "
                          f"saves it) without bigbatch_encoder.json; bigbatch does not "
                          f"reproduce colpali-engine's processor prompts (query augmentation, "
                          f"the page prompt), so its embeddings would differ: evaluate it "
                          f"with colpali-engine, or fine-tune it with bigbatch train "
                          f"--pooling multivector (bigbatch's prompts)")


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


def _load_multivector(path: Path, meta: dict[str, Any], settings: dict[str, Any],
                      adapter: Path | None = None) -> Any:
    """A PyLate-layout folder (bigbatch's or PyLate's): weights or an adapter (``adapter``:
    that folder's, on the base model), and the projection."""
    from .text_multivector import MultiVectorTextEncoder

    if settings.get("pooling", "multivector") != "multivector":
        raise ConfigError(f"{path} is a multi-vector (ColBERT) model; --pooling "
                          f"{settings['pooling']} does not apply to it")
    if adapter is not None or _is_adapter(path, meta):
        enc = _attach_adapter(MultiVectorTextEncoder(_adapter_base(path, meta), **settings),
                              adapter or path)
        enc.load_projection(path)
        return enc
    return MultiVectorTextEncoder(path, **settings)


def _restore_doc_tower(enc: Any, meta: dict[str, Any]) -> None:
    if meta.get("doc_tower") == "base":
        enc.use_base_doc_tower(None if enc.is_lora else meta.get("doc_base_model"))


def load_encoder(path: str | Path, *, with_adapter: bool = False, **overrides: Any) -> Any:
    """A :class:`TextEncoder` for ``path`` (a :class:`VisionLanguageEncoder` for a Qwen-VL
    model); keyword overrides (pooling, max_length, query_prefix, doc_prefix, normalize, or
    the vision-language settings) win over what the folder says. ``with_adapter``: a LoRA
    run's ``final/`` (whose ``bigbatch_encoder.json`` names its adapter folder) is loaded as
    its base model with that adapter on it, as the run trained it, instead of the merged
    weights (an encoder whose adapter can be changed: ``bigbatch merge``).

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
    adapter = path / meta["adapter"] if with_adapter and isinstance(
        meta.get("adapter"), str) else None
    from .vision import is_vision_language_model

    if is_vision_language_model(path):
        check_colpali_folder(path, meta)
        return _load_vision_language(path, meta, overrides, adapter)
    given = {k: v for k, v in overrides.items() if v is not None}
    vl_only = sorted(k for k in given if k in _VL_ONLY_KEYS)
    if vl_only:
        raise ConfigError(f"{vl_only} apply to vision-language models only; {path} is a text "
                          f"model")
    multi = multivector_settings(path)
    if multi is not None:
        return _load_multivector(path, meta, {**multi, **given}, adapter)
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
    if adapter is not None or _is_adapter(path, meta):
        enc = _attach_adapter(TextEncoder(_adapter_base(path, meta), **settings),
                              adapter or path)
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
