"""The ``bigbatch`` command line: ``bigbatch train`` (more subcommands to come).

Every option of :class:`bigbatch.train.TrainConfig` is a flag spelled with dashes
(``--grad-cache-chunk``); ``--config file.yaml`` supplies values that flags override.
Errors a user can cause print one clear line (file, line, field or option) and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from .errors import BigBatchError

__all__ = ["main", "build_parser"]

_HELP = {
    "model": "transformers model path or name (e.g. the all-MiniLM-L6-v2 folder)",
    "train_data": "JSONL records (query, positive|chunk_path, negatives|neg_chunk_paths) or a "
                  "BEIR directory",
    "train_split": "qrels split used as training pairs when --train-data is a BEIR directory",
    "eval_data": "BEIR directory evaluated with full-corpus retrieval",
    "eval_split": "qrels split to evaluate on",
    "output_dir": "where checkpoints, best/, final/, metrics.jsonl and the plot go",
    "batch_size": "queries per process per step (global batch = this x processes)",
    "grad_cache_chunk": "rows embedded at once (memory = this x per-example cost)",
    "lr": "peak learning rate (AdamW)",
    "logit_scale_lr": "learning rate of the temperature (default: --lr)",
    "scheduler": "cosine or constant, after linear warmup",
    "max_steps": "optimizer steps (ignored when --epochs is given)",
    "epochs": "train this many epochs instead of --max-steps",
    "temperature": "initial temperature (learnable unless --fixed-temperature)",
    "num_hard_negatives": "hard negatives per query (sampled per epoch when a record has more)",
    "lora_r": "LoRA rank; 0 means full fine-tuning",
    "lora_alpha": "LoRA alpha; 0 means full fine-tuning",
    "lora_target_modules": "comma-separated module names (default: per architecture)",
    "merge_lora": "merge the LoRA adapter into the base weights in final/",
    "max_grad_norm": "clip the gradient norm over model and logit scale (0: off)",
    "eval_steps": "evaluate every N steps (0: only at start and end)",
    "save_steps": "checkpoint every N steps (0: only at the end)",
    "save_total_limit": "keep this many newest checkpoints (plus best/)",
    "best_metric": "metric that selects best/ (e.g. ndcg@10, unseen/ndcg@10)",
    "resume": "checkpoint directory (or output directory: its latest checkpoint) to resume",
    "dtype": "autocast dtype for the encoder: float32, bfloat16 or float16",
    "device": "cpu, cuda, cuda:1 ... (default: cuda:LOCAL_RANK when available, else cpu)",
    "dist_timeout": "seconds before a stuck collective fails (torchrun)",
}


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    from .train.config import TrainConfig

    p.add_argument("--config", default=None, help="YAML file of options; flags override it")
    for f in dataclasses.fields(TrainConfig):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        help_ = _HELP.get(f.name, "")
        typ = str(f.type)
        if typ == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=help_ or f"(default {f.default})")
        elif "list" in typ:
            p.add_argument(flag, type=lambda s: [v.strip() for v in s.split(",") if v.strip()],
                           default=argparse.SUPPRESS, help=help_)
        else:
            conv = int if typ.startswith("int") else float if typ.startswith("float") else str
            default = f.default if f.default is not dataclasses.MISSING else None
            p.add_argument(flag, type=conv, default=argparse.SUPPRESS,
                           help=f"{help_} (default {default})" if help_ else f"(default {default})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bigbatch", description="Exact GradCache training "
                                     "of embedding models at batch sizes beyond memory.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train_flags(sub.add_parser("train", help="fine-tune a bi-encoder with GradCache",
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            from .train import load_config, train

            overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
            config = load_config(args.config, overrides)
            summary = train(config)
            _print_summary(summary)
            return 0
    except BigBatchError as e:
        print(f"bigbatch: error: {e}", file=sys.stderr)
        return 2
    return 1


def _print_summary(summary: dict) -> None:
    base, final = summary.get("base"), summary.get("final")
    if not final:
        print(f"done: {summary['steps']} steps in {summary['seconds']:.0f} s; "
              f"model in {summary['final_model']}")
        return
    keys = [k for k in ("ndcg@10", "recall@1", "recall@5", "recall@10", "mrr@10", "margin")
            if k in final]
    rows = [("full test split", ""), ("unseen-document claims", "unseen/")]
    print(f"\n{'':<40}" + "".join(f"{k:>11}" for k in keys))
    for label, prefix in rows:
        if f"{prefix}ndcg@10" not in final:
            continue
        for name, m in (("base", base), ("fine-tuned", final)):
            if m is None:
                continue
            n = int(m.get(f"{prefix}queries", 0))
            print(f"{name + ', ' + label + f' ({n})':<40}"
                  + "".join(f"{m[prefix + k]:>11.4f}" for k in keys))
    print(f"\n{summary['steps']} steps in {summary['seconds'] / 60:.1f} min; "
          f"model in {summary['final_model']}")


if __name__ == "__main__":
    raise SystemExit(main())
