"""``bigbatch mine``: hard negatives for a BEIR split's (query, positive) pairs, retrieved
with faiss by a model and filtered for likely false negatives; the records file is written
only when there is something to train on."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .eval import add_encoder_flags, cache_dir, check_encoder_args, encoder_overrides
from .options import DefaultsFormatter

__all__ = ["add_parser", "run"]


def add_parser(sub: Any, name: str) -> None:
    mi = sub.add_parser(name, help="mine hard negatives with faiss, filtering false negatives",
                        formatter_class=DefaultsFormatter)
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
    add_encoder_flags(mi)


def run(args: argparse.Namespace) -> int:
    from ..data.readers.files import check_writable_file
    from ..encoders import load_encoder
    from ..engine import distributed as D
    from ..retrieval.distributed_eval import split_over_ranks
    from ..retrieval.mining import MiningOptions, mine_hard_negatives
    from ..train.outdir import check_not_input

    try:
        start, end = (int(x) for x in args.rank_window.split(":"))
    except ValueError as e:
        raise ConfigError(f"--rank-window must be START:END, got {args.rank_window!r}") from e
    ratio = args.max_score_ratio if args.max_score_ratio and args.max_score_ratio > 0 else None
    opts = MiningOptions(num_negatives=args.num_negatives, rank_start=start, rank_end=end,
                         max_score_ratio=ratio, margin=args.margin, index=args.index,
                         batch_size=args.batch_size, min_negatives=args.min_negatives,
                         scores=args.scores).validate()
    device = check_encoder_args(args)
    out = Path(args.output)
    check_writable_file(out, "--output")
    check_not_input(out, "--output", [("--data", args.data), ("--model", args.model)])
    # under torchrun every process embeds its share of the corpus and queries, all get the
    # same candidates, the main process writes (the corpus cache is off: a hit on one
    # process and a miss on another would part their collectives)
    info = D.init_distributed()
    encoder = split_over_ranks(load_encoder(args.model, **encoder_overrides(args)).to(device))
    # mined into a temporary file beside the output (image paths are relative to its
    # folder), put in place only when there is something to train on
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")  # (one per process)
    tmp_report = Path(f"{tmp}.report.json")
    made = [p for p in out.absolute().parents if not p.exists()]  # folders mining creates
    written = False
    try:
        report = mine_hard_negatives(encoder, args.data, args.split, tmp, opts,
                                     device=device, progress=info.is_main,
                                     cache_dir=cache_dir(args) if info.world_size == 1 else None)
        if info.is_main:
            print("\n".join(report.lines()))
        if report.records == 0 or report.negatives_written == 0:
            raise ConfigError(
                f"mine: no negatives found for any of the {report.queries} queries of "
                f"{args.split} ({report.dropped_as_false_negative} candidates dropped as "
                f"likely false negatives, {report.skipped_records} pairs left with fewer than "
                f"{opts.required}); nothing was written to {out}. Widen --rank-window, raise "
                f"--max-score-ratio, or lower --min-negatives")
        if info.is_main:
            os.replace(tmp, out)
            os.replace(tmp_report, f"{out}.report.json")
        written = True
    finally:
        tmp.unlink(missing_ok=True)
        tmp_report.unlink(missing_ok=True)
        for folder in made if not written else ():  # deepest first; only if left empty
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
    if info.world_size > 1:
        import torch.distributed as dist

        dist.barrier()  # the file is in place before any process exits
    if info.is_main:
        print(f"wrote {out} and {out}.report.json")
    return 0
