"""``bigbatch convert``: training data between the contrastors, ms-swift,
sentence-transformers and BEIR layouts, one record at a time (the output takes its place only
when every record converted); and colpali-engine / ViDoRe tables into bigbatch records, their
page images written to files."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..data.formats import (
    FORMATS,
    READ_ONLY_FORMATS,
    SWIFT_DOC_INSTRUCTION,
    SWIFT_QUERY_INSTRUCTION,
    Problem,
    Record,
)
from ..errors import ConfigError
from .options import DefaultsFormatter, config_field, field_help

__all__ = ["add_parser", "run"]


def add_parser(sub: Any, name: str) -> None:
    co = sub.add_parser(name, help="convert between contrastors, ms-swift, "
                        "sentence-transformers and BEIR formats; read colpali-engine / "
                        "ViDoRe Parquet or datasets folders (page images written to files)",
                        formatter_class=DefaultsFormatter)
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
    co.add_argument("--data-root", default=None, help=field_help(config_field("data_root")))


def run(args: argparse.Namespace) -> int:
    from ..data.formats import detect_format, stream_records, write_records

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
    from ..data.formats import stream_records
    from ..data.records.loader import paths_outside

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
    from ..data.records.types import problem_lines
    from ..data.tools.convert_colpali import convert_colpali

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
