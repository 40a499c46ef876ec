"""Record a mining run as a results file: ``bench/results/mining-scifact-k<N>.json``.

Runs ``bigbatch mine`` with all-MiniLM-L6-v2 on SciFact train (the command the SciFact
recipe study mines with: 3 negatives, ranks 0 to 100, candidates above 95% of the
positive's score dropped, the model's scores written) and keeps its report (candidates
seen, dropped as positives, as copies, as likely false negatives, records written and left
short) beside the machine, the command and the wall time; the mined file itself stays in
``runs/``::

    python bench/mining.py                      # -> bench/results/mining-scifact-k3.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, SCIFACT, machine, minilm_path, now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-negatives", type=int, default=3)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "mining" / "mined.jsonl",
                    help="the mined file (its report beside it)")
    ap.add_argument("--note", default="", help="what else ran on the machine")
    args = ap.parse_args()
    command = ["bigbatch", "mine", "--model", "all-MiniLM-L6-v2", "--data", "SCIFACT", "--split",
               "train", "--output", "mined.jsonl", "--num-negatives", str(args.num_negatives),
               "--scores", "--max-length", str(args.max_length)]
    argv = [sys.executable, "-m", "bigbatch.cli", *command[1:]]
    argv[argv.index("all-MiniLM-L6-v2")] = minilm_path()
    argv[argv.index("SCIFACT")] = str(SCIFACT)
    argv[argv.index("mined.jsonl")] = str(args.out)
    start = time.perf_counter()
    subprocess.run(argv, check=True)
    seconds = time.perf_counter() - start
    report = json.loads(Path(f"{args.out}.report.json").read_text())
    out = RESULTS / f"mining-scifact-k{args.num_negatives}.json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": now(), "machine": machine("cpu"),
                               "command": " ".join(command), "seconds": round(seconds, 1),
                               "note": args.note, "report": report}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
