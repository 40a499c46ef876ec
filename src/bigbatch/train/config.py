"""Training configuration: defaults, a YAML file, and command-line flags, in that order of
precedence (flags override the file, the file overrides defaults). Each option is one
field of :class:`TrainConfig`, with its help, section and choices; values are read by
:mod:`bigbatch.train.option_values`, what a model folder says by
:mod:`bigbatch.train.model_defaults`.

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
import types
import typing
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..encoders.instructions import DOC_INSTRUCTION, QUERY_INSTRUCTION
from ..errors import ConfigError, shown
from .model_defaults import model_defaults
from .option_values import PATH_KEYS, comma_list, key_lines, number_list, parse_typed, resolve_path

__all__ = ["TrainConfig", "load_config", "option", "parse_value", "SECTIONS", "DTYPES",
           "ENCODERS", "MODES", "POOLINGS", "SCHEDULERS", "QUERY_SIDE_BACKWARDS",
           "DOC_NEGATIVES", "ATTN_IMPLEMENTATIONS", "one_of", "option_type", "device_problem",
           "number_list", "config_file_of", "comma_list"]

DTYPES = ("float32", "bfloat16", "float16")
FSDP_DTYPES = ("float32", "bfloat16")  # --dtype under --fsdp
AUTO = "auto"  # --grad-cache-chunk, --query-grad-cache-chunk, --grad-cache-tokens: sized for
#                --memory-budget
MIN_MEMORY_BUDGET = 2 ** 20  # bytes: a --memory-budget size below 1 MB is a mistake
MAX_LOGIT_SCALE = 100.0  # the learnable temperature is clamped to [1 / this, 1] (LogitScale)
ENCODERS = ("auto", "text", "vision-language")
MODES = ("standard", "query-side-tune")
POOLINGS = ("mean", "cls", "last", "multivector")  # multivector: one vector per token (ColBERT)
SCHEDULERS = ("cosine", "constant")
QUERY_SIDE_BACKWARDS = ("direct", "gradcache")
DOC_NEGATIVES = ("batch", "corpus")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")  # transformers' names

# bigbatch mine's flags as bigbatch train names them (in MiningOptions' messages)
_MINE_FLAGS = (("--num-negatives", "--num-hard-negatives"),
               ("--rank-window", "--negatives-rank-window"),
               ("--max-score-ratio", "--negatives-max-score-ratio"),
               ("--min-negatives", "--num-hard-negatives"))

# the groups `bigbatch train --help` lists the options in (flags and YAML keys stay flat)
SECTIONS = {
    "model": "the model, how it embeds and what of it trains",
    "data": "training and evaluation data",
    "engine": "GradCache: the batch, its chunks, precision and distribution",
    "loss": "the contrastive objective and its variants",
    "optimizer": "optimizer and schedule",
    "run": "the output folder, checkpoints, evaluation, logging and devices",
}


def option(default: Any = None, *, section: str, help: str, choices: tuple[str, ...] | None = None,
           factory: Callable[[], Any] | None = None, from_model_folder: bool = False,
           default_text: str | None = None) -> Any:
    """A :class:`TrainConfig` field and everything else about it, in its metadata: its
    ``help`` (the flag's, in ``--help`` and the CLI reference), its ``section`` (one of
    :data:`SECTIONS`), its ``choices`` (checked by :meth:`TrainConfig.validate`, listed by
    the flag), and ``from_model_folder``: left out, its value is what the model folder says
    (``default_text``, or the default, when it says nothing); ``bigbatch eval`` and ``mine``
    take these options too."""
    if section not in SECTIONS:
        raise ValueError(f"unknown section {section!r}")
    metadata = {"help": help, "section": section, "choices": choices,
                "from_model_folder": from_model_folder, "default_text": default_text}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


# the configs validate() passed (kept outside them: a config holds its options only)
_VALID: dict[int, weakref.ref] = {}
_CONFIG_FILES: dict[int, tuple[weakref.ref, str]] = {}  # config -> the YAML file it was read from


@dataclass(frozen=True)
class TrainConfig:
    """Every option of ``bigbatch train``; defaults follow Qwen3-VL-Embedding's GradCache
    training pipeline (``train_contrastors.py``). Each field's metadata holds its help, its
    section and its choices (:func:`option`).

    A config is never changed once made (another is ``dataclasses.replace(config, ...)``):
    what a run derives from it, such as the chunk sizes GradCache uses, is decided where it is
    used (:func:`bigbatch.train.build.build_cache`) and read from there."""

    model: str = option("", section="model", help=(
        "required: transformers model path or name (e.g. the all-MiniLM-L6-v2 folder)"))
    # one source (a path), or several: a comma list, or (YAML) a list of paths and mappings
    # (bigbatch.data.mix.SOURCE_KEYS); likewise --eval-data (path and name)
    train_data: str | list = option("", section="data", help=(
        "required: JSONL records (query, positive|chunk_path, negatives|neg_chunk_paths), a "
        "swift or st (JSONL or .parquet) file (detected), or a BEIR directory; several "
        "sources: repeat the flag or give a comma list (every batch is drawn from one source; "
        "in YAML a list whose entries may set name, weight, query_instruction/doc_instruction "
        "or prefixes, num_hard_negatives, in_batch_negatives, max_records: see "
        "docs/guides/multi-dataset.md)"))
    train_split: str = option("train", section="data", help=(
        "qrels split used as training pairs when --train-data is a BEIR directory"))
    eval_data: str | list | None = option(None, section="data", help=(
        "BEIR directory evaluated with full-corpus retrieval; several: repeat the flag or give "
        "a comma list (each reported as <name>/<metric>, their mean selects best/; each "
        "embedded with the prompts of the training source of the same name) (default: none, "
        "no evaluation)"))
    mix_temperature: float = option(1.0, section="data", help=(
        "several --train-data sources without weights: draw each step's source with "
        "probability proportional to size ** (1 / this); 1: by size, larger: closer to "
        "uniform (small sources up-sampled)"))
    eval_split: str = option("test", section="data", help="qrels split to evaluate on")
    output_dir: str = option("runs/bigbatch", section="run", help=(
        "where checkpoints, best/, final/, metrics.jsonl and the plot go: a new or empty "
        "folder (a folder holding another run or other files is refused: see --resume and "
        "--overwrite)"))
    batch_size: int = option(4, section="engine", help=(
        "queries per process per step (global batch = this x processes)"))
    grad_cache_chunk: int | str = option("auto", section="engine", help=(
        "rows embedded at once (memory = this x per-example cost), or auto: the largest chunk "
        "whose step fits --memory-budget, from a probe of the data's longest texts, sized for "
        "queries and documents each (at most --batch-size: then plain training, one pass); "
        "the choice is checked after step 1 and lowered once if the step went over"))
    query_grad_cache_chunk: int | str | None = option(None, section="engine", help=(
        "rows per GradCache chunk for the query tower, or auto (default: --grad-cache-chunk; "
        "with auto, queries are sized on their own); text queries are cheaper than page "
        "images"))
    lr: float = option(2e-5, section="optimizer", help="peak learning rate (AdamW)")
    logit_scale_lr: float | None = option(None, section="optimizer", help=(
        "learning rate of the temperature (default: --lr)"))
    weight_decay: float = option(0.01, section="optimizer", help=(
        "AdamW weight decay of the model's parameters (not the temperature's)"))
    scheduler: str = option("cosine", section="optimizer", choices=SCHEDULERS, help=(
        "cosine or constant, after linear warmup"))
    warmup_steps: int = option(50, section="optimizer", help=(
        "steps of linear warmup from 0 to --lr"))
    max_steps: int = option(500, section="optimizer", help=(
        "optimizer steps; on the command line it wins over a --config file's epochs "
        "(--epochs wins over it)"))
    epochs: float | None = option(None, section="optimizer", help=(
        "train this many epochs instead of --max-steps (default: none, --max-steps decides)"))
    temperature: float = option(0.07, section="loss", help=(
        "initial temperature (learnable unless --fixed-temperature)"))
    fixed_temperature: bool = option(False, section="loss", help=(
        "keep the temperature fixed instead of learning it"))
    symmetric: bool = option(False, section="loss", help=(
        "add the document-to-query direction to the loss"))
    loss_block_size: int | None = option(None, section="loss", help=(
        "query rows per block of the streamed loss (default: automatic, at most 2**22 logits "
        "a block, so the batch x documents logits never exist at once; 0: the dense loss, all "
        "logits at once)"))
    matryoshka_dims: list[int] | None = option(None, section="loss", help=(
        "Matryoshka: train every one of these embedding widths, largest first (e.g. "
        "384,256,128,64: each a prefix of the embedding, normalised again; one replay for "
        "all); final/ records them, and SentenceTransformer(path, truncate_dim=128) uses one "
        "(default: off)"))
    matryoshka_weights: list[float] | None = option(None, section="loss", help=(
        "Matryoshka: one weight per width of --matryoshka-dims (default: all 1)"))
    extra_negatives: list[str] | None = option(None, section="loss", help=(
        "qq, dd or qq,dd: add the other queries (qq) and the positive's similarities to the "
        "other documents (dd) to each query's softmax denominator, as Qwen3-Embedding trains "
        "(default: none)"))
    negative_queue: int = option(0, section="loss", help=(
        "keep the document embeddings of the last N steps (the global batch's, with their "
        "ids) as extra negatives of every query, MoCo-style: they are stale (embedded by "
        "earlier weights) and constants (no gradient through them), so this is not the "
        "objective of an N+1 times larger batch; a queued document that is a query's "
        "positive, or was the same query's positive, is masked; checkpoints keep the queue "
        "(default: 0, off)"))
    grad_cache_tokens: int | str | None = option(None, section="engine", help=(
        "padded tokens per GradCache chunk at most: a chunk holds as many texts as fit "
        "(longest first), so mixed short and long texts keep one chunk's memory bounded; "
        "--grad-cache-chunk still caps the rows; auto: the largest token budget whose step "
        "fits --memory-budget (default: off, rows only)"))
    memory_budget: float | int = option(0.8, section="engine", help=(
        "what one training step may hold at its peak, for --grad-cache-chunk auto and "
        "--grad-cache-tokens auto: a fraction of the device's free memory when the run starts "
        "(0.8) or a size (20GB, 512MB; 1GB = 1024 MB, as the start line counts); the "
        "step's parts: cached embeddings and their gradients, parameter gradients, optimizer "
        "states, one loss block and one chunk's activations"))
    num_hard_negatives: int = option(0, section="data", help=(
        "hard negatives per query (sampled per epoch when a record has more)"))
    # str | int (not int | str, the chunk sizes' type): read by option_values._steps_or_epoch
    refresh_negatives_every: str | int | None = option(None, section="data", help=(
        "mine each record's --num-hard-negatives hard negatives again every N steps (or "
        "'epoch'), with the current weights, by bigbatch mine's rules (known positives "
        "excluded, likely false negatives dropped: --negatives-max-score-ratio, "
        "--negatives-margin), and train the following steps on them; the first mining is "
        "before step 1, so records need no negatives (a BEIR folder or pairs: one command "
        "instead of bigbatch mine, then bigbatch train) (default: off, the records' own "
        "negatives)"))
    negatives_corpus: str | None = option(None, section="data", help=(
        "with --refresh-negatives-every: a BEIR folder whose corpus.jsonl the negatives are "
        "mined from (default: the training BEIR folder's corpus, or for records files every "
        "document they hold)"))
    negatives_rank_window: str = option("0:100", section="data", help=(
        "with --refresh-negatives-every: START:END ranks (after removing known positives) "
        "negatives are taken from, as bigbatch mine --rank-window"))
    negatives_max_score_ratio: float = option(0.95, section="data", help=(
        "with --refresh-negatives-every: drop candidates scoring above this fraction of the "
        "positive's score (<= 0: off), as bigbatch mine --max-score-ratio"))
    negatives_margin: float | None = option(None, section="data", help=(
        "with --refresh-negatives-every: drop candidates within this margin of the "
        "positive's score, as bigbatch mine --margin (default: off)"))
    lora_r: int = option(32, section="model", help="LoRA rank; 0 means full fine-tuning")
    lora_alpha: int = option(32, section="model", help="LoRA alpha; 0 means full fine-tuning")
    lora_dropout: float = option(0.0, section="model", help="dropout on the LoRA adapter's input")
    lora_target_modules: list[str] | None = option(None, section="model", help=(
        "comma-separated module names (default: per architecture)"))
    merge_lora: bool = option(False, section="model", help=(
        "leave the LoRA adapter out of final/ (final/ always holds the merged weights; "
        "without this flag the adapter is kept in final/adapter/)"))
    pooling: str = option("mean", section="model", choices=POOLINGS, from_model_folder=True,
                          help=("mean, cls, last (one vector per text), or multivector (one "
                                "per token, ColBERT / PyLate for text models, ColQwen for "
                                "Qwen-VL page retrievers: MaxSim loss and retrieval)"))
    multivector_dim: int = option(128, section="model", help=(
        "multivector: width of the token vectors (a linear projection)"))
    query_length: int = option(0, section="model", help=(
        "multivector: pad queries with mask tokens to this many tokens and cut them there "
        "(ColBERT's query augmentation; 0: off)"))
    max_length: int = option(256, section="model", from_model_folder=True, help=(
        "tokens per text at most (in training cut to the model's positions when it has "
        "fewer)"))
    query_max_length: int | None = option(None, section="model", help=(
        "truncation of queries in training steps (default: --max-length); evaluation and the "
        "saved model use --max-length for queries too"))
    query_prefix: str = option("", section="model", from_model_folder=True, help=(
        "text before each query"))
    doc_prefix: str = option("", section="model", from_model_folder=True, help=(
        "text before each document"))
    exclude_instruction_from_pooling: bool = option(False, section="model", help=(
        "leave the query/document prefix's tokens out of mean pooling (GritLM, INSTRUCTOR): "
        "the model attends to the instruction, the embedding averages the text"))
    attn_implementation: str | None = option(None, section="model", choices=ATTN_IMPLEMENTATIONS,
                                             help=(
        "transformers' attention implementation the model is loaded with: sdpa, eager, or "
        "flash_attention_2 (needs the flash-attn package and a GPU) (default: transformers' "
        "choice for the model)"))
    gradient_checkpointing: bool = option(False, section="model", help=(
        "recompute activations in the backward pass (less memory)"))
    encoder: str = option("auto", section="model", choices=ENCODERS, help=(
        "auto (vision-language for Qwen2-VL/2.5-VL/3-VL, else text), text, vision-language"))
    query_instruction: str | None = option(
        None, section="model", from_model_folder=True,
        default_text=f"Qwen3-VL-Embedding's, {QUERY_INSTRUCTION!r}",
        help="vision-language: system instruction of queries")
    doc_instruction: str | None = option(
        None, section="model", from_model_folder=True,
        default_text=f"Qwen3-VL-Embedding's, {DOC_INSTRUCTION!r}",
        help="vision-language: system instruction of documents")
    max_num_visual_tokens: int = option(256, section="model", from_model_folder=True, help=(
        "vision-language: visual tokens per image at most (pixel budget = this x 784 for "
        "Qwen2/2.5-VL, x 1024 for Qwen3-VL)"))
    min_num_visual_tokens: int = option(4, section="model", from_model_folder=True, help=(
        "vision-language: visual tokens per image at least"))
    freeze_vision: bool = option(True, section="model", help=(
        "vision-language: keep the vision tower frozen"))
    mode: str = option("standard", section="model", choices=MODES, help=(
        "standard (both towers train) or query-side-tune (documents by the frozen base "
        "weights)"))
    query_side_backward: str = option("direct", section="engine", choices=QUERY_SIDE_BACKWARDS,
                                      help=("query-side-tune: direct (one backward over the "
                                            "batch's queries) or gradcache (chunked, cached)"))
    doc_negatives: str = option("batch", section="loss", choices=DOC_NEGATIVES, help=(
        "query-side-tune: batch (the batch's documents) or corpus (every document, embedded "
        "once)"))
    max_grad_norm: float = option(1.0, section="optimizer", help=(
        "clip the gradient norm over model and logit scale (0: off)"))
    eval_steps: int = option(0, section="run", help=(
        "evaluate every N steps (0: only at start and end)"))
    eval_batch_size: int = option(64, section="run", help=(
        "texts embedded at once in evaluation"))
    eval_at_start: bool = option(True, section="run", help=(
        "evaluate the model before training (the base row of the result table)"))
    best_metric: str = option("ndcg@10", section="run", help=(
        "metric that selects best/ (e.g. ndcg@10, unseen/ndcg@10)"))
    save_steps: int = option(100, section="run", help=(
        "checkpoint every N steps (0: only at the end)"))
    save_total_limit: int = option(2, section="run", help=(
        "keep this many newest checkpoints (plus best/)"))
    merge_last: int = option(0, section="run", help=(
        "at the end of the run, average its last K checkpoints (the final one among them) "
        "into <output-dir>/merged/, evaluated beside final/ and best/ when there is "
        "evaluation data; needs --save-steps and --save-total-limit >= K (0: off)"))
    resume: str | None = option(None, section="run", help=(
        "checkpoint directory (or output directory: its newest intact checkpoint) to resume, "
        "or auto: --output-dir's run, continued when it has a checkpoint (for jobs restarted "
        "as they started: torchrun --max-restarts, a requeued job) (default: none, a new run)"))
    strict: bool = option(False, section="run", help=(
        "stop the run at a step that cannot teach (loss and gradient 0, overflowing logits) "
        "instead of warning once"))
    overwrite: bool = option(False, section="run", help=(
        "start a new run in an --output-dir that holds another run or other files: move what "
        "it holds into <output-dir>/previous-<timestamp>/ first (nothing is deleted)"))
    seed: int = option(42, section="run", help=(
        "seed of the data order, initialisation and dropout"))
    dtype: str = option("float32", section="engine", choices=DTYPES, help=(
        "autocast dtype for the encoder: float32, bfloat16 or float16"))
    device: str | None = option(None, section="run", help=(
        "cpu, cuda, cuda:1 ... (default: cuda:LOCAL_RANK when available, else cpu)"))
    log_steps: int = option(1, section="run", help=(
        "write metrics.jsonl / TensorBoard every N steps"))
    dist_timeout: float = option(1800.0, section="engine", help=(
        "seconds before a stuck collective fails (torchrun)"))
    data_root: str | None = option(None, section="data", help=(
        "refuse files named by the data (chunk_path, image paths) that resolve outside this "
        "folder (default: any file you can read)"))
    guide_model: str | None = option(None, section="loss", help=(
        "guided false-negative filtering (GISTEmbed): a frozen guide model folder, or 'self' "
        "for the model's own starting weights; it embeds each batch once and a negative it "
        "scores above the positive is left out of the loss (default: none)"))
    guide_margin: float = option(0.0, section="loss", help=(
        "with --guide-model: mask a negative whose guide similarity exceeds the positive's "
        "minus this (absolute) or times 1 - this (relative); larger masks more"))
    # choices: bigbatch.losses.guided.MARGIN_TYPES (checked by validate)
    guide_margin_type: str = option("absolute", section="loss", help=(
        "with --guide-model: absolute or relative"))
    # choices: bigbatch.losses.distill.OBJECTIVES (checked by validate)
    distill: str | None = option(None, section="loss", help=(
        "add a distillation term against the records' teacher scores (pos_score, neg_scores): "
        "kl (student vs teacher softmax over the positive and its hard negatives) or "
        "margin-mse (default: none)"))
    distill_weight: float = option(1.0, section="loss", help=(
        "with --distill: loss = InfoNCE + this x distillation"))
    teacher_temperature: float | None = option(None, section="loss", help=(
        "with --distill kl: temperature of the teacher softmax (default: --temperature, right "
        "for a bi-encoder's cosine scores; use 1 for cross-encoder logits)"))
    deepspeed: str | None = option(None, section="engine", help=(
        "a DeepSpeed JSON configuration: train under ZeRO stage 1, 2 or 3, the chunks' "
        "gradients reduced once per step (no optimizer, scheduler, fp16 or bf16 section: "
        "bigbatch sets them; see docs/guides/deepspeed-and-reporting.md) (default: none, "
        "plain torch)"))
    fsdp: bool = option(False, section="engine", help=(
        "shard the model's weights, gradients and optimizer states over the torchrun "
        "processes (FSDP2: each transformer block and the model one unit, one "
        "reduce-scatter per step); checkpoints are written sharded by every process, final/ "
        "and best/ whole (see docs/guides/distributed.md)"))
    fsdp_cpu_offload: bool = option(False, section="engine", help=(
        "with --fsdp: keep the shards, their gradients and the optimizer states in host "
        "memory (the optimizer steps on the CPU; slower, for models whose states do not fit "
        "the GPUs)"))
    report_to: list[str] = option(section="run", factory=lambda: ["tensorboard"], help=(
        "where metrics go besides metrics.jsonl: comma-separated tensorboard, wandb (offline "
        "with WANDB_MODE=offline), or none (default: tensorboard, when the tensorboard "
        "package is installed)"))
    push_to_hub: str | None = option(None, section="run", help=(
        "upload final/ (with its model card README.md) to this Hugging Face Hub repository "
        "(namespace/name) at the end of the run (default: none)"))

    def validate(self) -> "TrainConfig":
        """Raise :class:`ConfigError` naming the option for any impossible value; returns the
        config, marked valid (:meth:`checked`)."""
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
        for name in ("batch_size", "max_length", "eval_batch_size", "log_steps"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be > 0")
        self._validate_sizes(bad)
        for name in ("warmup_steps", "eval_steps", "save_steps", "num_hard_negatives",
                     "lora_r", "lora_alpha"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        if self.save_total_limit < 1:  # 0 used to keep every checkpoint, silently
            raise bad("save_total_limit", "must be >= 1: the newest checkpoints kept (a run "
                                          "resumes from one); to keep every one, give at least "
                                          "the run's number of checkpoints")
        from .merge import check_merge_last  # (the epochs' steps: checked by the Trainer)
        check_merge_last(self.merge_last, self.save_steps, self.save_total_limit,
                         0 if self.epochs else self.max_steps)
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
        for f in dataclasses.fields(self):  # each option with choices (option(choices=...))
            choices, value = f.metadata["choices"], getattr(self, f.name)
            if choices is not None and value not in choices and \
                    (value is not None or f.default is not None):  # None: left out
                raise bad(f.name, one_of(choices))
        self._validate_multivector(bad)
        self._validate_objectives(bad)
        self._validate_guide_and_distill(bad)
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
        self._validate_refresh(bad)
        self._validate_reporting(bad)
        if self.deepspeed:
            self._validate_deepspeed(bad)
        self._validate_fsdp(bad)
        if self.deepspeed and self.auto_sizes:  # (after what --deepspeed cannot run with)
            raise ConfigError("--deepspeed: auto chunk sizes come from a probe of the model, "
                              "which DeepSpeed's engine holds; give --grad-cache-chunk N (and "
                              "a number for --query-grad-cache-chunk and --grad-cache-tokens)")
        key = id(self)  # remembered by identity: the config never changes
        _VALID[key] = weakref.ref(self, lambda _: _VALID.pop(key, None))
        return self

    def _validate_sizes(self, bad: Any) -> None:
        """The chunk sizes (a positive integer or auto), the token budget (unset, a positive
        integer or auto) and the memory budget (a fraction in (0, 1] or at least 1 MB)."""
        for name, what in (("grad_cache_chunk", "rows per chunk"),
                           ("query_grad_cache_chunk", "rows per chunk"),
                           ("grad_cache_tokens", "padded tokens per chunk")):
            value = getattr(self, name)
            if value is None and name != "grad_cache_chunk":
                continue
            if value != AUTO and not (isinstance(value, int) and not isinstance(value, bool)
                                      and value > 0):
                raise bad(name, f"must be > 0 ({what}) or {AUTO}")
        budget = self.memory_budget
        if isinstance(budget, bool) or not (
                (isinstance(budget, float) and 0 < budget <= 1)
                or (isinstance(budget, int) and budget >= MIN_MEMORY_BUDGET)):
            raise bad("memory_budget", "must be a fraction of the free memory in (0, 1] "
                                       "(0.8) or a size of 1 MB or more (20GB)")

    @property
    def auto_sizes(self) -> bool:
        """Whether a chunk size or the token budget is ``auto`` (sized for
        ``--memory-budget``)."""
        return AUTO in (self.grad_cache_chunk, self.query_grad_cache_chunk,
                        self.grad_cache_tokens)

    def checked(self) -> "TrainConfig":
        """The config, validated unless it already was: :func:`load_config` validates, and
        :func:`~bigbatch.train.train` then takes it as it is (validation, which reads the
        model folder, the data sources and the DeepSpeed file, runs once per run)."""
        valid = _VALID.get(id(self))
        return self if valid is not None and valid() is self else self.validate()

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

    def _validate_refresh(self, bad: Any) -> None:
        """``--refresh-negatives-every`` (a number of steps or ``epoch``) and the mining
        options that go with it: one training source, single-vector InfoNCE over the
        batch's documents, hard negatives to mine."""
        every = self.refresh_negatives_every
        if every is None:
            for name in ("negatives_corpus",):
                if getattr(self, name) is not None:
                    raise bad(name, "applies with --refresh-negatives-every (give it too)")
            return
        if not (every == "epoch" or (isinstance(every, int) and not isinstance(every, bool)
                                     and every > 0)):
            raise bad("refresh_negatives_every", "must be a number of steps > 0 or 'epoch'")
        if self.num_hard_negatives < 1:
            raise bad("num_hard_negatives", "--refresh-negatives-every mines this many "
                                            "negatives per record: give 1 or more")
        if len(self.train_sources()) > 1:
            raise bad("refresh_negatives_every", "mines the negatives of one --train-data "
                                                 "source; give one")
        for name, wrong in (("doc_negatives", self.doc_negatives == "corpus"),
                            ("distill", self.distill is not None)):
            if wrong:
                raise bad(name, "cannot be combined with --refresh-negatives-every (mining "
                                "needs hard negatives over the batch's documents, and no "
                                "teacher scores of fixed negatives)")
        if self.negatives_corpus is not None and \
                not (Path(self.negatives_corpus) / "corpus.jsonl").is_file():
            raise bad("negatives_corpus", "must be a BEIR folder holding corpus.jsonl")
        self.negatives_mining()  # the rank window, the ratio and the margin

    def negatives_mining(self) -> Any:
        """The :class:`~bigbatch.retrieval.mining.MiningOptions` of the run's refreshes of
        hard negatives, checked (errors name ``bigbatch train``'s flags).

        Raises:
            ConfigError: a rank window that is not START:END, or holds too few candidates;
                a bad ratio.
        """
        from ..retrieval.mining import MiningOptions

        try:
            start, end = (int(x) for x in str(self.negatives_rank_window).split(":"))
        except ValueError as e:
            raise ConfigError(f"--negatives-rank-window must be START:END (two integers, e.g. "
                              f"0:100), got {shown(self.negatives_rank_window)}") from e
        ratio = self.negatives_max_score_ratio
        opts = MiningOptions(num_negatives=self.num_hard_negatives, rank_start=start,
                             rank_end=end, max_score_ratio=ratio if ratio > 0 else None,
                             margin=self.negatives_margin, batch_size=self.eval_batch_size)
        try:
            return opts.validate()
        except ConfigError as e:
            text = str(e)
            for mine_flag, train_flag in _MINE_FLAGS:
                text = text.replace(mine_flag, train_flag)
            raise ConfigError(text) from None

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

    def _validate_fsdp(self, bad: Any) -> None:
        """``--fsdp``: not with ``--deepspeed`` (both shard the model), in float32 or
        bfloat16 (float16 needs a loss scaler over sharded gradients); the launch itself
        (torchrun) is checked when the run starts (:mod:`bigbatch.train.sharding`)."""
        if self.fsdp_cpu_offload and not self.fsdp:
            raise bad("fsdp_cpu_offload", "offloads the shards of --fsdp; give --fsdp too")
        if not self.fsdp:
            return
        if self.deepspeed:
            raise bad("fsdp", "--fsdp and --deepspeed both shard the model; choose one "
                              "(--fsdp: torch FSDP2; --deepspeed: a ZeRO configuration)")
        if self.dtype not in FSDP_DTYPES:
            raise bad("dtype", f"--fsdp runs {' or '.join(FSDP_DTYPES)} (float16 needs a loss "
                               f"scaler over sharded gradients); use --dtype bfloat16")

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
        self._validate_queue(bad)

    def _validate_queue(self, bad: Any) -> None:
        """``--negative-queue``: one vector per text, the batch's own documents, and no
        objective that the queued documents have no inputs for (qq/dd, a guide)."""
        if isinstance(self.negative_queue, bool) or self.negative_queue < 0:
            raise bad("negative_queue", "must be >= 0 (steps of documents kept; 0: off)")
        if not self.negative_queue:
            return
        if self.pooling == "multivector":
            raise bad("negative_queue", "keeps one vector per document; not with --pooling "
                                        "multivector (late interaction)")
        if self.doc_negatives == "corpus":
            raise bad("negative_queue", "queues the batch's documents; --doc-negatives corpus "
                                        "already scores every document")
        for name, what in (("extra_negatives", "--extra-negatives (qq/dd)"),
                           ("guide_model", "--guide-model (the queue keeps no guide "
                                           "embeddings)")):
            if getattr(self, name):
                raise bad("negative_queue", f"cannot be combined with {what} yet; use one of "
                                            f"them")

    @property
    def full_finetune(self) -> bool:
        """``--lora-alpha 0`` or ``--lora-r 0`` means full fine-tuning."""
        return self.lora_r == 0 or self.lora_alpha == 0

    def to_dict(self) -> dict[str, Any]:
        """The options (``overwrite``, an action of one start, is not a setting kept with a
        run: a ``config.yaml`` reused as ``--config`` never moves a folder aside by itself)."""
        d = dataclasses.asdict(self)
        d.pop("overwrite")
        return d

    def write(self, path: str | Path) -> None:
        import yaml

        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


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


