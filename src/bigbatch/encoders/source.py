"""Where an encoder's weights come from: checking a model source before anything loads,
loading it (refusing half-loaded checkpoints), how a model is recorded in saved folders, and
what identifies its files (for the corpus-embedding cache)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["model_reference", "check_model_source", "hub_load_errors", "load_pretrained",
           "files_key", "model_fingerprint", "model_identity", "check_tokenizer_fits",
           "read_json", "check_hub_reachable", "model_positions", "check_positions"]


def read_json(path: str | os.PathLike, default: Any = None, mapping: bool = True) -> Any:
    """The JSON value of a file of a model or checkpoint folder (``default`` when it does not
    exist): the one way bigbatch reads them, so that a damaged one (garbage, cut short,
    nested too deep, not a JSON object when ``mapping``) is named, never a traceback.

    Raises:
        ConfigError: naming the file, what is wrong and what to do.
    """
    import json

    from ..errors import ConfigError

    p = Path(path)
    if not p.exists():
        return default
    try:
        value = json.loads(p.read_bytes().decode("utf-8-sig"))
    except (ValueError, RecursionError, OSError) as e:
        why = "nested too deep" if isinstance(e, RecursionError) else \
            (getattr(e, "strerror", None) or str(e).splitlines()[0][:300] if str(e) else type(e).__name__)
        raise ConfigError(f"{p}: not valid JSON ({why}); the folder is damaged or incomplete "
                          f"(an interrupted copy or save?): copy or save it again") from e
    if mapping and not isinstance(value, dict):
        raise ConfigError(f"{p}: expected a JSON object, found {type(value).__name__}; the "
                          f"folder is damaged: copy or save it again")
    return value


def model_reference(model: str | os.PathLike) -> str:
    """How a base model is recorded in saved folders (``base_model``, the adapter's
    ``base_model_name_or_path``): an existing local folder as its absolute path, so the
    folder loads from any working directory; a hub name as given."""
    path = Path(model)
    return str(path.resolve()) if path.exists() else str(model)


def check_model_source(model: str | os.PathLike, option: str = "--model",
                       hub: bool = False) -> None:
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
            read_json(p / "config.json")  # garbage is named here, not inside transformers
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
                f"from, or the run's final/ (full weights, the adapter merged)")
        if (p / "model").is_dir() and (p / "trainer_state.pt").exists():
            raise ConfigError(f"{option}: {text} is a bigbatch checkpoint directory; give its "
                              f"model folder {p / 'model'} (or --resume {p.parent} to continue "
                              f"the run)")
        raise ConfigError(f"{option}: {text} holds no transformers model (no config.json)")
    if p.exists():
        raise ConfigError(f"{option}: {text} is a file; give a model folder")
    first = Path(text.split("/")[0]).expanduser()
    looks_local = p.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1 \
        or (os.sep != "/" and os.sep in text) or ("/" in text and first.is_dir())
    if looks_local:
        raise ConfigError(f"{option}: no such folder: {text}{_nearest(p)}")
    if hub:  # (when the model is about to load: checking options needs no network)
        check_hub_reachable(text, option)


def _nearest(path: Path) -> str:
    """For a missing local folder: the nearest folder above it that exists, and what it
    holds (a few names), to spot a typing mistake."""
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        names = sorted(q.name for q in parent.iterdir() if q.is_dir())[:8]
    except OSError:
        return ""
    return f" ({parent} holds: {', '.join(names)})" if names else f" ({parent} holds no folder)"


def check_hub_reachable(name: str, option: str = "--model", timeout: float = 3.0) -> None:
    """A hub name (``namespace/name``) must be in the Hugging Face cache, or the Hub must
    answer within ``timeout`` seconds: without a network, transformers retries for about a
    minute before it fails. With ``HF_HUB_OFFLINE=1`` only the cache counts.

    Raises:
        ConfigError: naming the model and how to go offline.
    """
    import socket
    from urllib.parse import urlparse

    from ..errors import ConfigError

    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:  # pragma: no cover - a dependency of transformers
        return
    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
    except Exception:  # noqa: BLE001 - a name the hub library cannot take: left to transformers
        return
    how = (f"give a local model folder, or download it where there is a network "
           f"(huggingface-cli download {name}) and load it from the cache with "
           f"HF_HUB_OFFLINE=1")
    offline = constants.HF_HUB_OFFLINE or \
        os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    if offline:
        raise ConfigError(f"{option}: {name} is no local folder and is not in the Hugging Face "
                          f"cache, and HF_HUB_OFFLINE is set; {how}")
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname or "huggingface.co",
                                  url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
    except OSError as e:
        raise ConfigError(f"{option}: {name} is no local folder and is not in the Hugging Face "
                          f"cache, and the Hub ({url.hostname}) cannot be reached "
                          f"({getattr(e, 'strerror', None) or e}); {how}") from e


@contextlib.contextmanager
def hub_load_errors(name: str) -> Iterator[None]:
    """Turn transformers' OSError for a source it cannot load (a hub name not in the cache
    while offline or with no network, a folder without the files) into a ConfigError
    naming the source, and a weights file safetensors cannot read (damaged, cut short by an
    interrupted copy) into one naming the file, instead of a traceback."""
    from ..errors import ConfigError

    try:
        yield
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{name}: transformers could not load it: {first}") from e
    except Exception as e:
        if not type(e).__module__.startswith("safetensors"):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        folder = Path(name)
        files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
        where = ", ".join(str(f) for f in files) or name
        raise ConfigError(f"{where}: not a readable safetensors weights file ({first}); it is "
                          f"damaged or incomplete (an interrupted copy or save?): copy or save "
                          f"the model again") from e


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


def files_key(path: str | os.PathLike) -> list[Any]:
    """What identifies a model folder's (or a file's) contents without reading them: each
    file's name, size and modification time (the path alone when it does not exist, a hub
    name)."""
    path = Path(path)
    if not path.exists():
        return [str(path)]
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return [(str(p.relative_to(path)) if path.is_dir() else p.name, p.stat().st_size,
             p.stat().st_mtime_ns) for p in files]


_FINGERPRINT_BYTES = 2**20  # of the first weights file's tensor data


def model_fingerprint(model: str | os.PathLike) -> str | None:
    """What tells a local model folder's weights from another's of the same shapes, read
    in milliseconds: a SHA-256 (its first 16 hex digits) of its ``config.json`` and of the
    first MiB of tensor data of its first weights file (after a safetensors header, which
    names shapes only). None for a hub name or a folder without weights."""
    import hashlib

    path = Path(model)
    if not path.is_dir():
        return None
    weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    if not weights:
        return None
    h = hashlib.sha256()
    config = path / "config.json"
    if config.is_file():
        with open(config, "rb") as f:
            h.update(f.read(_FINGERPRINT_BYTES))
    with open(weights[0], "rb") as f:
        if weights[0].suffix == ".safetensors":
            head = int.from_bytes(f.read(8), "little")
            f.seek(8 + head)
        h.update(f.read(_FINGERPRINT_BYTES))
    return h.hexdigest()[:16]


def model_identity(model: str | os.PathLike) -> dict[str, Any]:
    """How a run records the model it starts from (in its checkpoints, for a resume to
    compare): the reference (:func:`model_reference`) and the fingerprint
    (:func:`model_fingerprint`, None for a hub name)."""
    return {"path": model_reference(model), "fingerprint": model_fingerprint(model)}


def model_positions(max_position_embeddings: Any, model_type: Any) -> int | None:
    """How many token positions a text model's configuration gives (RoBERTa-family models
    lose two to the padding offset: their positions start after the padding index), or None
    when it does not say."""
    if not isinstance(max_position_embeddings, int):
        return None
    return max_position_embeddings - (2 if "roberta" in str(model_type or "") else 0)


def check_positions(max_length: int, model_config: Any, name: str,
                    option: str = "--max-length") -> None:
    """Refuse a max length beyond the model's position embeddings: it fails inside the model
    at the first long text (an index error deep in a forward pass), possibly hours in.

    Raises:
        ConfigError: naming ``option``, both numbers and the model.
    """
    from ..errors import ConfigError

    limit = model_positions(getattr(model_config, "max_position_embeddings", None),
                            getattr(model_config, "model_type", ""))
    if limit is not None and max_length and max_length > limit:
        raise ConfigError(f"{option}: {max_length} is more than the {limit} positions {name} "
                          f"has")


def check_tokenizer_fits(tokenizer: Any, model: nn.Module, name: str) -> None:
    """Refuse a tokenizer that is not the model's: one whose ids run past the model's input
    embeddings (every text would index rows that do not exist), or one of under half their
    rows. transformers builds a tokenizer of a handful of special tokens for a model folder
    without tokenizer files, and every text then embeds as the same few ids: training and
    evaluation run and mean nothing (nDCG@10 0.0000).

    Raises:
        ConfigError: naming the folder, both sizes and what to do.
    """
    from ..errors import ConfigError

    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") \
        else None
    rows = getattr(embeddings, "num_embeddings", None)
    if not isinstance(rows, int):
        return
    tokens = len(tokenizer)
    if tokens > rows or tokens < rows // 2:
        files = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model")
        none = Path(name).is_dir() and not any((Path(name) / f).exists() for f in files)
        hint = (f" (the folder holds no tokenizer file: {', '.join(files)}): copy the "
                f"tokenizer files of the model it came from into it" if none else
                ": give the folder the tokenizer the model was trained with")
        raise ConfigError(f"{name}: its tokenizer has {tokens:,} tokens but the model's input "
                          f"embeddings have {rows:,} rows; this tokenizer is not the "
                          f"model's{hint}")

