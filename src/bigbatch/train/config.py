"""Training configuration: defaults, a YAML file, and command-line flags, in that order of
precedence (flags override the file, the file overrides defaults).

Unknown keys, a key given twice and bad values (a number that is not finite, a device this
machine does not have) raise :class:`bigbatch.errors.ConfigError` naming the key (and the
file and line). Relative paths (model folder, data, output folder, resume) in a YAML file
are read from the YAML file's folder, on the command line from the working directory; the
resolved configuration, with absolute paths, is written to ``<output_dir>/config.yaml``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, shown

__all__ = ["TrainConfig", "load_config", "DTYPES", "device_problem", "number_list"]

DTYPES = ("float32", "bfloat16", "float16")
MAX_LOGIT_SCALE = 100.0  # the learnable temperature is clamped to [1 / this, 1] (LogitScale)
ENCODERS = ("auto", "text", "vision-language")
MODES = ("standard", "query-side-tune")
POOLINGS = ("mean", "cls", "last", "multivector")  # multivector: one vector per token (ColBERT)


@dataclass
class TrainConfig:
    """Every option of ``bigbatch train``; defaults follow Qwen3-VL-Embedding's GradCache
    training pipeline (``train_contrastors.py``)."""

    model: str = ""
    # one source (a path), or several: a comma list, or (YAML) a list of paths and mappings
    # (bigbatch.data.mix.SOURCE_KEYS); likewise --eval-data (path and name)
    train_data: str | list = ""
    train_split: str = "train"
    eval_data: str | list | None = None
    mix_temperature: float = 1.0
    eval_split: str = "test"
    output_dir: str = "runs/bigbatch"
    batch_size: int = 4
    grad_cache_chunk: int = 2
    query_grad_cache_chunk: int | None = None
    lr: float = 2e-5
    logit_scale_lr: float | None = None
    weight_decay: float = 0.01
    scheduler: str = "cosine"
    warmup_steps: int = 50
    max_steps: int = 500
    epochs: float | None = None
    temperature: float = 0.07
    fixed_temperature: bool = False
    symmetric: bool = False
    loss_block_size: int | None = None
    matryoshka_dims: list[int] | None = None
    matryoshka_weights: list[float] | None = None
    extra_negatives: list[str] | None = None
    grad_cache_tokens: int | None = None
    num_hard_negatives: int = 0
    lora_r: int = 32
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | None = None
    merge_lora: bool = False
    pooling: str = "mean"
    multivector_dim: int = 128
    query_length: int = 0
    max_length: int = 256
    query_max_length: int | None = None
    query_prefix: str = ""
    doc_prefix: str = ""
    exclude_instruction_from_pooling: bool = False
    gradient_checkpointing: bool = False
    encoder: str = "auto"
    query_instruction: str | None = None
    doc_instruction: str | None = None
    max_num_visual_tokens: int = 256
    min_num_visual_tokens: int = 4
    freeze_vision: bool = True
    mode: str = "standard"
    query_side_backward: str = "direct"
    doc_negatives: str = "batch"
    max_grad_norm: float = 1.0
    eval_steps: int = 0
    eval_batch_size: int = 64
    eval_at_start: bool = True
    best_metric: str = "ndcg@10"
    save_steps: int = 100
    save_total_limit: int = 2
    resume: str | None = None  # a checkpoint, an output folder (its newest), or "auto"
    overwrite: bool = False
    seed: int = 42
    dtype: str = "float32"
    device: str | None = None
    log_steps: int = 1
    dist_timeout: float = 1800.0
    data_root: str | None = None  # files the data names must resolve inside this folder
    guide_model: str | None = None  # GISTEmbed guide: a model folder, or "self"
    guide_margin: float = 0.0
    guide_margin_type: str = "absolute"
    distill: str | None = None  # "kl" or "margin-mse" against the records' teacher scores
    distill_weight: float = 1.0
    teacher_temperature: float | None = None
    deepspeed: str | None = None  # a DeepSpeed JSON configuration (ZeRO stage 1 or 2)
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    push_to_hub: str | None = None  # a Hugging Face Hub repository for final/ and its card
    strict: bool = False  # a step that cannot teach (loss and gradient 0, logits overflow) stops
    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def validate(self) -> "TrainConfig":
        """Raise :class:`ConfigError` naming the option for any impossible value."""
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"--{name.replace('_', '-')}: {why} (got {shown(getattr(self, name))})")

        for f in dataclasses.fields(self):  # inf or nan passes every comparison check below
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise bad(f.name, "must be a finite number")
        if not self.model:
            raise ConfigError("--model is required: a path or name of a transformers model")
        from ..encoders.source import check_model_source
        check_model_source(self.model)  # before any data loads: an adapter, a missing path
        if not self.train_data:
            raise ConfigError("--train-data is required: a training file (JSONL in the "
                              "contrastors, swift or st layout, or st Parquet) or a BEIR "
                              "directory")
        self._validate_sources()
        for name in ("batch_size", "grad_cache_chunk", "max_length", "eval_batch_size",
                     "log_steps"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be > 0")
        for name in ("warmup_steps", "eval_steps", "save_steps", "num_hard_negatives",
                     "lora_r", "lora_alpha"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        if self.save_total_limit < 1:  # 0 used to keep every checkpoint, silently
            raise bad("save_total_limit", "must be >= 1: the newest checkpoints kept (a run "
                                          "resumes from one); to keep every one, give at least "
                                          "the run's number of checkpoints")
        if self.query_grad_cache_chunk is not None and self.query_grad_cache_chunk <= 0:
            raise bad("query_grad_cache_chunk", "must be > 0")
        if self.loss_block_size is not None and self.loss_block_size < 0:
            raise bad("loss_block_size", "must be >= 0 (0: the dense loss; unset: automatic)")
        if self.max_steps <= 0 and not self.epochs:
            raise bad("max_steps", "must be > 0 (or give --epochs)")
        if self.epochs is not None and self.epochs <= 0:
            raise bad("epochs", "must be > 0")
        if not self.lr > 0:
            raise bad("lr", "must be > 0")
        if not self.temperature > 0:
            raise bad("temperature", "must be > 0")
        if not self.fixed_temperature and not 1 / MAX_LOGIT_SCALE <= self.temperature <= 1:
            raise bad("temperature", f"a learnable temperature is kept in "
                                     f"[{1 / MAX_LOGIT_SCALE:g}, 1]; start it there (or give "
                                     f"--fixed-temperature)")
        if self.logit_scale_lr is not None and not self.logit_scale_lr > 0:
            raise bad("logit_scale_lr", "must be > 0 (leave it out to use --lr)")
        if self.query_max_length is not None and self.query_max_length <= 0:
            raise bad("query_max_length", "must be > 0 (leave it out to use --max-length)")
        if self.weight_decay < 0:
            raise bad("weight_decay", "must be >= 0")
        if not self.dist_timeout > 0:
            raise bad("dist_timeout", "must be > 0 seconds")
        if self.device is not None and (problem := device_problem(self.device)):
            raise bad("device", problem)
        if self.max_grad_norm < 0:
            raise bad("max_grad_norm", "must be >= 0 (0 turns clipping off)")
        if self.scheduler not in ("cosine", "constant"):
            raise bad("scheduler", "must be 'cosine' or 'constant'")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"must be one of {DTYPES}")
        if self.pooling not in POOLINGS:
            raise bad("pooling", "must be 'mean', 'cls', 'last' or 'multivector'")
        self._validate_multivector(bad)
        self._validate_objectives(bad)
        self._validate_guide_and_distill(bad)
        if self.encoder not in ENCODERS:
            raise bad("encoder", f"must be one of {ENCODERS}")
        if self.mode not in MODES:
            raise bad("mode", f"must be one of {MODES}")
        if self.query_side_backward not in ("direct", "gradcache"):
            raise bad("query_side_backward", "must be 'direct' or 'gradcache'")
        if self.doc_negatives not in ("batch", "corpus"):
            raise bad("doc_negatives", "must be 'batch' or 'corpus'")
        if self.doc_negatives == "corpus" and self.mode != "query-side-tune":
            raise bad("doc_negatives", "'corpus' needs --mode query-side-tune (a frozen "
                                       "document tower, so the corpus is embedded once)")
        if self.doc_negatives == "corpus" and self.num_hard_negatives:
            raise ConfigError("--doc-negatives corpus already uses every document as a "
                              "negative; set --num-hard-negatives 0")
        if self.doc_negatives == "corpus" and self.symmetric:
            raise ConfigError("--symmetric needs trainable documents; not with --doc-negatives "
                              "corpus")
        for name in ("max_num_visual_tokens", "min_num_visual_tokens"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be > 0")
        if self.min_num_visual_tokens > self.max_num_visual_tokens:
            raise bad("min_num_visual_tokens", "must be <= --max-num-visual-tokens")
        if not 0 <= self.lora_dropout < 1:
            raise bad("lora_dropout", "must be in [0, 1)")
        if self.lora_r > 0 and self.lora_alpha == 0:
            raise bad("lora_alpha", "0 means full fine-tuning; then set --lora-r 0 too")
        from ..retrieval.evaluate import METRIC_NAMES
        metric = self.best_metric.removeprefix("unseen/")
        if metric not in METRIC_NAMES:
            raise bad("best_metric", f"must be one of {METRIC_NAMES} (optionally 'unseen/...')")
        self._validate_reporting(bad)
        if self.deepspeed:
            self._validate_deepspeed(bad)
        return self

    def _validate_guide_and_distill(self, bad: Any) -> None:
        """The options of guided filtering (``--guide-model``) and distillation
        (``--distill``): InfoNCE over the batch's documents only."""
        from ..losses.distill import OBJECTIVES
        from ..losses.guided import MARGIN_TYPES

        if self.guide_margin_type not in MARGIN_TYPES:
            raise bad("guide_margin_type", f"must be one of {MARGIN_TYPES}")
        if self.distill is not None and self.distill not in OBJECTIVES:
            raise bad("distill", f"must be one of {tuple(OBJECTIVES)}")
        if self.distill_weight < 0:
            raise bad("distill_weight", "must be >= 0")
        if self.teacher_temperature is not None and not self.teacher_temperature > 0:
            raise bad("teacher_temperature", "must be > 0 (leave it out to use --temperature)")
        for name in ("guide_model", "distill"):
            if getattr(self, name) is None:
                continue
            if self.pooling == "multivector" or self.doc_negatives == "corpus":
                raise bad(name, "works with the single-vector InfoNCE over the batch's "
                                "documents: not with --pooling multivector or --doc-negatives "
                                "corpus")
        if self.guide_model is not None and self.extra_negatives:
            raise bad("guide_model", "cannot be combined with --extra-negatives yet (the guide "
                                     "would have to score the qq/dd columns too): use one")
        if self.distill is not None and self.num_hard_negatives < 1:
            raise bad("distill", "compares each positive with its hard negatives: give "
                                 "--num-hard-negatives 1 or more (and records with "
                                 "pos_score and neg_scores)")
        if self.guide_model not in (None, "self") and not Path(self.guide_model).exists():
            raise bad("guide_model", "must be 'self' (the model's starting weights) or an "
                                     "existing model folder")

    def _validate_reporting(self, bad: Any) -> None:
        """``--report-to`` names known reporters (``none`` alone), ``--push-to-hub`` a
        repository id ``namespace/name`` or ``name``."""
        from .logging import REPORTERS, check_reporters

        unknown = [r for r in self.report_to if r not in (*REPORTERS, "none")]
        if unknown:
            raise bad("report_to", f"unknown {unknown}; choose from "
                                   f"{', '.join((*REPORTERS, 'none'))}")
        if "none" in self.report_to and len(self.report_to) > 1:
            raise bad("report_to", "'none' cannot be combined with other reporters")
        check_reporters(self.report_to)
        if self.push_to_hub is not None:
            parts = self.push_to_hub.split("/")
            if not 1 <= len(parts) <= 2 or not all(parts) or any(" " in x for x in parts):
                raise bad("push_to_hub", "must be a Hub repository id: name or namespace/name")

    def _validate_deepspeed(self, bad: Any) -> None:
        """``--deepspeed``: the JSON file is read and checked now (before any data loads),
        and the options it cannot run with are refused."""
        from ..integrations.deepspeed import read_config

        read_config(self.deepspeed, batch_size=self.batch_size,
                    max_grad_norm=self.max_grad_norm,
                    world_size=int(os.environ.get("WORLD_SIZE", 1)))
        if self.mode != "standard":
            raise bad("mode", "--deepspeed trains both towers through one DeepSpeed engine: "
                              "'standard' only")
        if self.dtype == "float16":
            raise bad("dtype", "float16 needs a loss scaler that --deepspeed does not run; use "
                               "bfloat16")
        if self.resume:
            raise bad("resume", "resuming a --deepspeed run is not supported yet (its "
                                "checkpoints hold the weights, not DeepSpeed's optimizer "
                                "partitions); start from a checkpoint's weights with --model")

    def train_sources(self) -> list[Any]:
        """The training sources ``--train-data`` names (:class:`~bigbatch.data.mix.SourceSpec`)."""
        from ..data.mix import parse_sources

        return parse_sources(self.train_data, "--train-data")

    def eval_sets(self) -> list[Any]:
        """The evaluation sets ``--eval-data`` names (each a path and a name)."""
        from ..data.mix import EVAL_KEYS, parse_sources

        return parse_sources(self.eval_data, "--eval-data", EVAL_KEYS)

    def _validate_sources(self) -> None:
        """The options of several training sources and evaluation sets."""
        sources = self.train_sources()
        self.eval_sets()
        if not self.mix_temperature > 0:
            raise ConfigError(f"--mix-temperature: must be > 0 (got {self.mix_temperature!r})")
        if len(sources) > 1 and self.doc_negatives == "corpus":
            raise ConfigError("--doc-negatives corpus trains against one corpus; give one "
                              "--train-data source")
        if self.exclude_instruction_from_pooling and self.pooling != "mean":
            raise ConfigError(f"--exclude-instruction-from-pooling: applies to --pooling mean "
                              f"(got {self.pooling!r}: the embedding is one token's)")
        if self.doc_negatives == "corpus" and any(s.num_hard_negatives for s in sources):
            raise ConfigError("--doc-negatives corpus already uses every document as a "
                              "negative; set num_hard_negatives to 0")

    def _validate_multivector(self, bad: Any) -> None:
        """The options of ``--pooling multivector`` (late interaction: ColBERT-style text
        models, ColQwen-style vision-language models)."""
        if self.multivector_dim <= 0:
            raise bad("multivector_dim", "must be > 0")
        if self.query_length < 0 or self.query_length == 1:
            raise bad("query_length", "must be 0 (off) or > 1 (a marker and a token)")
        if self.pooling != "multivector":
            if self.query_length:
                raise bad("query_length", "applies to --pooling multivector only")
            return
        if self.mode != "standard":
            raise bad("mode", "--pooling multivector trains both towers: 'standard' only")
        if self.query_length and self.encoder == "vision-language":
            raise bad("query_length", "applies to text models (query expansion with mask "
                                      "tokens); not to vision-language models")
        if self.query_length and self.query_max_length is not None:
            raise ConfigError("--query-max-length does not apply with --query-length (queries "
                              "are padded and cut to --query-length tokens)")

    def _validate_objectives(self, bad: Any) -> None:
        """Matryoshka widths, extra in-batch negatives and the token budget per chunk."""
        from ..losses import extra_negatives_of
        from ..losses.matryoshka import check_dims

        if self.matryoshka_dims is not None:
            check_dims(self.matryoshka_dims, self.matryoshka_weights, what="--matryoshka-dims")
        elif self.matryoshka_weights is not None:
            raise bad("matryoshka_weights", "needs --matryoshka-dims (one weight per dimension)")
        if self.extra_negatives:
            try:
                extra_negatives_of(self.extra_negatives)
            except ConfigError as e:
                raise ConfigError("--extra-negatives" + str(e).removeprefix("extra_negatives")) \
                    from None
            if self.pooling == "multivector":
                raise bad("extra_negatives", "applies to one vector per text, not --pooling "
                                             "multivector")
            if self.doc_negatives == "corpus":
                raise bad("extra_negatives", "needs the batch's documents (not --doc-negatives "
                                             "corpus)")
        if self.grad_cache_tokens is not None and self.grad_cache_tokens <= 0:
            raise bad("grad_cache_tokens", "must be > 0 (padded tokens per chunk)")

    @property
    def full_finetune(self) -> bool:
        """``--lora-alpha 0`` or ``--lora-r 0`` means full fine-tuning."""
        return self.lora_r == 0 or self.lora_alpha == 0

    def to_dict(self) -> dict[str, Any]:
        """The options (``overwrite``, an action of one start, is not a setting kept with a
        run: a ``config.yaml`` reused as ``--config`` never moves a folder aside by itself)."""
        d = dataclasses.asdict(self)
        d.pop("extra")
        d.pop("overwrite")
        return d

    def write(self, path: str | Path) -> None:
        import yaml

        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig) if f.name != "extra"}


