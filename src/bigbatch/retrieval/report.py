"""What evaluation and training print: the results table of ``bigbatch eval`` (and the JAX
demo), and the closing summary of ``bigbatch train`` (base against fine-tuned, on the full
split and on the unseen-document queries)."""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["format_eval_table", "print_summary", "duration", "finite", "json_text"]


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float (a metric of no query, a loss that
    overflowed) replaced by None, so that it is valid JSON (``null``): Python's ``json``
    writes ``NaN``, which no JSON reader accepts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def json_text(value: Any, indent: int | None = None) -> str:
    """``value`` as strict JSON (:func:`finite`: no NaN, no Infinity)."""
    return json.dumps(finite(value), indent=indent, allow_nan=False)


def format_eval_table(results: list[dict]) -> str:
    """One row per model (and per query subset): nDCG@10, R@1/5/10, MRR@10, similarities."""
    keys = ("ndcg@10", "recall@1", "recall@5", "recall@10", "mrr@10", "pos_sim", "margin")
    limit = 60  # a longer name keeps its end (the part that tells runs apart), after "..."

    def short(name: str) -> str:
        return name if len(name) <= limit else "..." + name[-(limit - 3):]

    names = [short(str(r["model"])) for r in results]
    width = max(12, *(len(n) + len(" [unseen]") for n in names)) + 2
    lines = [f"{'model':<{width}}{'queries':>9}" + "".join(f"{k:>11}" for k in keys)]
    for prefix, label in (("", ""), ("unseen/", " [unseen]")):
        for r in results:
            m = r["metrics"]
            if f"{prefix}ndcg@10" not in m:
                continue
            name = short(str(r["model"])) + label
            lines.append(f"{name:<{width}}{int(m[prefix + 'queries']):>9}"
                         + "".join(f"{m[prefix + k]:>11.4f}" for k in keys))
    return "\n".join(lines)


def duration(seconds: float) -> str:
    """``"42 s"`` under two minutes, else ``"3.5 min"``."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def print_summary(summary: dict, best_metric: str = "ndcg@10", split: str = "test") -> None:
    """The result table (base and fine-tuned, on the full split and, when they are not all
    of them, on the unseen-document queries; ``best_metric``'s column included), where
    ``best/`` came from, and one closing line."""
    base, final = summary.get("base"), summary.get("final")
    if final:
        keys = [k for k in ("ndcg@10", "recall@1", "recall@5", "recall@10", "mrr@10", "margin")
                if k in final]
        metric = best_metric.removeprefix("unseen/")
        if metric in final and metric not in keys:
            keys.append(metric)
        rows = [(f"full {split} split", "")]
        if final.get("unseen/queries") != final.get("queries"):  # else the same rows again
            rows.append(("unseen-document queries", "unseen/"))
        print(f"\n{'':<42}" + "".join(f"{k:>11}" for k in keys))
        for label, prefix in rows:
            if f"{prefix}ndcg@10" not in final:
                continue
            for name, m in (("base", base), ("fine-tuned", final)):
                if m is None:
                    continue
                n = int(m.get(f"{prefix}queries", 0))
                print(f"{name + ', ' + label + f' ({n})':<42}"
                      + "".join(f"{m.get(prefix + k, float('nan')):>11.4f}" for k in keys))
        print()
    if summary.get("best") is not None:
        print(f"best/: step {summary['best_step']}, {best_metric} {summary['best']:.4f}")
    print(f"done: {summary['steps']} steps in {duration(summary.get('seconds', 0.0))}; "
          f"model in {summary['final_model']}")
