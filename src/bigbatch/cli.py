"""The ``bigbatch`` command line: ``train``, ``eval`` (and the data tools).

Every option of :class:`bigbatch.train.TrainConfig` is a flag spelled with dashes
(``--grad-cache-chunk``); ``--config file.yaml`` supplies values that flags override.
Errors a user can cause print one clear line (file, line, field or option) and exit 2;
Ctrl-C prints where the work stopped (for ``train``: how to continue) and exits 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .data.formats import (
    FORMATS,
    READ_ONLY_FORMATS,
    SWIFT_DOC_INSTRUCTION,
    SWIFT_QUERY_INSTRUCTION,
    Problem,
    Record,
)
from .encoders.vision import DOC_INSTRUCTION, QUERY_INSTRUCTION
from .errors import BigBatchError, ConfigError
from .retrieval.report import format_eval_table, print_summary

__all__ = ["main", "build_parser"]

_HELP = {
    "model": "required: transformers model path or name (e.g. the all-MiniLM-L6-v2 folder)",
    "train_data": "required: JSONL records (query, positive|chunk_path, negatives|neg_chunk_paths), a "
                  "swift or st (JSONL or .parquet) file (detected), or a BEIR directory; "
                  "several sources: repeat the flag or give a comma list (every batch is "
                  "drawn from one source; in YAML a list whose entries may set name, weight, "
                  "query_instruction/doc_instruction or prefixes, num_hard_negatives, "
                  "in_batch_negatives, max_records: see docs/guides/multi-dataset.md)",
    "mix_temperature": "several --train-data sources without weights: draw each step's "
                       "source with probability proportional to size ** (1 / this); 1: by "
                       "size, larger: closer to uniform (small sources up-sampled)",
    "exclude_instruction_from_pooling": "leave the query/document prefix's tokens out of mean "
                                        "pooling (GritLM, INSTRUCTOR): the model attends to "
                                        "the instruction, the embedding averages the text",
    "train_split": "qrels split used as training pairs when --train-data is a BEIR directory",
    "eval_data": "BEIR directory evaluated with full-corpus retrieval; several: repeat the "
                 "flag or give a comma list (each reported as <name>/<metric>, their mean "
                 "selects best/; each embedded with the prompts of the training source of "
                 "the same name) (default: none, no evaluation)",
    "eval_split": "qrels split to evaluate on",
    "output_dir": "where checkpoints, best/, final/, metrics.jsonl and the plot go: a new or "
                  "empty folder (a folder holding another run or other files is refused: "
                  "see --resume and --overwrite)",
    "batch_size": "queries per process per step (global batch = this x processes)",
    "grad_cache_chunk": "rows embedded at once (memory = this x per-example cost)",
    "lr": "peak learning rate (AdamW)",
    "logit_scale_lr": "learning rate of the temperature (default: --lr)",
    "scheduler": "cosine or constant, after linear warmup",
    "max_steps": "optimizer steps (ignored when --epochs is given)",
    "epochs": "train this many epochs instead of --max-steps (default: none, --max-steps "
              "decides)",
    "temperature": "initial temperature (learnable unless --fixed-temperature)",
    "num_hard_negatives": "hard negatives per query (sampled per epoch when a record has more)",
    "query_prefix": "text before each query (default: what a sentence-transformers model "
                    "folder says, else none)",
    "doc_prefix": "text before each document (default: what a sentence-transformers model "
                  "folder says, else none)",
    "weight_decay": "AdamW weight decay of the model's parameters (not the temperature's)",
    "warmup_steps": "steps of linear warmup from 0 to --lr",
    "fixed_temperature": "keep the temperature fixed instead of learning it",
    "symmetric": "add the document-to-query direction to the loss",
    "loss_block_size": "query rows per block of the streamed loss (default: automatic, at most "
                       "2**22 logits a block, so the batch x documents logits never exist at "
                       "once; 0: the dense loss, all logits at once)",
    "matryoshka_dims": "Matryoshka: train every one of these embedding widths, largest first "
                       "(e.g. 384,256,128,64: each a prefix of the embedding, normalised "
                       "again; one replay for all); final/ records them, and "
                       "SentenceTransformer(path, truncate_dim=128) uses one (default: off)",
    "matryoshka_weights": "Matryoshka: one weight per width of --matryoshka-dims (default: "
                          "all 1)",
    "extra_negatives": "qq, dd or qq,dd: add the other queries (qq) and the positive's "
                       "similarities to the other documents (dd) to each query's softmax "
                       "denominator, as Qwen3-Embedding trains (default: none)",
    "grad_cache_tokens": "padded tokens per GradCache chunk at most: a chunk holds as many "
                         "texts as fit (longest first), so mixed short and long texts keep "
                         "one chunk's memory bounded; --grad-cache-chunk still caps the rows "
                         "(default: off, rows only)",
    "lora_dropout": "dropout on the LoRA adapter's input",
    "max_length": "tokens per text at most (cut to the model's positions when it has fewer)",
    "gradient_checkpointing": "recompute activations in the backward pass (less memory)",
    "eval_batch_size": "texts embedded at once in evaluation",
    "eval_at_start": "evaluate the model before training (the base row of the result table)",
    "seed": "seed of the data order, initialisation and dropout",
    "log_steps": "write metrics.jsonl / TensorBoard every N steps",
    "lora_r": "LoRA rank; 0 means full fine-tuning",
    "lora_alpha": "LoRA alpha; 0 means full fine-tuning",
    "lora_target_modules": "comma-separated module names (default: per architecture)",
    "merge_lora": "merge the LoRA adapter into the base weights in final/",
    "max_grad_norm": "clip the gradient norm over model and logit scale (0: off)",
    "eval_steps": "evaluate every N steps (0: only at start and end)",
    "save_steps": "checkpoint every N steps (0: only at the end)",
    "save_total_limit": "keep this many newest checkpoints (plus best/)",
    "best_metric": "metric that selects best/ (e.g. ndcg@10, unseen/ndcg@10)",
    "resume": "checkpoint directory (or output directory: its newest intact checkpoint) to "
              "resume, or auto: --output-dir's run, continued when it has a checkpoint (for "
              "jobs restarted as they started: torchrun --max-restarts, a requeued job) "
              "(default: none, a new run)",
    "strict": "stop the run at a step that cannot teach (loss and gradient 0, overflowing "
              "logits) instead of warning once",
    "overwrite": "start a new run in an --output-dir that holds another run or other files: "
                 "move what it holds into <output-dir>/previous-<timestamp>/ first (nothing "
                 "is deleted)",
    "dtype": "autocast dtype for the encoder: float32, bfloat16 or float16",
    "device": "cpu, cuda, cuda:1 ... (default: cuda:LOCAL_RANK when available, else cpu)",
    "dist_timeout": "seconds before a stuck collective fails (torchrun)",
    "query_max_length": "truncation of queries in training steps (default: --max-length); "
                        "evaluation and the saved model use --max-length for queries too",
    "query_grad_cache_chunk": "rows per GradCache chunk for the query tower (default: "
                              "--grad-cache-chunk); text queries are cheaper than page images",
    "encoder": "auto (vision-language for Qwen2-VL/2.5-VL/3-VL, else text), text, "
               "vision-language",
    "query_instruction": f"vision-language: system instruction of queries (default: "
                         f"Qwen3-VL-Embedding's, {QUERY_INSTRUCTION!r})",
    "doc_instruction": f"vision-language: system instruction of documents (default: "
                       f"Qwen3-VL-Embedding's, {DOC_INSTRUCTION!r})",
    "max_num_visual_tokens": "vision-language: visual tokens per image at most (pixel budget = "
                             "this x 784 for Qwen2/2.5-VL, x 1024 for Qwen3-VL)",
    "min_num_visual_tokens": "vision-language: visual tokens per image at least",
    "freeze_vision": "vision-language: keep the vision tower frozen",
    "mode": "standard (both towers train) or query-side-tune (documents by the frozen base "
            "weights)",
    "query_side_backward": "query-side-tune: direct (one backward over the batch's queries) or "
                           "gradcache (chunked, cached)",
    "doc_negatives": "query-side-tune: batch (the batch's documents) or corpus (every document, "
                     "embedded once)",
    "data_root": "refuse files named by the data (chunk_path, image paths) that resolve "
                 "outside this folder (default: any file you can read)",
    "pooling": "mean, cls, last (one vector per text), or multivector (one per token, "
               "ColBERT / PyLate for text models, ColQwen for Qwen-VL page retrievers: "
               "MaxSim loss and retrieval)",
    "multivector_dim": "multivector: width of the token vectors (a linear projection)",
    "deepspeed": "a DeepSpeed JSON configuration: train under ZeRO stage 1 or 2, the chunks' "
                 "gradients reduced once per step (no optimizer, scheduler, fp16 or bf16 "
                 "section: bigbatch sets them; see docs/guides/deepspeed-and-reporting.md) "
                 "(default: none, plain torch)",
    "report_to": "where metrics go besides metrics.jsonl: comma-separated tensorboard, wandb "
                 "(offline with WANDB_MODE=offline), or none (default: tensorboard, when the "
                 "tensorboard package is installed)",
    "push_to_hub": "upload final/ (with its model card README.md) to this Hugging Face Hub "
                   "repository (namespace/name) at the end of the run (default: none)",
    "query_length": "multivector: pad queries with mask tokens to this many tokens and cut "
                    "them there (ColBERT's query augmentation; 0: off)",
    "guide_model": "guided false-negative filtering (GISTEmbed): a frozen guide model folder, "
                   "or 'self' for the model's own starting weights; it embeds each batch once "
                   "and a negative it scores above the positive is left out of the loss "
                   "(default: none)",
    "guide_margin": "with --guide-model: mask a negative whose guide similarity exceeds the "
                    "positive's minus this (absolute) or times 1 - this (relative); larger "
                    "masks more",
    "guide_margin_type": "with --guide-model: absolute or relative",
    "distill": "add a distillation term against the records' teacher scores (pos_score, "
               "neg_scores): kl (student vs teacher softmax over the positive and its hard "
               "negatives) or margin-mse (default: none)",
    "distill_weight": "with --distill: loss = InfoNCE + this x distillation",
    "teacher_temperature": "with --distill kl: temperature of the teacher softmax (default: "
                           "--temperature, right for a bi-encoder's cosine scores; use 1 for "
                           "cross-encoder logits)",
}


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    from .train.config import TrainConfig

    p.add_argument("--config", default=None, help="YAML file of options; flags override it; "
                   "relative paths in it are read from the YAML file's folder (on the command "
                   "line, from the working directory)")
    for f in dataclasses.fields(TrainConfig):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        help_ = _HELP.get(f.name, "")
        typ = str(f.type)
        if f.name in ("train_data", "eval_data"):  # repeatable, each a path or a comma list
            p.add_argument(flag, action="extend", default=argparse.SUPPRESS, help=help_,
                           type=lambda s: [v.strip() for v in s.split(",") if v.strip()])
        elif typ == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=f"{help_} (default {'on' if f.default else 'off'})".strip())
        elif "list[int]" in typ or "list[float]" in typ:
            p.add_argument(flag, type=_number_list(int if "list[int]" in typ else float, flag),
                           default=argparse.SUPPRESS, help=help_)
        elif "list" in typ:
            p.add_argument(flag, type=lambda s: [v.strip() for v in s.split(",") if v.strip()],
                           default=argparse.SUPPRESS, help=help_)
        else:
            conv = int if typ.startswith("int") else float if typ.startswith("float") else str
            default = f.default if f.default is not dataclasses.MISSING else None
            # a help that states its default, or a required option, gets no "(default ...)"
            if "(default:" not in help_ and not help_.startswith("required"):
                help_ = f"{help_} (default {default})" if help_ else f"(default {default})"
            p.add_argument(flag, type=conv, default=argparse.SUPPRESS, help=help_)


def _number_list(kind: type, flag: str) -> Any:
    """An argparse type: a comma-separated list of ``kind`` (int or float)."""
    from .train.config import number_list

    def parse(text: str) -> list:
        try:
            return number_list(text, kind, flag)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{flag}: ")) from None

    return parse


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends each option with its default, unless the help states it itself
    ("default: ..."), the option is required, or it has none (None); a flag says "off"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_ = action.help or ""
        if not action.option_strings or "default" in help_ or action.required \
                or action.default in (None, argparse.SUPPRESS):
            return help_
        if action.default is False and action.nargs == 0:
            return f"{help_} (default: off)"
        return f"{help_} (default: %(default)s)"


def _add_encoder_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--query-prefix", default=None, help="instruction before each query "
                   "(default: what the model folder says, else none)")
    p.add_argument("--doc-prefix", default=None, help="text before each document (default: "
                   "what the model folder says, else none)")
    p.add_argument("--pooling", choices=("mean", "cls", "last"), default=None,
                   help="how token embeddings become one (default: what the model folder "
                   "says, else mean)")
    p.add_argument("--max-length", type=int, default=None, help="tokens per text at most "
                   "(default: what the model folder says, else 256)")
    p.add_argument("--query-instruction", default=None, help="vision-language models: system "
                   "instruction of queries (default: what the model folder says)")
    p.add_argument("--doc-instruction", default=None, help="vision-language models: system "
                   "instruction of documents (default: what the model folder says)")
    p.add_argument("--max-num-visual-tokens", type=int, default=None, help="vision-language "
                   "models: visual tokens per page at most (default: the folder's, else 256)")
    p.add_argument("--min-num-visual-tokens", type=int, default=None, help="vision-language "
                   "models: visual tokens per page at least (default: the folder's, else 4)")
    p.add_argument("--batch-size", type=int, default=64, help="texts embedded at once")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if "
                   "present, else cpu)")
    p.add_argument("--cache-dir", default=None, help="corpus embedding cache (default: "
                   "$BIGBATCH_CACHE or ~/.cache/bigbatch)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the cache")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bigbatch", description="Exact GradCache training "
                                     "of embedding models at batch sizes beyond memory.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train_flags(sub.add_parser("train", help="fine-tune a bi-encoder with GradCache",
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    va = sub.add_parser("validate", help="check training files; report every problem")
    va.add_argument("files", nargs="+", help="JSONL/Parquet/CSV files, datasets folders "
                    "(save_to_disk) or BEIR directories")
    va.add_argument("--format", choices=FORMATS + READ_ONLY_FORMATS, default=None,
                    help="default: detected")
    va.add_argument("--split", default="train", help="qrels split of BEIR directories, split "
                    "of a datasets DatasetDict folder")
    va.add_argument("--data-root", default=None, help=_HELP["data_root"])

    co = sub.add_parser("convert", help="convert between contrastors, ms-swift, "
                        "sentence-transformers and BEIR formats; read colpali-engine / "
                        "ViDoRe Parquet or datasets folders (page images written to files)",
                        formatter_class=_DefaultsFormatter)
    co.add_argument("--from", dest="src_format", choices=FORMATS + READ_ONLY_FORMATS,
                    default=None, help="the input's format (default: detected from its "
                    "name and first record)")
    co.add_argument("--to", dest="dst_format", choices=FORMATS, default=None,
                    help="required, except from colpali (default there: contrastors, page "
                    "images as chunk_path / neg_chunk_paths)")
    co.add_argument("input", help="a training file (.jsonl, .parquet, .csv), a BEIR "
                    "directory, or a datasets save_to_disk folder")
    co.add_argument("output", help="a .jsonl/.parquet/.csv file, or a directory for beir")
    co.add_argument("--split", default="train", help="qrels split read or written for BEIR; "
                    "split of a datasets DatasetDict folder")
    co.add_argument("--allow-lossy", action="store_true", help="drop (and report) what the "
                    "target format cannot hold instead of stopping")
    co.add_argument("--query-instruction", default=SWIFT_QUERY_INSTRUCTION,
                    help="system message of swift queries")
    co.add_argument("--doc-instruction", default=SWIFT_DOC_INSTRUCTION,
                    help="system message of swift documents")
    co.add_argument("--data-root", default=None, help=_HELP["data_root"])

    mi = sub.add_parser("mine", help="mine hard negatives with faiss, filtering false negatives",
                        formatter_class=_DefaultsFormatter)
    mi.add_argument("--model", required=True, help="model folder (base, final/, checkpoint)")
    mi.add_argument("--data", required=True, help="BEIR directory (corpus, queries, qrels)")
    mi.add_argument("--split", default="train", help="qrels split whose (query, positive) "
                    "pairs get negatives")
    mi.add_argument("--output", required=True, help="JSONL of records with negatives (and "
                    "OUTPUT.report.json); written only when records were found")
    mi.add_argument("--num-negatives", type=int, default=8, help="negatives per record")
    mi.add_argument("--rank-window", default="0:100", help="START:END ranks (after removing "
                    "known positives) that negatives are taken from")
    mi.add_argument("--max-score-ratio", type=float, default=0.95, help="drop candidates "
                    "scoring above this fraction of the positive's score (<= 0: off)")
    mi.add_argument("--margin", type=float, default=None, help="drop candidates within this "
                    "margin of the positive's score (default: off)")
    mi.add_argument("--min-negatives", type=int, default=None, help="write a (query, positive) "
                    "only with at least this many negatives (default: --num-negatives)")
    mi.add_argument("--index", choices=("flat", "hnsw"), default="flat",
                    help="flat: exact inner product; hnsw: approximate, for large corpora")
    mi.add_argument("--scores", action="store_true", help="also write the mining model's cosine "
                    "similarities of each query with its positive and negatives (pos_score, "
                    "neg_scores): teacher scores for `bigbatch train --distill`")
    _add_encoder_flags(mi)

    ev = sub.add_parser("eval", help="full-corpus retrieval metrics of one or more models",
                        formatter_class=_DefaultsFormatter)
    ev.add_argument("--model", action="append", required=True,
                    help="model folder (base, final/, checkpoint); repeat to compare")
    ev.add_argument("--data", required=True, help="BEIR directory")
    ev.add_argument("--split", default="test", help="qrels split to evaluate on")
    ev.add_argument("--unseen-from", default=None, help="also report queries whose "
                    "relevant documents are not in this split's qrels ('' to skip; default: "
                    "train, when the data has qrels/train.tsv)")
    ev.add_argument("--output", default=None, help="write the results as JSON here "
                    "(default: printed only)")
    ev.add_argument("--dims", type=_number_list(int, "--dims"), default=None,
                    help="Matryoshka widths, e.g. 384,128: one row per width, each from the "
                    "embeddings' first dims coordinates normalised again (the corpus is "
                    "embedded once; default: the full embeddings only)")
    ev.add_argument("--task", default=None, help="embed with the prompts a bigbatch model "
                    "saved for this task (a training source's name; see "
                    "docs/guides/multi-dataset.md) (default: the task named as the --data "
                    "folder, when the model has one, else the model's own prompts)")
    _add_encoder_flags(ev)

    mp = sub.add_parser("make-pairs", help="training pairs from a corpus alone: one field of "
                        "each document as the query, another as the positive (title -> "
                        "abstract)", formatter_class=_DefaultsFormatter)
    mp.add_argument("corpus", help="a JSONL corpus (BEIR corpus.jsonl) or a BEIR directory")
    mp.add_argument("output", help="the training file to write (.jsonl, .parquet)")
    mp.add_argument("--query-field", default="title", help="the field that becomes the query")
    mp.add_argument("--doc-field", default="text", help="the field that becomes the positive")
    mp.add_argument("--id-field", default="_id", help="the field kept as the positive's id")
    mp.add_argument("--max-pairs", type=int, default=None, help="write the first this many "
                    "pairs (default: all)")
    mp.add_argument("--to", dest="dst_format", choices=FORMATS, default="contrastors",
                    help="the output's format")

    rp = sub.add_parser("render-pages", help="render a BEIR corpus to page images (a visual "
                        "document retrieval set: text queries, image documents)",
                        formatter_class=_DefaultsFormatter)
    rp.add_argument("source", help="BEIR directory (e.g. ../shared/data/scifact)")
    rp.add_argument("output", help="directory to write (BEIR layout + images/ + train.jsonl)")
    rp.add_argument("--max-docs", type=int, default=None, help="corpus size: every relevant "
                    "document, then others up to this many (default: all)")
    rp.add_argument("--splits", default="train,test", help="qrels splits to keep")
    rp.add_argument("--num-negatives", type=int, default=0, help="random negative pages per "
                    "train.jsonl record")
    rp.add_argument("--size", default="448x448", help="page WIDTHxHEIGHT in pixels")
    rp.add_argument("--font-size", type=int, default=13, help="text size in pixels")
    rp.add_argument("--font", default=None, help="a .ttf file (default: DejaVu Sans or "
                    "Pillow's built-in font)")
    rp.add_argument("--seed", type=int, default=0, help="seed of the random negative pages")
    return parser


def _check_positive(args: argparse.Namespace, names: Sequence[str], at_least: int = 1) -> None:
    """Refuse a numeric option below ``at_least`` (None: not given, fine).

    Raises:
        ConfigError: naming the option and the value.
    """
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < at_least:
            raise ConfigError(f"--{name.replace('_', '-')}: must be "
                              f"{'> 0' if at_least == 1 else f'>= {at_least}'} (got {value})")


def _check_encoder_args(args: argparse.Namespace) -> str:
    """The encoder options of ``eval`` / ``mine`` checked before any model loads; returns the
    device to use.

    Raises:
        ConfigError: a size that is not positive, a device this machine does not have.
    """
    from .train.config import device_problem

    _check_positive(args, ("batch_size", "max_length", "max_num_visual_tokens",
                           "min_num_visual_tokens"))
    if args.device is not None and (problem := device_problem(args.device)):
        raise ConfigError(f"--device: {problem} (got {args.device!r})")
    return _device(args.device)


def _make_pairs(args: argparse.Namespace) -> int:
    from .data.tools.pairs import make_pairs
    from .train.outdir import check_not_input, check_writable_file

    _check_positive(args, ("max_pairs",))
    check_writable_file(args.output, "make-pairs output", create_folders=False)
    check_not_input(args.output, "make-pairs output", [("corpus", args.corpus)])
    report = make_pairs(args.corpus, args.output, query_field=args.query_field,
                        doc_field=args.doc_field, id_field=args.id_field,
                        max_pairs=args.max_pairs, fmt=args.dst_format)
    skipped = "".join(f"; skipped {n} ({why})" for why, n in sorted(report["skipped"].items()))
    print(f"wrote {report['written']} pairs ({args.query_field} -> {args.doc_field}) to "
          f"{args.output}{skipped}")
    return 0


def _render_pages(args: argparse.Namespace) -> int:
    from .data.tools.pages import render_beir_pages
    from .train.outdir import check_writable_folder

    try:
        w, h = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--size must be WIDTHxHEIGHT, got {args.size!r}") from None
    if w <= 0 or h <= 0:
        raise ConfigError(f"--size: width and height must be > 0 pixels, got {args.size!r}")
    _check_positive(args, ("font_size", "max_docs"))
    _check_positive(args, ("num_negatives",), at_least=0)
    if args.font is not None and not Path(args.font).is_file():
        raise ConfigError(f"--font: no such font file: {args.font}")
    if Path(args.output).exists() and not Path(args.output).is_dir():
        raise ConfigError(f"render-pages: the output {args.output} is a file; give a folder "
                          f"(created if missing)")
    check_writable_folder(args.output, "render-pages output")
    counts = render_beir_pages(args.source, args.output,
                              splits=tuple(s for s in args.splits.split(",") if s),
                              max_docs=args.max_docs, num_negatives=args.num_negatives,
                              seed=args.seed, size=(w, h), font_size=args.font_size,
                              font=args.font)
    print(f"rendered {counts['documents']} pages, {counts['queries']} queries, "
          f"{counts['train_records']} train records into {args.output}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt as e:  # Ctrl-C: where it stopped, no traceback
        from .train.loop import RunInterrupted

        print(str(e) if isinstance(e, RunInterrupted) else
              f"bigbatch {args.command}: stopped (Ctrl-C)" + (
                  ", before training began; nothing was written" if args.command == "train"
                  else ""), file=sys.stderr, flush=True)
        return getattr(e, "exit_code", 130)  # a preempted run (SIGTERM, SIGUSR1): 75


def _run(args: argparse.Namespace) -> int:
    """Run the command ``args`` names; a bigbatch error prints one line and gives 2."""
    try:
        if args.command == "eval":
            return _eval(args)
        if args.command == "validate":
            return _validate(args)
        if args.command == "convert":
            return _convert(args)
        if args.command == "mine":
            return _mine(args)
        if args.command == "render-pages":
            return _render_pages(args)
        if args.command == "make-pairs":
            return _make_pairs(args)
        if args.command == "train":
            from .train import load_config, train

            overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
            config = load_config(args.config, overrides)
            summary = train(config)
            print_summary(summary, config.best_metric, config.eval_split)
            return 0
    except BigBatchError as e:
        print(f"bigbatch: error: {e}", file=sys.stderr)
        return 2
    return 1


def _device(name: str | None) -> str:
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def _cache_dir(args: argparse.Namespace):
    from .data.readers.files import default_cache_dir

    return None if args.no_cache else (args.cache_dir or default_cache_dir())


def _encoder_overrides(args: argparse.Namespace) -> dict:
    return {"query_prefix": args.query_prefix, "doc_prefix": args.doc_prefix,
            "pooling": args.pooling, "max_length": args.max_length,
            "query_instruction": args.query_instruction, "doc_instruction": args.doc_instruction,
            "max_num_visual_tokens": args.max_num_visual_tokens,
            "min_num_visual_tokens": args.min_num_visual_tokens}


def _eval(args: argparse.Namespace) -> int:

    from .data.readers.beir_dir import require_split
    from .encoders import load_encoder
    from .retrieval.evaluate import evaluate_beir, evaluate_beir_dims
    from .train.outdir import check_not_input, check_writable_file

    if args.output:  # before evaluating, so that no evaluation is lost
        check_writable_file(args.output, "--output", create_folders=False)
        check_not_input(args.output, "--output", [("--data", args.data)]
                        + [("--model", m) for m in args.model])
    if args.unseen_from:  # a split named on purpose must exist (the default's may not)
        require_split(args.data, args.unseen_from, "--unseen-from")
    unseen_from = "train" if args.unseen_from is None else args.unseen_from or None
    device = _check_encoder_args(args)
    if args.dims is not None:
        from .losses.matryoshka import check_dims
        check_dims(args.dims, what="--dims")
    results = []
    for path in args.model:
        encoder = load_encoder(path, **_encoder_overrides(args)).to(device)
        task = args.task if args.task is not None else Path(args.data).name
        if args.task is not None and args.task not in encoder.tasks:
            raise ConfigError(f"--task: {path} has no task {args.task!r} (it has: "
                              f"{', '.join(sorted(encoder.tasks)) or 'none'})")
        given = {s: _encoder_overrides(args)[a] for s, a in encoder.prompt_attrs.items()}
        prompts = {s: v for s, v in encoder.task_prompts(task).items() if given[s] is None}
        common = dict(batch_size=args.batch_size, device=device, unseen_from=unseen_from,
                      cache_dir=_cache_dir(args))
        with encoder.using_prompts(**prompts):  # a prefix given on the command line wins
            if args.dims is None:
                metrics = evaluate_beir(encoder, args.data, args.split, **common)
                results.append({"model": str(path), "data": str(args.data),
                                "split": args.split, "metrics": metrics})
                continue
            per_dim = evaluate_beir_dims(encoder, args.data, args.dims, args.split, **common)
        results.extend({"model": f"{path} @{dim}", "dim": dim, "data": str(args.data),
                        "split": args.split, "metrics": metrics}
                       for dim, metrics in per_dim.items())
    print(format_eval_table(results))
    if args.output:  # strict JSON, written whole or not at all
        from .retrieval.report import json_text
        from .train.durable import write_text_safely
        write_text_safely(args.output, json_text(results, indent=2), "evaluate again")
        print(f"wrote {args.output}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from .data.records.validate import validate_file

    total_records, total_problems = 0, 0
    for path in args.files:
        n, problems = validate_file(path, args.format, args.split, args.data_root)
        total_records += n
        total_problems += len(problems)
        for p in problems:
            print(p)
        print(f"{path}: {n} records, {len(problems)} problem(s)")
    print(f"{'clean' if total_problems == 0 else 'NOT clean'}: {total_records} records in "
          f"{len(args.files)} file(s), {total_problems} problem(s)")
    return 0 if total_problems == 0 else 1


def _convert(args: argparse.Namespace) -> int:
    from .data.formats import detect_format, stream_records, write_records
    from .train.outdir import check_not_input

    check_not_input(args.output, "convert output", [("input", args.input)],
                    output_is_folder=args.dst_format == "beir" or Path(args.output).is_dir())
    src_format = args.src_format
    if src_format is None and Path(args.input).exists():
        src_format = detect_format(args.input)
    if src_format == "colpali":
        return _convert_colpali(args)
    if args.dst_format is None:
        raise ConfigError("convert needs --to (one of " + ", ".join(FORMATS) + ")")
    # read and written one record at a time; a problem found stops it before the output
    # takes its place (write_records writes it under a temporary name until then)
    report = write_records(_checked_records(args), args.output, args.dst_format,
                           allow_lossy=args.allow_lossy,
                           query_instruction=args.query_instruction,
                           doc_instruction=args.doc_instruction, split=args.split,
                           reread=lambda: stream_records(args.input, args.src_format,
                                                         args.split, []))
    print(f"converted {report['read']} records -> {report['written']} written as "
          f"{args.dst_format} to {args.output}" +
          (f"; dropped {report['dropped']}: {'; '.join(report['dropped_reasons'])}"
           if report["dropped"] else ""))
    if report["system_prompts_kept"]:
        print(f"note: {report['system_prompts_kept']} record(s) keep their own system messages; "
              f"--query-instruction / --doc-instruction apply to conversations without one")
    if report["system_prompts_dropped"]:
        print(f"system prompts not written ({args.dst_format} has no field for them): "
              f"{report['system_prompts_dropped']} record(s)")
    for side, prompt in report["system_prompts"].items():
        flag = "query" if side == "query" else "doc"
        print(f"note: the records' {side} system prompt {prompt!r} is not written "
              f"({args.dst_format} has no field for it); train with --{flag}-instruction "
              f"{prompt!r} (vision-language) or --{flag}-prefix {prompt + ' '!r} (text)")
    return 0


def _checked_records(args: argparse.Namespace) -> Iterator[Record]:
    """The records of ``convert``'s input, one at a time; once all are read, the problems
    found (reading, files outside ``--data-root``) are printed and raise.

    Raises:
        ConfigError: a problem in the input.
    """
    from .data.formats import stream_records
    from .data.records.loader import paths_outside

    problems: list[Problem] = []
    outside: list[Problem] = []
    for r in stream_records(args.input, args.src_format, args.split, problems):
        outside += paths_outside([r], args.data_root)
        yield r
    problems += outside
    if problems:
        for p in problems[:20]:
            print(p, file=sys.stderr)
        raise ConfigError(f"{len(problems)} problem(s) in {args.input}; run `bigbatch validate` "
                          f"and fix them first")


def _convert_colpali(args: argparse.Namespace) -> int:
    from .data.records.types import problem_lines
    from .data.tools.convert_colpali import convert_colpali

    fmt = args.dst_format or "contrastors"
    report = convert_colpali(args.input, args.output, fmt, split=args.split,
                             allow_lossy=args.allow_lossy,
                             query_instruction=args.query_instruction,
                             doc_instruction=args.doc_instruction)
    for line in problem_lines(report["skipped"], " rows without query text"):
        print(line)
    for p in report["problems"][:20]:
        print(f"{p} (row dropped: --allow-lossy)")
    print(f"converted {report['rows']} colpali rows -> {report['written']} records written as "
          f"{fmt} to {args.output}; skipped {report['skipped_no_query']} without query text"
          + (f"; dropped {report['dropped_rows']} with bad images (--allow-lossy)"
             if report["dropped_rows"] else ""))
    print(f"images: {report['images_written']} written to {report['images_folder']} "
          f"(original bytes" + (f", {report['images_reencoded']} re-encoded as PNG"
                                if report["images_reencoded"] else "") +
          f"), {report['images_reused']} rows reuse an identical image")
    if report["not_read"]:
        print(f"not read: column(s) {', '.join(report['not_read'])} (bigbatch records hold the "
              f"query, the positive page and negative pages)")
    return 0


def _mine(args: argparse.Namespace) -> int:
    from .encoders import load_encoder
    from .retrieval.mining import MiningOptions, mine_hard_negatives
    from .train.outdir import check_not_input, check_writable_file

    try:
        start, end = (int(x) for x in args.rank_window.split(":"))
    except ValueError as e:
        raise ConfigError(f"--rank-window must be START:END, got {args.rank_window!r}") from e
    ratio = args.max_score_ratio if args.max_score_ratio and args.max_score_ratio > 0 else None
    opts = MiningOptions(num_negatives=args.num_negatives, rank_start=start, rank_end=end,
                         max_score_ratio=ratio, margin=args.margin, index=args.index,
                         batch_size=args.batch_size, min_negatives=args.min_negatives,
                         scores=args.scores).validate()
    device = _check_encoder_args(args)
    out = Path(args.output)
    check_writable_file(out, "--output")
    check_not_input(out, "--output", [("--data", args.data), ("--model", args.model)])
    encoder = load_encoder(args.model, **_encoder_overrides(args)).to(device)
    # mined into a temporary file beside the output (image paths are relative to its
    # folder), put in place only when there is something to train on
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp_report = Path(f"{tmp}.report.json")
    made = [p for p in out.absolute().parents if not p.exists()]  # folders mining creates
    written = False
    try:
        report = mine_hard_negatives(encoder, args.data, args.split, tmp, opts,
                                     device=device, cache_dir=_cache_dir(args))
        print("\n".join(report.lines()))
        if report.records == 0 or report.negatives_written == 0:
            raise ConfigError(
                f"mine: no negatives found for any of the {report.queries} queries of "
                f"{args.split} ({report.dropped_as_false_negative} candidates dropped as "
                f"likely false negatives, {report.skipped_records} pairs left with fewer than "
                f"{opts.required}); nothing was written to {out}. Widen --rank-window, raise "
                f"--max-score-ratio, or lower --min-negatives")
        os.replace(tmp, out)
        os.replace(tmp_report, f"{out}.report.json")
        written = True
    finally:
        tmp.unlink(missing_ok=True)
        tmp_report.unlink(missing_ok=True)
        for folder in made if not written else ():  # deepest first; only if left empty
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
    print(f"wrote {out} and {out}.report.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