def device_problem(name: str) -> str | None:
    """Why ``name`` cannot be used as a torch device on this machine (not a device name, CUDA
    or MPS not available, a GPU index beyond those present), or None when it can."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        return "not a torch device (cpu, cuda, cuda:1, mps, ...)"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return ("CUDA is not available here (no GPU visible, or a torch build without "
                    "CUDA); use --device cpu, or leave --device out to take what there is")
        if device.index is not None and device.index >= torch.cuda.device_count():
            return (f"there are {torch.cuda.device_count()} GPU(s) here (cuda:0 to "
                    f"cuda:{torch.cuda.device_count() - 1})")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) is not None
                                     and torch.backends.mps.is_available()):
        return "MPS (Apple GPU) is not available here; use --device cpu"
    return None


def _coerce(name: str, value: Any, source: str) -> Any:
    """Check a YAML value against the field's type; ints are accepted for floats."""
    f = _FIELDS[name]
    default = f.default if f.default is not dataclasses.MISSING else None
    kind = type(default) if default is not None else None
    typ = str(f.type)
    if value is None:
        if "None" in typ:
            return None
        raise ConfigError(f"{source}: {name} must not be empty")
    if "list[int]" in typ or "list[float]" in typ:
        return number_list(value, int if "list[int]" in typ else float, f"{source}: {name}")
    if name in _SOURCE_OPTIONS:  # a path, a comma list, or a list of paths and mappings
        if isinstance(value, (str, list)):
            return value
        raise ConfigError(f"{source}: {name} must be a path or a list of sources, got "
                          f"{shown(value)}")
    if "list" in typ:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        raise ConfigError(f"{source}: {name} must be a list of strings, got {shown(value)}")
    if kind is bool or typ == "bool":
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: {name} must be true or false, got {shown(value)}")
    if kind is int or typ.startswith("int"):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: {name} must be an integer, got {shown(value)}")
    if kind is float or typ.startswith("float"):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML reads 2e-5 as a string
            except ValueError:
                pass
        raise ConfigError(f"{source}: {name} must be a number, got {shown(value)}")
    if isinstance(value, (str, int, float)):
        return str(value)
    raise ConfigError(f"{source}: {name} must be a string, got {shown(value)}")


