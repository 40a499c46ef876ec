"""Run logs: ``metrics.jsonl`` (one JSON object per logged step or evaluation), TensorBoard
event files when the ``tensorboard`` package is installed, and a PNG of the training loss
and evaluation metrics at the end (matplotlib)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

__all__ = ["RunLogger", "plot_metrics"]


class RunLogger:
    """Append-only metrics log for the main process."""

    def __init__(self, output_dir: str | Path, enabled: bool = True) -> None:
        self.dir = Path(output_dir)
        self.enabled = enabled
        self.path = self.dir / "metrics.jsonl"
        self.tb = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(self.dir / "tensorboard"))
            except ImportError:  # tensorboard is an optional extra
                self.tb = None

    def log(self, step: int, values: dict[str, Any], kind: str = "train") -> None:
        if not self.enabled:
            return
        rec = {"kind": kind, "step": step, "time": round(time.time(), 3)}
        rec.update({k: (float(v) if isinstance(v, (int, float)) else v) for k, v in values.items()})
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(f"{kind}/{k}", v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def plot_metrics(metrics_path: str | Path, out_path: str | Path,
                 eval_keys: tuple[str, ...] = ("ndcg@10", "recall@10", "mrr@10")) -> Path | None:
    """Draw training loss and eval metrics against step into a PNG; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train, evals = [], []
    for line in Path(metrics_path).read_text().splitlines():
        rec = json.loads(line)
        (train if rec["kind"] == "train" else evals).append(rec)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        ax1.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1)
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss")
    ax1.set_title("training loss")
    for key in eval_keys:
        pts = [(r["step"], r[key]) for r in evals if key in r]
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=key)
    ax2.set_xlabel("step")
    ax2.set_title("evaluation")
    if evals:
        ax2.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return Path(out_path)