def one_of(choices: tuple[str, ...]) -> str:
    """What :meth:`TrainConfig.validate` says of a value outside ``choices``."""
    if len(choices) == 2:
        return f"must be {choices[0]!r} or {choices[1]!r}"
    return f"must be one of {choices}"


def _field_types() -> dict[str, tuple[tuple[Any, ...], bool]]:
    """Each option's type without None, and whether None (YAML's empty value) is allowed."""
    out = {}
    for name, hint in typing.get_type_hints(TrainConfig).items():
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        out[name] = tuple(a for a in args if a is not type(None)), type(None) in args
    return out


_TYPES = _field_types()


def option_type(name: str) -> tuple[Any, ...]:
    """The option's type without None: ``(int,)``, ``(list[str],)``, ``(str, list)``, ..."""
    return _TYPES[name][0]


def parse_value(name: str, value: Any, what: str) -> Any:
    """The value of the option ``name`` as its field's type has it, from a YAML value or a
    flag's text: numbers from text (ints accepted for floats), lists from comma-separated
    text, booleans only as such. The one reader of both, so a flag and a YAML key give the
    same value and the same error.

    Args:
        name: the field (``batch_size``).
        value: the YAML value, or the flag's text.
        what: how errors name it (``c.yaml:3: batch_size``, ``--batch-size``).

    Raises:
        ConfigError: ``<what> must be an integer, got 'x'`` (and so on for each type).
    """
    return parse_typed(*_TYPES[name], value, what)