def number_list(value: Any, kind: type, what: str) -> list:
    """A list of ``kind`` (int or float) from a list or a comma-separated string ("384,128").

    Raises:
        ConfigError: an entry that is not such a number, naming ``what``.
    """
    items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) \
        else value if isinstance(value, list) else None
    if items is None:
        raise ConfigError(f"{what} must be a list of numbers, e.g. 384,256,128, got {shown(value)}")
    out = []
    for v in items:
        try:
            if isinstance(v, bool) or (kind is int and isinstance(v, float)):
                raise ValueError
            out.append(kind(v))
        except (TypeError, ValueError):
            raise ConfigError(f"{what}: {shown(v)} is not {'an integer' if kind is int else 'a number'}"
                              f" (give a comma-separated list, e.g. 384,256,128)") from None
    return out


def _check_keys(keys: Any, source: str) -> None:
    for key in keys:
        if key not in _FIELDS:
            close = difflib.get_close_matches(key, list(_FIELDS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{source}: unknown option {shown(key)}{hint}")


def _key_lines(text: str, source: str) -> dict[Any, int]:
    """The line (1-based) of each top-level key of a YAML mapping, for error messages.

    Raises:
        ConfigError: a key given twice (also spelled once with ``-`` and once with ``_``),
            which YAML would settle silently by taking the last.
    """
    import yaml

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:  # pragma: no cover - safe_load already parsed it
        return {}
    if not isinstance(node, yaml.MappingNode):
        return {}
    out: dict[Any, int] = {}
    first: dict[str, tuple[Any, int]] = {}
    for key, _ in node.value:
        try:
            name = yaml.safe_load(yaml.serialize(key))
        except yaml.YAMLError:  # pragma: no cover
            continue
        line = key.start_mark.line + 1
        norm = str(name).replace("-", "_")
        if norm in first:
            was, at = first[norm]
            raise ConfigError(f"{source}:{line}: {shown(name)} is given twice (also {shown(was)} at line "
                              f"{at}); YAML would silently take the last: keep one")
        first[norm] = (name, line)
        out[name] = line
    return out


_PATH_KEYS = ("model", "train_data", "eval_data", "output_dir", "resume", "data_root",
              "guide_model", "deepspeed")
_SOURCE_OPTIONS = ("train_data", "eval_data")


def _resolve_path(key: str, value: Any, base: Path) -> Any:
    """A path option made absolute: ``~`` is the home folder, a relative path is read from
    ``base`` (the YAML file's folder, or the working directory for a flag). A ``model`` that
    is no folder there stays as given: a hub name (``namespace/name``)."""
    if key in _SOURCE_OPTIONS:
        return _resolve_sources(value, base)
    if not isinstance(value, str) or not value or (key, value) == ("resume", "auto"):
        return value  # (--resume auto: this output folder's run, if it has a checkpoint)
    path = Path(value).expanduser()
    if not path.is_absolute():
        if key in ("model", "guide_model") and not (base / path).exists():
            return value  # a hub name, a missing folder check_model_source names, "self"
        path = base.absolute() / path
    return os.path.normpath(path)


def _resolve_sources(value: Any, base: Path) -> Any:
    """``--train-data`` / ``--eval-data`` with every path made absolute: one path stays a
    string; a comma list or a list becomes a list (a one-path list a string), each mapping's
    ``path`` resolved."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()] if "," in value else value
    if isinstance(value, str):
        return _resolve_path("data", value, base) if value else value
    if not isinstance(value, list):
        return value
    out = []
    for entry in value:
        if isinstance(entry, str):
            out.append(_resolve_path("data", entry, base))
        elif isinstance(entry, dict) and isinstance(entry.get("path"), str):
            out.append({**entry, "path": _resolve_path("data", entry["path"], base)})
        else:
            out.append(entry)  # parse_sources names what is wrong with it
    return out[0] if len(out) == 1 and isinstance(out[0], str) else out


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the YAML file ``path`` (keys spelled with ``_`` or ``-``), then
    ``overrides`` (the flags given on the command line). Returns a validated config."""
    values: dict[str, Any] = {}
    if path is not None:
        from ..data.readers.yaml_file import load_yaml

        p = Path(path)
        if not p.exists():
            raise ConfigError(f"--config: file not found: {p}")
        loaded = load_yaml(p, "YAML configuration") or {}  # aliases bounded, plain values only
        values["extra"] = {"config_file": str(p.absolute())}  # an input --overwrite keeps
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: expected a mapping of option: value")
        lines = _key_lines(p.read_text(), str(p))
        loaded = {str(k).replace("-", "_"): (v, f"{p}:{lines[k]}" if k in lines else str(p))
                  for k, v in loaded.items()}
        for k, (v, where) in loaded.items():
            _check_keys([k], where)
        values.update({k: _coerce(k, v, where) for k, (v, where) in loaded.items()})
        values.update({k: _resolve_path(k, values[k], p.parent) for k in _PATH_KEYS
                       if k in values})  # read from the YAML file's folder
    values.setdefault("output_dir", TrainConfig.output_dir)
    for k, v in (overrides or {}).items():
        k = k.replace("-", "_")
        _check_keys([k], "command line")
        values[k] = _resolve_path(k, v, Path.cwd()) if k in _PATH_KEYS else v
    if values["output_dir"] == TrainConfig.output_dir:  # the default: the working directory's
        values["output_dir"] = _resolve_path("output_dir", values["output_dir"], Path.cwd())
    values = _model_defaults(values)
    return TrainConfig(**values).validate()


# what a sentence-transformers model folder says about how it embeds
_ST_KEYS = ("pooling", "max_length", "query_prefix", "doc_prefix")
# what a vision-language folder bigbatch saved says about how it embeds
_VL_KEYS = ("query_instruction", "doc_instruction", "max_num_visual_tokens",
            "min_num_visual_tokens", "max_length")


def _model_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """Options the user did not set, taken from a text model folder's sentence-transformers
    configuration (pooling, max length, query/document prompts), or from the
    ``bigbatch_encoder.json`` of a vision-language folder bigbatch saved (instructions, pixel
    budget, max length), so a model trains as it embeds, and as ``bigbatch mine`` / ``eval``
    embed with it."""
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
        if positions is not None and positions < TrainConfig.max_length:
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
