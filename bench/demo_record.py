"""Record a finished demo run as a results file: ``bench/results/<run>-scifact.json``.

``make demo``, ``make demo-mix`` and ``make demo-colbert`` print their table and leave a run
folder (``runs/demo-scifact/``, ``runs/demo-mix/``, ``runs/demo-colbert/``); this keeps what
they measured beside the other benchmarks: the machine, the run's evaluations (base and final
rows, full split and unseen claims), each training step's source, loss and accuracy, the
``bigbatch train`` command's own time (``summary.json``) and, when given, the wall time
``make`` took. ``make demo`` runs it at its end, into its run folder
(``runs/demo-scifact/demo-record.json``); copied to ``bench/results/demo-scifact.json`` it is
the demo's published record::

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


# make target -> its run folder under runs/ (and the results file's name)
RUNS = {"demo": "demo-scifact", "demo-mix": "demo-mix", "demo-colbert": "demo-colbert"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", nargs="?", help="the make target (demo, demo-mix, demo-colbert) "
                    "or a run folder's name under runs/")
    ap.add_argument("--run", type=Path, default=None,
                    help="a run folder elsewhere (instead of a name)")
    ap.add_argument("--wall-minutes", type=float, default=None,
                    help="the make target's wall time, both evaluations included (default: "
                    "not recorded; run_minutes, the training command's own, always is)")
    ap.add_argument("--note", default="", help="what else ran on the machine, threads")
    ap.add_argument("--device", default="cpu", help="the device the run trained on")
    ap.add_argument("--command", default=None, help="the command that made the run "
                    "(default: make <target>)")
    ap.add_argument("--out", type=Path, default=None, help="the file to write (default: "
                    "bench/results/<run>-scifact.json, or <run>.json for a run named so)")
    args = ap.parse_args()
    if (args.name is None) == (args.run is None):
        ap.error("give a make target, a run name or --run FOLDER")
    run = args.run.name if args.run else RUNS.get(args.name, args.name)
    folder = args.run or ROOT / "runs" / run
    out = args.out or RESULTS / (f"{run}.json" if run.endswith("-scifact") else f"{run}-scifact.json")
    host = machine(args.device)
    host.pop("threads")  # this process's, not the run's: --note says what the run had
    target = None if args.run else next((t for t, r in RUNS.items() if r == run), run)
    found = record(folder)
    result = {"date": now(), "machine": host, "target": f"make {target}" if target else None,
              "command": args.command or (f"make {target}" if target else None),
              "wall_minutes": args.wall_minutes, "note": args.note,
              "run_minutes": round(found["seconds"] / 60, 1) if found["seconds"] else None,
              **found}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"recorded the run in {out} ({result['run_minutes']} minutes of bigbatch train)")


if __name__ == "__main__":
    main()