def _check_keys(keys: Any, source: str) -> None:
    for key in keys:
        if key not in _FIELDS:
            close = difflib.get_close_matches(key, list(_FIELDS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{source}: unknown option {shown(key)}{hint}")


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the YAML file ``path`` (keys spelled with ``_`` or ``-``), then
    ``overrides`` (the flags given on the command line). Returns a validated config."""
    values: dict[str, Any] = {}
    config_file = None
    if path is not None:
        from ..data.readers.yaml_file import load_yaml

        p = Path(path)
        if not p.exists():
            raise ConfigError(f"--config: file not found: {p}")
        loaded = load_yaml(p, "YAML configuration") or {}  # aliases bounded, plain values only
        config_file = str(p.absolute())  # an input --overwrite keeps
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: expected a mapping of option: value")
        lines = key_lines(p.read_text(), str(p))
        loaded = {str(k).replace("-", "_"): (v, f"{p}:{lines[k]}" if k in lines else str(p))
                  for k, v in loaded.items()}
        for k, (v, where) in loaded.items():
            _check_keys([k], where)
        values.update({k: parse_value(k, v, f"{where}: {k}") for k, (v, where) in loaded.items()})
        values.update({k: resolve_path(k, values[k], p.parent) for k in PATH_KEYS
                       if k in values})  # read from the YAML file's folder
    values.setdefault("output_dir", TrainConfig.output_dir)
    given = set()
    for k, v in (overrides or {}).items():
        k = k.replace("-", "_")
        _check_keys([k], "command line")
        values[k] = resolve_path(k, v, Path.cwd()) if k in PATH_KEYS else v
        given.add(k)
    # the step budget follows the same precedence: --max-steps on the command line wins
    # over a file's epochs (which otherwise overrides any max_steps); --epochs always wins
    if "max_steps" in given and "epochs" not in given:
        values["epochs"] = None
    if values["output_dir"] == TrainConfig.output_dir:  # the default: the working directory's
        values["output_dir"] = resolve_path("output_dir", values["output_dir"], Path.cwd())
    values = model_defaults(values, TrainConfig.max_length)
    config = TrainConfig(**values).validate()
    if config_file is not None:
        key = id(config)  # remembered by identity, as validation is: the config never changes
        _CONFIG_FILES[key] = (weakref.ref(config, lambda _: _CONFIG_FILES.pop(key, None)),
                              config_file)
    return config


def config_file_of(config: TrainConfig) -> str | None:
    """The YAML file :func:`load_config` read ``config`` from (an input of the run, which
    ``--overwrite`` never moves), or None."""
    ref, path = _CONFIG_FILES.get(id(config), (None, None))
    return path if ref is not None and ref() is config else None


