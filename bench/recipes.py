"""Which recipe helps: the study behind ``docs/recipes.md``.

all-MiniLM-L6-v2 fine-tuned on SciFact train with ``make demo``'s settings
(``configs/demo_scifact.yaml``: global batch 128 in chunks of 32, 14 steps, AdamW 5e-5,
cosine, temperature 0.05 learnable, max length 256, seed 42), one change at a time:

=============  ====================================================================
``demo``       the ``make demo`` recipe (in-batch negatives only)
``hn1``        + mined hard negatives, 1 per query (drawn each epoch from the 3 mined)
``hn3``        + mined hard negatives, 3 per query
``guided``     ``hn1`` + self-guided false-negative filtering (``--guide-model self``)
``distill``    ``hn1`` + KL distillation from the mining model's scores (``--distill kl``)
``matryoshka`` ``demo`` + Matryoshka over 384, 256, 128 and 64 dims
``refresh``    ``hn3`` with the negatives mined again by the model in training every epoch
               (``--refresh-negatives-every epoch``; the first ones by the base model)
``refresh4``   the same every 4 steps
``queue``      ``hn3`` + the last 4 steps' documents as extra negatives
``merge``      ``hn3``, its last 3 checkpoints averaged (``--merge-last 3``)
=============  ====================================================================

The hard negatives come from ``bigbatch mine`` with the base model (ranks 0-100 after the
known positives, candidates above 95% of the positive's score dropped, ``--scores``). Every
run trains the same 14 steps with the same seed, then ``bigbatch eval --dims 384,128``
scores the final model on the full test split (300 claims) and on the claims whose
abstracts no training pair cites; ``base`` is the untouched model.

Each run is resumable: a finished run (its ``eval.json``) is kept, and a trained one (its
``summary.json``) is only evaluated, so the command can be stopped and run again. Results
go to ``bench/results/recipes-cpu.json`` (merged per run) and the table is printed in the
Markdown of ``docs/recipes.md``::

    python bench/recipes.py                      # every run (about 4 h on 2 CPU cores)
    python bench/recipes.py --only demo,hn1      # some of them
    python bench/recipes.py --table              # print the table of what is there
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, SCIFACT, machine, minilm_path, now

RUNS = ROOT / "runs" / "recipes"
OUT = RESULTS / "recipes-cpu.json"
DIMS = "384,128"
STEPS = 14
MINED = RUNS / "mined-k3.jsonl"
CONFIG = RUNS / "study.yaml"

# name -> (what it adds, train data: "beir" or "mined", extra `bigbatch train` flags)
RECIPES: dict[str, tuple[str, str, list[str]]] = {
    "demo": ("make demo's recipe (in-batch negatives)", "beir", []),
    "hn1": ("+ 1 mined hard negative per query", "mined", ["--num-hard-negatives", "1"]),
    "hn3": ("+ 3 mined hard negatives per query", "mined", ["--num-hard-negatives", "3"]),
    "guided": ("+ 1 mined hard negative, self-guided filtering", "mined",
               ["--num-hard-negatives", "1", "--guide-model", "self"]),
    "distill": ("+ 1 mined hard negative, KL distillation from the mined scores", "mined",
                ["--num-hard-negatives", "1", "--distill", "kl"]),
    "matryoshka": ("+ Matryoshka 384/256/128/64", "beir",
                   ["--matryoshka-dims", "384,256,128,64"]),
    # negatives that keep up with the model: each against hn3, which it extends
    "refresh": ("+ 3 hard negatives mined by the model in training, again every epoch",
                "beir", ["--num-hard-negatives", "3", "--refresh-negatives-every", "epoch"]),
    "refresh4": ("+ 3 hard negatives mined by the model in training, again every 4 steps",
                 "beir", ["--num-hard-negatives", "3", "--refresh-negatives-every", "4"]),
    "queue": ("hn3 + the last 4 steps' documents as extra negatives", "mined",
              ["--num-hard-negatives", "3", "--negative-queue", "4"]),
    "merge": ("hn3, the last 3 checkpoints (steps 10, 12, 14) averaged", "mined",
              ["--num-hard-negatives", "3", "--save-steps", "2", "--save-total-limit", "3",
               "--merge-last", "3"]),
}
# the folder a recipe's evaluation reads: merged/ for --merge-last, else final/
MODEL_FOLDER = {"merge": "merged"}


def write_config() -> None:
    """``make demo``'s configuration with its 2 epochs as 14 steps: the mined files may hold
    fewer records than SciFact train, and every recipe trains the same steps."""
    import yaml

    cfg = yaml.safe_load((ROOT / "configs" / "demo_scifact.yaml").read_text())
    cfg.pop("epochs")
    cfg.pop("output_dir")
    cfg["max_steps"] = STEPS
    CONFIG.write_text(yaml.safe_dump(cfg, sort_keys=False))


def bigbatch(*args: str, log: Path) -> float:
    """Run ``bigbatch ARGS`` (output to ``log``); its wall time in seconds."""
    t = time.time()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as f:
        code = subprocess.call([str(Path(sys.executable).parent / "bigbatch"), *args],
                               stdout=f, stderr=subprocess.STDOUT, env=env)
    if code:
        sys.exit(f"bigbatch {args[0]} failed ({code}): see {log}")
    return time.time() - t


def mine(model: str, data: Path) -> float:
    """The mined training file (kept once made); its wall time (0 when kept)."""
    if MINED.exists():
        return 0.0
    RUNS.mkdir(parents=True, exist_ok=True)
    return bigbatch("mine", "--model", model, "--data", str(data), "--split", "train",
                    "--output", str(MINED), "--num-negatives", "3", "--scores",
                    "--max-length", "256", log=RUNS / "mine.log")


def evaluate(model: str, data: Path, out: Path) -> tuple[list[dict], float]:
    """``bigbatch eval --dims`` of ``model``: its rows and wall time."""
    seconds = bigbatch("eval", "--model", model, "--data", str(data), "--dims", DIMS,
                       "--output", str(out), "--no-cache", log=out.with_suffix(".log"))
    return json.loads(out.read_text()), seconds


def run(name: str, model: str, data: Path) -> dict:
    """Train recipe ``name`` (kept when its evaluation exists) and evaluate it."""
    folder = RUNS / name
    done = folder / "eval.json"
    if name == "base":
        folder.mkdir(parents=True, exist_ok=True)
        rows, eval_s = evaluate(model, data, done) if not done.exists() else \
            (json.loads(done.read_text()), None)
        return {"adds": "all-MiniLM-L6-v2 as published", "rows": recorded(rows, model, data),
                "eval_seconds": eval_s}
    adds, kind, flags = RECIPES[name]
    if done.exists():
        return json.loads((folder / "result.json").read_text())
    mine_s = mine(model, data) if kind == "mined" else 0.0
    train_data = str(MINED) if kind == "mined" else str(data)
    args = ["train", "--config", str(CONFIG), "--model", model,
            "--train-data", train_data, "--output-dir", str(folder),
            "--overwrite", *flags]
    folder.mkdir(parents=True, exist_ok=True)
    command = "bigbatch " + " ".join(args)
    summary = folder / "summary.json"
    trained = json.loads(summary.read_text()) if summary.exists() else {}
    if trained.get("steps") == STEPS:  # stopped between training and evaluation
        train_s = trained["seconds"]
    else:
        train_s = bigbatch(*args, log=RUNS / f"{name}.train.log")
    rows, eval_s = evaluate(str(folder / MODEL_FOLDER.get(name, "final")), data, done)
    result = {"adds": adds, "command": recorded(command, model, data), "flags": flags,
              "rows": recorded(rows, model, data), "train_seconds": train_s,
              "eval_seconds": eval_s, "mine_seconds": mine_s}
    (folder / "result.json").write_text(json.dumps(result, indent=2))
    return result


def recorded(value, model: str, data: Path):
    """``value`` (a string, or a list or dict of them) as the results file records it: the
    model by its name, the data as ``data/scifact`` and this checkout's folders relative to
    it, so that no path of the machine that measured is written."""
    if isinstance(value, dict):
        return {k: recorded(v, model, data) for k, v in value.items()}
    if isinstance(value, list):
        return [recorded(v, model, data) for v in value]
    if not isinstance(value, str):
        return value
    for path, name in ((model, "all-MiniLM-L6-v2"), (str(data), "data/scifact"),
                       (f"{ROOT}/", "")):
        value = value.replace(path, name)
    return value


def table(results: dict) -> str:
    """The Markdown table of docs/recipes.md."""
    lines = ["| recipe | nDCG@10 | R@10 | nDCG@10 @128 | R@10 @128 | unseen nDCG@10 | "
             "unseen R@10 | unseen nDCG@10 @128 | train + eval |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in ["base", *RECIPES]:
        if name not in results:
            continue
        r = results[name]
        by_dim = {row["dim"]: row["metrics"] for row in r["rows"]}
        full, small = by_dim[384], by_dim[128]
        minutes = "-" if "train_seconds" not in r else \
            f"{(r['train_seconds'] + r['eval_seconds']) / 60:.1f} min"
        lines.append(f"| `{name}` {r['adds']} | {full['ndcg@10']:.4f} | {full['recall@10']:.4f} | "
                     f"{small['ndcg@10']:.4f} | {small['recall@10']:.4f} | "
                     f"{full['unseen/ndcg@10']:.4f} | {full['unseen/recall@10']:.4f} | "
                     f"{small['unseen/ndcg@10']:.4f} | {minutes} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(["base", *RECIPES]),
                    help="comma-separated runs (base and " + ", ".join(RECIPES) + ")")
    ap.add_argument("--data", default=str(SCIFACT), help="the SciFact BEIR folder")
    ap.add_argument("--table", action="store_true", help="print the table of the results file")
    args = ap.parse_args()
    results = json.loads(OUT.read_text())["runs"] if OUT.exists() else {}
    if not args.table:
        model = minilm_path()
        RUNS.mkdir(parents=True, exist_ok=True)
        write_config()
        for name in args.only.split(","):
            if name != "base" and name not in RECIPES:
                sys.exit(f"--only: no run {name!r} (base, {', '.join(RECIPES)})")
            print(f"{now()} {name} ...", flush=True)
            result = run(name, model, Path(args.data))
            # read again: another invocation may have added its runs meanwhile
            results = json.loads(OUT.read_text())["runs"] if OUT.exists() else {}
            results[name] = result
            RESULTS.mkdir(parents=True, exist_ok=True)
            OUT.write_text(json.dumps({"date": now(), "machine": machine("cpu"), "steps": STEPS,
                                       "runs": results}, indent=2))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
