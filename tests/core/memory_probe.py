"""Run one GradCache step in this process and print, as JSON, the growth of its resident
high-water mark over the step and bigbatch.train.memory_estimate's estimate (run by
tests/core/test_memory.py in a subprocess per configuration, so that each step has a fresh
high-water mark).

    python tests/core/memory_probe.py BATCH --k K --chunk C --dim D [--ids] [--dense] [--sort]

Prints {"skipped": reason} where the high-water mark cannot be reset (not Linux)."""

from __future__ import annotations

import argparse
import gc
import json
import re
from pathlib import Path

import torch
from torch import nn

import bigbatch as bb
from bigbatch.train.memory_estimate import activation_bytes, estimate_step_memory


class Tower(nn.Module):
    """Token embedding, dropout, a residual MLP, masked mean pooling, L2 norm."""

    def __init__(self, vocab: int = 1000, dim: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.drop = nn.Dropout(0.1)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, input_ids, attention_mask):
        h = self.drop(self.emb(input_ids))
        h = h + self.mlp(h)
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp_min(1), dim=-1)


def tokens(n: int, length: int = 32, vocab: int = 1000) -> dict:
    lengths = torch.randint(4, length + 1, (n,))
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return {"input_ids": torch.randint(1, vocab, (n, length)) * mask, "attention_mask": mask}


def rss_mb(field: str) -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, flags=re.M).group(1)) / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("batch", type=int)
    ap.add_argument("--k", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ids", action="store_true")
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--sort", action="store_true", help="sort_by_length=True")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Tower(dim=a.dim)
    loss_fn = bb.InfoNCE(temperature=0.05, dense=a.dense)
    cache = bb.GradCache({"query": model, "doc": model}, loss_fn, chunk_size=a.chunk,
                         sort_by_length=a.sort)
    n_docs = a.batch * (1 + a.k)

    def step(b: int) -> None:
        extra = {"doc_ids": torch.arange(b * (1 + a.k)) % (b * (1 + a.k) - 1)} if a.ids else {}
        cache.step(query=q if b == a.batch else tokens(b), doc=d if b == a.batch else
                   tokens(b * (1 + a.k)), **extra)

    q, d = tokens(a.batch), tokens(n_docs)
    step(a.chunk)  # warm-up: lazy set-up of torch's kernels and autograd
    probe = activation_bytes(lambda: model(**tokens(a.chunk)), model.parameters())
    for p in [*model.parameters(), *loss_fn.parameters()]:
        p.grad = None
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as e:
        print(json.dumps({"skipped": f"cannot reset the high-water mark: {e}"}))
        return
    before = rss_mb("VmRSS")
    step(a.batch)
    growth = rss_mb("VmHWM") - before
    est = estimate_step_memory(
        {"query": a.batch, "doc": n_docs}, a.dim, chunk_size=a.chunk,
        chunk_activation_bytes=probe,
        parameter_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        dense=a.dense, masked=a.ids)
    print(json.dumps({"growth_mb": growth} | est.as_mb()))


if __name__ == "__main__":
    main()
