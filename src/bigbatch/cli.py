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
import typing
from collections.abc import Callable, Iterator, Sequence
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
from .errors import BigBatchError, ConfigError
from .retrieval.report import format_eval_table, print_summary

__all__ = ["main", "build_parser"]

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


def _argparse_type(parse: Callable[[str], Any], flag: str) -> Callable[[str], Any]:
    """An argparse ``type``: ``parse(text)``, its :class:`ConfigError` an argparse error
    ("argument --batch-size: must be an integer, got 'x'")."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(flag).lstrip(": ")) from None

    return convert


def _field(name: str) -> Any:
    from .train.config import TrainConfig

    return next(f for f in dataclasses.fields(TrainConfig) if f.name == name)


def _field_help(f: Any) -> str:
    """A field's help as its flag shows it, ending with its default (unless the help states
    it or the option is required)."""
    from .train.config import option_type

    help_, kinds = f.metadata["help"], option_type(f.name)
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if f.metadata["from_model_folder"]:
        shown = f.metadata["default_text"] or ("none" if default in ("", None) else default)
        return f"{help_} (default: what the model folder says, else {shown})"
    if kinds == (bool,):
        return f"{help_} (default {'on' if default else 'off'})"
    if "(default:" in help_ or help_.startswith("required") or list in map(typing.get_origin, kinds):
        return help_
    return f"{help_} (default {default})"


def _add_field_flag(p: Any, f: Any, flag: str | None = None, *, default: Any = argparse.SUPPRESS,
                    refuse_choices: bool = False, help: str | None = None) -> None:
    """The flag of the :class:`~bigbatch.train.TrainConfig` field ``f`` (``--`` and its name
    with dashes, or ``flag``): its help, and its values read by
    :func:`~bigbatch.train.config.parse_value`. Its choices are listed, and refused by argparse
    with ``refuse_choices`` (else :meth:`~bigbatch.train.TrainConfig.validate` refuses them)."""
    from .train.config import comma_list, option_type, parse_value

    flag = flag or "--" + f.name.replace("_", "-")
    help_ = help or _field_help(f)
    choices = f.metadata["choices"]
    if f.name in ("train_data", "eval_data"):  # repeatable, each a path or a comma list
        p.add_argument(flag, action="extend", default=default, help=help_, type=comma_list)
    elif option_type(f.name) == (bool,):
        p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
    else:
        p.add_argument(flag, default=default, help=help_,
                       type=_argparse_type(lambda text: parse_value(f.name, text, flag), flag),
                       **({"choices": choices} if refuse_choices and choices else
                          {"metavar": "{" + ",".join(choices) + "}"} if choices else {}))


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    from .train.config import SECTIONS, TrainConfig

    p.add_argument("--config", default=None, help="YAML file of options; flags override it; "
                   "relative paths in it are read from the YAML file's folder (on the command "
                   "line, from the working directory)")
    groups = {name: p.add_argument_group(f"{name} options", what)
              for name, what in SECTIONS.items()}
    for f in dataclasses.fields(TrainConfig):
        _add_field_flag(groups[f.metadata["section"]], f)


def _number_list(kind: type, flag: str) -> Any:
    """An argparse type: a comma-separated list of ``kind`` (int or float)."""
    from .train.config import number_list

    return _argparse_type(lambda text: number_list(text, kind, flag), flag)


def _encoder_fields() -> list[Any]:
    """The options of how a model embeds that eval and mine take (left out: what the model
    folder says): the model section's ``from_model_folder`` fields."""
    from .train.config import TrainConfig

    return [f for f in dataclasses.fields(TrainConfig) if f.metadata["from_model_folder"]]


def _add_encoder_flags(p: argparse.ArgumentParser) -> None:
    for f in _encoder_fields():
        _add_field_flag(p, f, default=None, refuse_choices=True)
    batch = _field("eval_batch_size")
    _add_field_flag(p, batch, "--batch-size", default=batch.default, help=(
        "texts embedded at once, queries and documents (what train's --eval-batch-size sets; "
        "not train's --batch-size, the queries of a training step)"))
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if "
                   "present, else cpu)")
    p.add_argument("--cache-dir", default=None, help="corpus embedding cache (default: "
                   "$BIGBATCH_CACHE or ~/.cache/bigbatch)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the cache")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bigbatch", description="Exact GradCache training "
                                     "of embedding models at batch sizes beyond memory.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train_flags(sub.add_parser("train", help="fine-tune a bi-encoder with GradCache"))
    va = sub.add_parser("validate", help="check training files; report every problem")
    va.add_argument("files", nargs="+", help="JSONL/Parquet/CSV files, datasets folders "
                    "(save_to_disk) or BEIR directories")
    va.add_argument("--format", choices=FORMATS + READ_ONLY_FORMATS, default=None,
                    help="default: detected")
    va.add_argument("--split", default="train", help="qrels split of BEIR directories, split "
                    "of a datasets DatasetDict folder")
    va.add_argument("--data-root", default=None, help=_field_help(_field("data_root")))

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
    co.add_argument("--data-root", default=None, help=_field_help(_field("data_root")))

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
    from .train.outdir import check_writable_file

    _check_positive(args, ("max_pairs",))
    check_writable_file(args.output, "make-pairs output", create_folders=False)
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
        return 130


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
    """The encoder options given to eval / mine (None: what the model folder says)."""
    return {f.name: getattr(args, f.name) for f in _encoder_fields()}


def _eval(args: argparse.Namespace) -> int:
    import json

    from .data.readers.beir_dir import require_split
    from .encoders import load_encoder
    from .retrieval.evaluate import evaluate_beir, evaluate_beir_dims
    from .train.outdir import check_writable_file

    if args.output:  # before evaluating, so that no evaluation is lost
        check_writable_file(args.output, "--output", create_folders=False)
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
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
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
    from .train.outdir import check_writable_file

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
