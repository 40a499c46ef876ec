"""Run logs: ``metrics.jsonl`` (one JSON object per logged step or evaluation), the
reporters ``--report-to`` names (:data:`REPORTERS`: TensorBoard event files when the
``tensorboard`` package is installed, a Weights & Biases run), the evaluation rows printed
during training (a table: a header, then one row per evaluation) and a PNG of the training
loss and evaluation metrics at the end (matplotlib)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ..retrieval.report import json_text
from .durable import fsync_dir, write_errors, write_text_atomic

__all__ = ["RunLogger", "plot_metrics", "truncate_metrics", "eval_columns", "format_eval_row",
           "REPORTERS", "check_reporters"]

# the metrics an evaluation row shows (those the evaluation has), then --best-metric's
EVAL_SHOWN = ("ndcg@10", "recall@1", "recall@10", "mrr@10", "unseen/ndcg@10")


def eval_columns(metrics: dict[str, float], best_metric: str) -> list[str]:
    """The columns of the evaluation rows: :data:`EVAL_SHOWN` that ``metrics`` has (with
    several evaluation sets, their means), each set's ``<name>/ndcg@10``, and
    ``best_metric`` (the one that selects ``best/``) when it is not among them."""
    columns = [k for k in EVAL_SHOWN if k in metrics]
    columns += [k for k in metrics if k.endswith("/ndcg@10") and k.count("/") == 1
                and k not in columns]
    if best_metric in metrics and best_metric not in columns:
        columns.append(best_metric)
    return columns


def format_eval_row(step: int | str | None, metrics: dict[str, float],
                    columns: list[str]) -> str:
    """One printed evaluation row (``step`` None: the header naming ``columns``; a name, such
    as ``merged``, in place of the step for a model other than the trained one's)."""
    cells = [f"{c:>{max(len(c), 7)}}" if step is None
             else f"{metrics.get(c, float('nan')):>{max(len(c), 7)}.4f}" for c in columns]
    return f"{'eval':<5}{'step' if step is None else step:>7}  " + "  ".join(cells)


def truncate_metrics(path: str | Path, step: int) -> int:
    """Keep only the rows of a ``metrics.jsonl`` with ``step <= step``, replacing the file
    atomically (a temporary file renamed over it); returns how many rows were dropped.

    A run resumed from the checkpoint of ``step`` logs every later step again, so the rows a
    killed run wrote after its last checkpoint (or an abandoned timeline's) must go first. A
    torn last line (a kill in the middle of a write) is dropped too.
    """
    path = Path(path)
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    kept = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:  # torn by a kill mid-write
                continue
            kept.append(line)  # not ours to judge
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) \
                or rec["step"] <= step:
            kept.append(line)
    dropped = len(lines) - len(kept)
    if dropped:
        write_text_atomic(path, "".join(line + "\n" for line in kept))
        fsync_dir(path.parent)
    return dropped


