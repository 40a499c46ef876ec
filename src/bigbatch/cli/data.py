"""The data tools ``bigbatch validate`` (check training files, report every problem),
``make-pairs`` (training pairs from a corpus alone) and ``render-pages`` (a BEIR corpus
rendered to page images); ``convert`` is :mod:`bigbatch.cli.convert`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..data.formats import FORMATS, READ_ONLY_FORMATS
from ..errors import ConfigError
from .options import DefaultsFormatter, check_positive, config_field, field_help

__all__ = ["add_validate", "validate", "add_make_pairs", "make_pairs", "add_render_pages",
           "render_pages"]


def add_validate(sub: Any, name: str) -> None:
    va = sub.add_parser(name, help="check training files; report every problem")
    va.add_argument("files", nargs="+", help="JSONL/Parquet/CSV files, datasets folders "
                    "(save_to_disk) or BEIR directories")
    va.add_argument("--format", choices=FORMATS + READ_ONLY_FORMATS, default=None,
                    help="default: detected")
    va.add_argument("--split", default="train", help="qrels split of BEIR directories, split "
                    "of a datasets DatasetDict folder")
    va.add_argument("--data-root", default=None, help=field_help(config_field("data_root")))


def validate(args: argparse.Namespace) -> int:
    from ..data.records.validate import validate_file

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


def add_make_pairs(sub: Any, name: str) -> None:
    mp = sub.add_parser(name, help="training pairs from a corpus alone: one field of each "
                        "document as the query, another as the positive (title -> abstract)",
                        formatter_class=DefaultsFormatter)
    mp.add_argument("corpus", help="a JSONL corpus (BEIR corpus.jsonl) or a BEIR directory")
    mp.add_argument("output", help="the training file to write (.jsonl, .parquet)")
    mp.add_argument("--query-field", default="title", help="the field that becomes the query")
    mp.add_argument("--doc-field", default="text", help="the field that becomes the positive")
    mp.add_argument("--id-field", default="_id", help="the field kept as the positive's id")
    mp.add_argument("--max-pairs", type=int, default=None, help="write the first this many "
                    "pairs (default: all)")
    mp.add_argument("--to", dest="dst_format", choices=FORMATS, default="contrastors",
                    help="the output's format")


def make_pairs(args: argparse.Namespace) -> int:
    from ..data.readers.files import check_writable_file
    from ..data.tools.pairs import make_pairs

    check_positive(args, ("max_pairs",))
    check_writable_file(args.output, "make-pairs output", create_folders=False)
    report = make_pairs(args.corpus, args.output, query_field=args.query_field,
                        doc_field=args.doc_field, id_field=args.id_field,
                        max_pairs=args.max_pairs, fmt=args.dst_format)
    skipped = "".join(f"; skipped {n} ({why})" for why, n in sorted(report["skipped"].items()))
    print(f"wrote {report['written']} pairs ({args.query_field} -> {args.doc_field}) to "
          f"{args.output}{skipped}")
    return 0


def add_render_pages(sub: Any, name: str) -> None:
    rp = sub.add_parser(name, help="render a BEIR corpus to page images (a visual document "
                        "retrieval set: text queries, image documents)",
                        formatter_class=DefaultsFormatter)
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


def render_pages(args: argparse.Namespace) -> int:
    from ..data.readers.files import check_writable_folder
    from ..data.tools.pages import render_beir_pages

    try:
        w, h = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--size must be WIDTHxHEIGHT, got {args.size!r}") from None
    if w <= 0 or h <= 0:
        raise ConfigError(f"--size: width and height must be > 0 pixels, got {args.size!r}")
    check_positive(args, ("font_size", "max_docs"))
    check_positive(args, ("num_negatives",), at_least=0)
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
