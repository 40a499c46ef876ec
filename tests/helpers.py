"""Helpers for the engine tests: toy towers (with dropout and padding) and references.
At the root of tests/: the engine tests of core/, distributed/, integrations/, jax/, pipeline/
and vision/ share it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

DT = torch.float64


class TokenTower(nn.Module):
    """Embedding + dropout + masked mean pooling + MLP + L2 norm, taking HF-style kwargs."""

    def __init__(self, vocab: int = 50, dim: int = 16, out: int = 8, p: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.drop = nn.Dropout(p)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Dropout(p), nn.Linear(dim, out))
        self.calls = 0
        self.grad_calls = 0

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        self.calls += 1
        self.grad_calls += int(torch.is_grad_enabled())
        h = self.drop(self.emb(input_ids))
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        # position-dependent mixing so that a wrong trim of left padding would change results
        pos = torch.arange(h.shape[1], dtype=h.dtype, device=h.device)
        pos = (pos - (attention_mask.cumsum(1) == 0).sum(1, keepdim=True)).clamp_min(0)
        h = h * (1 + 0.01 * pos.unsqueeze(-1))
        pooled = (h * m).sum(1) / m.sum(1).clamp_min(1)
        return nn.functional.normalize(self.mlp(pooled), dim=-1)


class DenseTower(nn.Module):
    """An MLP on feature tensors (positional input), with optional dropout."""

    def __init__(self, inp: int = 12, out: int = 8, p: float = 0.0, normalize: bool = True) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(inp, 24), nn.GELU(), nn.Dropout(p), nn.Linear(24, out))
        self.normalize = normalize
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        y = self.net(x)
        return nn.functional.normalize(y, dim=-1) if self.normalize else y


def token_batch(n: int, max_len: int = 12, vocab: int = 50, left: bool = False,
                gen: torch.Generator | None = None) -> dict[str, Tensor]:
    """A padded tokenized batch with rows of different lengths (right or left padded)."""
    lengths = torch.randint(2, max_len + 1, (n,), generator=gen)
    lengths[0] = max_len - 3  # no row fills the full width: trimming always has work
    ids = torch.randint(1, vocab, (n, max_len), generator=gen)
    cols = torch.arange(max_len)
    if left:
        mask = (cols[None, :] >= (max_len - lengths)[:, None]).long()
    else:
        mask = (cols[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def grads_of(*modules: nn.Module) -> dict[str, Tensor]:
    out = {}
    for i, m in enumerate(modules):
        for name, p in m.named_parameters():
            if p.grad is not None:
                out[f"{i}.{name}"] = p.grad.detach().clone()
    return out


def zero_grads(*modules: nn.Module) -> None:
    for m in modules:
        for p in m.parameters():
            p.grad = None


def call(tower: Callable, x: Any) -> Tensor:
    return tower(**x) if isinstance(x, Mapping) else tower(x)


def reference_step(towers: dict[str, Callable], loss_fn: nn.Module, inputs: dict[str, Any],
                   chunked: dict[str, list[Any]] | None = None, **loss_kwargs: Any) -> Tensor:
    """Full-batch loss and backward. With ``chunked``, each tower is run chunk by chunk with
    gradients (same order, so the same dropout masks as the engine's first pass)."""
    reps = {}
    for name, tower in towers.items():
        if chunked is not None and name in chunked:
            reps[name] = torch.cat([call(tower, c) for c in chunked[name]])
        else:
            reps[name] = call(tower, inputs[name])
    out = loss_fn(**reps, **loss_kwargs)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss.detach()


ERRORS: list[float] = []  # every float64 error measured, reported at the end of the run


def max_rel_err(got: dict[str, Tensor], ref: dict[str, Tensor], record: bool = True) -> float:
    """Largest |got - ref| / max|ref| over all parameters (each reference must be non-zero).

    A parameter whose gradient is analytically zero (an attention key bias: softmax does not
    change when a constant is added to every score) holds only rounding residue (~1e-20 in
    float64), so its scale is floored at 1e-6 of the largest gradient of any parameter;
    an error anywhere still shows at that floor."""
    assert got.keys() == ref.keys(), (sorted(got), sorted(ref))
    largest = max(v.abs().max().item() for v in ref.values())
    worst = 0.0
    for k in ref:
        scale = ref[k].abs().max().item()
        assert scale > 0, f"reference gradient of {k} is zero: the test would not catch errors"
        scale = max(scale, 1e-6 * largest)
        worst = max(worst, (got[k] - ref[k]).abs().max().item() / scale)
    if record and all(v.dtype == DT for v in ref.values()):
        ERRORS.append(worst)
    return worst


def trimmed_chunks(batch: dict[str, Tensor], size: int) -> list[dict[str, Tensor]]:
    """Cut a right-padded tokenized batch into chunks of ``size`` rows, each trimmed to its
    longest row, as the engine does (so a reference draws the same dropout mask shapes)."""
    n = batch["input_ids"].shape[0]
    out = []
    for lo in range(0, n, size):
        c = {k: v[lo:lo + size] for k, v in batch.items()}
        width = int(c["attention_mask"].sum(1).max())
        out.append({k: v[:, :width] for k, v in c.items()})
    return out
