"""The check that a run changed its model and that ``final/`` holds what it trained.

Before step 1 the starting model embeds a handful of the training data's texts (the queries
and positives of :data:`SAMPLE_RECORDS` records spread over the data); the embeddings go
into the run's state, so a resumed run has them too. At the end, once ``final/`` is
written, the trained model in memory embeds them again and ``final/``, reloaded into a fresh
encoder (as every user of the run loads it), embeds them once more:

- the reloaded ``final/`` must embed them as the model in memory does, to the round-off of
  the weights' dtype (:data:`REPRODUCE_TOLERANCE`); if not, the saved folder is not the
  trained model and the run ends with :class:`~bigbatch.errors.OutputError`;
- the trained model must embed them differently from the starting model (by more than
  :data:`CHANGE_FRACTION` of that round-off); if not, its trainable weights (or adapter)
  did not move, and the run ends with :class:`~bigbatch.errors.ConfigError` (a learning rate
  too small for the weights' dtype, parameters frozen by mistake).

Distances are per text, relative to the embedding's norm (the largest is reported). Under
torchrun every rank embeds the texts with the model in memory (the same calls on every
rank, as a sharded model needs), the main rank alone reloads ``final/`` and compares, and
every rank raises what it found. A half that cannot be done (no starting embeddings in the
checkpoint a run resumed from) is said in the log line, never passed over silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..engine import distributed as D
from ..engine.embeddings import TokenEmbeddings
from ..errors import ConfigError, OutputError
from .main_rank import from_main

__all__ = ["SAMPLE_RECORDS", "REPRODUCE_TOLERANCE", "CHANGE_FRACTION", "STATE_KEY",
           "sample_indices", "embed_sample", "start_state", "check_final", "distance",
           "compute_dtype"]

SAMPLE_RECORDS = 4  # records whose query and positive are embedded (8 texts)
STATE_KEY = "change_check"  # in the run's state: the records' indices, the start embeddings
# round-off allowed between the trained model in memory and final/ reloaded, by the dtype of
# the weights (relative to the embedding's norm)
REPRODUCE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 2e-2,
                       torch.float16: 5e-3}
# the trained model differs from the starting one when some text moved by more than this
# fraction of that round-off (a deterministic model whose weights did not move: 0)
CHANGE_FRACTION = 0.01


def sample_indices(n_records: int, n: int = SAMPLE_RECORDS) -> list[int]:
    """``n`` record indices spread evenly over ``n_records`` (all of them when fewer)."""
    if n_records <= n:
        return list(range(n_records))
    return sorted({round(j * (n_records - 1) / (n - 1)) for j in range(n)})


def _rows(out: Any) -> torch.Tensor:
    """An encoder's output as one float64 row per text (token embeddings: the real tokens'
    vectors, flattened)."""
    if isinstance(out, TokenEmbeddings):
        values, mask = out
        out = (values * mask.unsqueeze(-1).to(values.dtype)).flatten(1)
    return out.detach().to(torch.float64).cpu()


@torch.no_grad()
def embed_sample(encoder: Any, records: Any, indices: Sequence[int], batch_size: int,
                 device: torch.device | str) -> list[torch.Tensor]:
    """The embeddings of the sample's queries and of its positives (two tensors, float64 on
    the CPU), by ``encoder`` in eval mode (its training mode restored)."""
    picked = [records[i] for i in indices]
    queries = encoder.encode([r.query for r in picked], side="query", batch_size=batch_size,
                             device=device)
    docs = encoder.encode([r.positive for r in picked], side="doc", batch_size=batch_size,
                          device=device)
    return [_rows(queries), _rows(docs)]


def start_state(encoder: Any, records: Any, batch_size: int,
                device: torch.device | str) -> dict[str, Any]:
    """What the run's state keeps of the starting model (before step 1; every rank): the
    sample's record indices and their embeddings (lists of floats, as a checkpoint reads
    them back safely)."""
    indices = sample_indices(len(records))
    embedded = embed_sample(encoder, records, indices, batch_size, device)
    return {"indices": indices, "start": [e.tolist() for e in embedded]}


def distance(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """The largest distance between two sets of embeddings, text by text, relative to the
    norm of ``b``'s."""
    worst = 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape:
            return float("inf")
        diff = (x - y).flatten(1).norm(dim=1) / y.flatten(1).norm(dim=1).clamp_min(1e-30)
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
    return worst