class _TensorBoard:
    """TensorBoard event files in ``<output_dir>/tensorboard``; nothing when the
    ``tensorboard`` package is missing (an optional extra). Rows after ``resume_step`` are
    hidden (``purge_step``), as a resumed run logs them again."""

    def __init__(self, out: Path, resume_step: int | None, name: str,
                 settings: dict[str, Any]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            self.writer = None
            return
        purge = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=purge)

    def log(self, step: int, values: dict[str, float], kind: str) -> None:
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(f"{kind}/{k}", v, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class _WandB:
    """A Weights & Biases run (``wandb``, imported here) named after the output folder, in
    the project ``$WANDB_PROJECT`` (default ``bigbatch``), files under the output folder;
    ``WANDB_MODE=offline`` keeps it on this machine (``wandb sync`` uploads it later)."""

    def __init__(self, out: Path, resume_step: int | None, name: str,
                 settings: dict[str, Any]) -> None:
        import os

        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "bigbatch"), name=name,
                              dir=str(out), config=settings, reinit="finish_previous")

    def log(self, step: int, values: dict[str, float], kind: str) -> None:
        self.run.log({f"{kind}/{k}": v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


# --report-to: name -> (reporter, the package it needs, or None)
REPORTERS: dict[str, tuple[type, str | None]] = {
    "tensorboard": (_TensorBoard, None),  # optional: skipped when tensorboard is missing
    "wandb": (_WandB, "wandb"),
}


def check_reporters(names: list[str]) -> None:
    """Raise :class:`~bigbatch.errors.ConfigError` for a reporter whose package is missing
    (before the run starts)."""
    import importlib.util

    from ..errors import ConfigError

    for name in names:
        package = REPORTERS.get(name, (None, None))[1]
        if package and importlib.util.find_spec(package) is None:
            raise ConfigError(f"--report-to {name}: the {package!r} package is not installed "
                              f"(pip install {package}, or in a bigbatch clone pip install -e "
                              f"'.[{name}]')")


class RunLogger:
    """Append-only metrics log for the main process, and the reporters ``report_to`` names
    (:data:`REPORTERS`; ``"none"`` or an empty list: ``metrics.jsonl`` alone).

    ``resume_step``: the step of the checkpoint a resumed run starts from. Rows logged after
    it (by the run that was killed, or by an abandoned timeline) are removed from
    ``metrics.jsonl`` and hidden from TensorBoard (``purge_step``), as they are logged again.
    ``name`` and ``settings``: the run's name and options, for the reporters that show them.
    """

    def __init__(self, output_dir: str | Path, enabled: bool = True,
                 resume_step: int | None = None,
                 report_to: tuple[str, ...] | list[str] = ("tensorboard",),
                 name: str | None = None, settings: dict[str, Any] | None = None) -> None:
        self.dir = Path(output_dir)
        self.enabled = enabled
        self.path = self.dir / "metrics.jsonl"
        self.reporters: list[Any] = []
        if enabled:
            if resume_step is not None:
                truncate_metrics(self.path, resume_step)
            for r in report_to:
                if r != "none":
                    self.reporters.append(REPORTERS[r][0](self.dir, resume_step,
                                                          name or self.dir.name,
                                                          settings or {}))

    @property
    def tb(self) -> Any:
        """The TensorBoard writer, or None."""
        return next((r.writer for r in self.reporters if isinstance(r, _TensorBoard)), None)

    def log(self, step: int, values: dict[str, Any], kind: str = "train") -> None:
        """Append one row (``kind`` "train", "eval" or "merged", ``--merge-last``'s model)
        for ``step``."""
        if not self.enabled:
            return
        rec = {"kind": kind, "step": step, "time": round(time.time(), 3)}
        rec.update({k: (float(v) if isinstance(v, (int, float)) else v) for k, v in values.items()})
        line = json_text(rec) + "\n"  # a NaN loss is null: every row stays valid JSON
        with write_errors(self.path, f"continue with --resume {self.dir}"), \
                open(self.path, "a") as f:
            size = f.tell()
            try:
                f.write(line)
                f.flush()
            except OSError:
                f.truncate(size)  # no torn row left (a resume drops one anyway)
                raise
        numbers = {k: v for k, v in values.items() if isinstance(v, (int, float))}
        for reporter in self.reporters:
            reporter.log(step, numbers, kind)

    def close(self) -> None:
        """Flush and close the reporters (once)."""
        reporters, self.reporters = self.reporters, []
        for reporter in reporters:
            reporter.close()


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
        if rec["kind"] in ("train", "eval"):  # (not a refresh's or a merged model's row)
            (train if rec["kind"] == "train" else evals).append(rec)
    if evals:  # a second panel only when there are evaluations to show
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    else:
        fig, ax1 = plt.subplots(1, 1, figsize=(6, 4))
    if train:
        ax1.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1)
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss")
    ax1.set_title("training loss")
    if evals:
        for key in eval_keys:
            pts = [(r["step"], r[key]) for r in evals if key in r]
            if pts:
                ax2.plot(*zip(*pts), marker="o", label=key)
        ax2.set_xlabel("step")
        ax2.set_title("evaluation")
        ax2.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return Path(out_path)
