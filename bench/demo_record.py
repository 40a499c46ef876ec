"""Record a finished demo run as a results file: ``bench/results/<name>-scifact.json``.

``make demo``, ``make demo-mix`` and ``make demo-colbert`` print their table and leave a run
folder (``runs/<name>/``); this keeps what they measured beside the other benchmarks: the
machine, the run's evaluations (base and final rows, full split and unseen claims), each
training step's source, loss and accuracy, and the wall time ``make`` reported::

    make demo-mix                                      # runs/demo-mix/
    python bench/demo_record.py demo-mix --wall-minutes 17.3 --note "1 thread, 1 run beside"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, machine, now


def record(run: Path) -> dict:
    """The evaluations and training steps of a run folder's ``metrics.jsonl``."""
    evals, steps = [], []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "eval":
            evals.append(row)
        elif row.get("kind") == "train":
            steps.append({k: row[k] for k in ("step", "source", "loss", "accuracy")
                          if k in row})
    summary = json.loads((run / "summary.json").read_text())
    return {"evals": evals, "steps": steps, "train_steps": summary.get("steps"),
            "seconds": summary.get("seconds")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", nargs="?", help="the run folder's name under runs/ (demo-mix, "
                    "demo-colbert)")
    ap.add_argument("--run", default=None, help="a run folder elsewhere (instead of a name)")
    ap.add_argument("--wall-minutes", type=float, default=None,
                    help="the make target's wall time, both evaluations included")
    ap.add_argument("--note", default="", help="what else ran on the machine, threads")
    ap.add_argument("--device", default="cpu", help="the device the run trained on")
    ap.add_argument("--command", default=None, help="the command that made the run")
    ap.add_argument("--out", default=None, help="the result file (default: "
                    "bench/results/<name>-scifact.json)")
    args = ap.parse_args()
    if (args.name is None) == (args.run is None):
        ap.error("give a run name or --run FOLDER")
    run = Path(args.run) if args.run else ROOT / "runs" / args.name
    out = Path(args.out) if args.out else RESULTS / f"{args.name or run.name}-scifact.json"
    host = machine(args.device)
    host.pop("threads")  # this process's, not the run's: --note says what the run had
    result = {"date": now(), "machine": host,
              "target": f"make {args.name}" if args.name else None,
              "command": args.command or f"make {args.name}",
              "wall_minutes": args.wall_minutes, "note": args.note, **record(run)}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