def _weights_dtype(encoder: Any) -> torch.dtype:
    floats = [p.dtype for p in encoder.parameters() if p.is_floating_point()]
    return floats[0] if floats else torch.float32


def compute_dtype(encoder: Any, run_dtype: str = "float32") -> torch.dtype:
    """The dtype the model in memory embeds in, which its reloaded copy is cast to: its
    weights' dtype, or for a sharded model the dtype it gathers and computes its weights
    in (``--fsdp --dtype bfloat16``: bfloat16), whichever is coarser."""
    from .sharding import is_sharded

    dtypes = [_weights_dtype(encoder)]
    if is_sharded(encoder):
        dtypes.append(getattr(torch, run_dtype, torch.float32))
    return max(dtypes, key=lambda d: REPRODUCE_TOLERANCE.get(d, 1e-4))


def check_final(encoder: Any, records: Any, saved: dict[str, Any] | None, final: Path,
                info: D.WorldInfo, batch_size: int, device: torch.device | str,
                hint: str, run_dtype: str = "float32") -> str:
    """The end-of-run check (every rank calls it, after ``final/`` is written): returns the
    log line; raises on every rank when it failed. ``saved``: what :func:`start_state` put
    in the run's state (None: a run resumed from a checkpoint without it). ``hint``: how to
    write ``final/`` again. ``run_dtype``: ``--dtype`` (see :func:`compute_dtype`).

    Raises:
        OutputError: ``final/``, reloaded, does not embed as the trained model does (or does
            not load).
        ConfigError: the trained model embeds as the starting model did: nothing trained.
    """
    from ..encoders.loading import load_encoder

    indices = saved["indices"] if saved else sample_indices(len(records))
    trained = embed_sample(encoder, records, indices, batch_size, device)  # (every rank)
    verdict: tuple[str, str] = ("ok", "")
    if info.is_main:
        dtype = compute_dtype(encoder, run_dtype)
        tol, tol_dtype = REPRODUCE_TOLERANCE.get(dtype, 1e-4), str(dtype).removeprefix("torch.")
        n = sum(len(e) for e in trained)
        try:
            fresh = load_encoder(final).to(device=device, dtype=dtype)
            reloaded = embed_sample(fresh, records, indices, batch_size, device)
            del fresh
        except Exception as e:  # noqa: BLE001 - whatever stops final/ from loading
            verdict = ("output", f"{final} does not load into a fresh encoder "
                                 f"({type(e).__name__}: {str(e)[:300]}); {hint}")
        else:
            off = distance(reloaded, trained)
            moved = distance(trained, [torch.tensor(x, dtype=torch.float64)
                                       for x in saved["start"]]) if saved else None
            if not off <= tol:
                verdict = ("output", f"{final} does not reproduce the trained model: "
                                     f"reloaded, it embeds {n} training texts up to {off:.1e} "
                                     f"away from the model in memory (the round-off of "
                                     f"{tol_dtype} is {tol:.0e}); the saved weights are not "
                                     f"the trained "
                                     f"ones; {hint}")
            elif moved is not None and not moved > tol * CHANGE_FRACTION:
                what = "LoRA adapter" if getattr(encoder, "is_lora", False) else \
                    "trainable weights"
                count = sum(getattr(p, "ds_numel", p.numel()) for p in encoder.parameters()
                            if p.requires_grad)
                verdict = ("config", f"training changed nothing: the trained model embeds "
                                     f"{n} training texts as the starting model did (largest "
                                     f"difference {moved:.1e}): its {what} ({count:,} "
                                     f"parameters that require gradients) did not move. "
                                     f"Check --lr (too small a "
                                     f"rate leaves {str(_weights_dtype(encoder)).removeprefix('torch.')} "
                                     f"weights as they were), that what should train requires "
                                     f"gradients, and the warnings about steps that cannot "
                                     f"teach; {final} holds the starting model")
            else:
                change = (f"moved from the starting model's by up to {moved:.1e}" if moved is
                          not None else "not compared with the starting model's (the "
                          "checkpoint this run resumed from predates the check): skipped")
                verdict = ("ok", f"checked {final.name}/: reloaded, it embeds {n} training "
                                 f"texts as the trained model does (largest difference "
                                 f"{off:.1e}, round-off {tol:.0e} for {tol_dtype}); their "
                                 f"embeddings {change}")
    kind, text = from_main(verdict, info)
    if kind == "output":
        raise OutputError(f"bigbatch train: {text}")
    if kind == "config":
        raise ConfigError(f"bigbatch train: {text}")
    return f"bigbatch train: {text}"
