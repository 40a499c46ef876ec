"""Run by tests/integrations/test_st_distributed.py under ``torchrun --nproc_per_node=2``:
one optimizer step of ``SentenceTransformerTrainer`` on a tiny BERT with dropout, with bigbatch's
CachedInfoNCELoss in float64 (gradients, each rank's batch and its random state at the step
written to --out), then one
step in float32 with bigbatch's loss and one with sentence-transformers'
CachedMultipleNegativesRankingLoss, counting the collectives of each step.

Counted per optimizer step: DDP's gradient buckets (a communication hook on every DDP model)
and the Python-level collectives (torch.distributed.all_reduce and friends, with their
sizes). A "gradient all-reduce" is a DDP bucket or an all-reduce of at least as many values
as the model has trainable parameters."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

COUNTS: dict[str, list] = {"ddp_buckets": [], "collectives": []}
COUNTING = [False]  # inside an optimizer step, outside DDP's own hook
B_LOCAL, CHUNK = 4, 2


def install_counters() -> None:
    from torch.nn.parallel import DistributedDataParallel

    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                 "reduce_scatter_tensor", "all_gather_object", "broadcast"):
        original = getattr(dist, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            if COUNTING[0]:
                t = args[0] if args and isinstance(args[0], torch.Tensor) else None
                COUNTS["collectives"].append([_name, int(t.numel()) if t is not None else -1])
            return _original(*args, **kwargs)

        setattr(dist, name, counted)

    init = DistributedDataParallel.__init__

    def ddp_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(state, bucket):
            counting = COUNTING[0]
            if counting:
                COUNTS["ddp_buckets"].append(int(bucket.buffer().numel()))
            COUNTING[0] = False  # the bucket's own all_reduce is counted as the bucket
            try:
                return allreduce_hook(state, bucket)
            finally:
                COUNTING[0] = counting

        self.register_comm_hook(None, hook)

    DistributedDataParallel.__init__ = ddp_init


def make_model(path: str, dtype: torch.dtype):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    model = SentenceTransformer(modules=[Transformer(path), Pooling(32, "mean")],
                                device="cpu").to(dtype)
    for name, p in model.named_parameters():
        if "pooler" in name:  # not used by sentence embeddings: DDP would wait for it
            p.requires_grad_(False)
    return model


def dataset():
    from datasets import Dataset

    n = 2 * B_LOCAL
    return Dataset.from_dict({
        "anchor": [f"question {i} about topic {i * 7 % 5}" for i in range(n)],
        "positive": [f"answer {i} " + "words " * (i % 3 + 1) for i in range(n)],
        "negative": [f"unrelated passage {i} " + "more " * (i % 2) for i in range(n)],
    })


def train_one_step(model, loss, out: Path, tag: str, capture: bool) -> dict:
    from sentence_transformers import (
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from transformers import TrainerCallback

    rank = int(os.environ["RANK"])
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            COUNTS["ddp_buckets"].clear()
            COUNTS["collectives"].clear()
            COUNTING[0] = True

        def on_pre_optimizer_step(self, args, state, control, **kw):
            COUNTING[0] = False
            if capture:
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                         if p.grad is not None}
                grads["loss.log_scale"] = loss.loss.info_nce.logit_scale.log_scale.grad.clone()
                torch.save(grads, out / f"{tag}_grads_rank{rank}.pt")

    args = SentenceTransformerTrainingArguments(
        output_dir=str(out / f"run_{tag}"), per_device_train_batch_size=B_LOCAL, max_steps=1,
        learning_rate=1e-3, max_grad_norm=0.0, report_to="none", save_strategy="no",
        use_cpu=True, ddp_backend="gloo", seed=0, dataloader_drop_last=True,
        logging_strategy="no", disable_tqdm=True)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset(),
                                         loss=loss, callbacks=[Probe()])
    trainer.train()
    buckets = list(COUNTS["ddp_buckets"])
    collectives = list(COUNTS["collectives"])
    grad_reduces = len(buckets) + sum(1 for name, n in collectives
                                      if name == "all_reduce" and n >= trainable)
    return {"ddp_buckets": buckets, "collectives": collectives,
            "gradient_all_reduces": grad_reduces, "trainable": trainable}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True)
    a = parser.parse_args()
    out = Path(a.out)
    torch.set_num_threads(1)
    install_counters()
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from bigbatch.integrations.sentence_transformers import CachedInfoNCELoss

    class Recording(CachedInfoNCELoss):
        """Keeps the batch this rank trained on, for the reference."""

        def forward(self, sentence_features, labels=None):
            features = list(sentence_features)
            self.seen = [{k: v.clone() if torch.is_tensor(v) else v for k, v in f.items()}
                         for f in features]
            self.rng = torch.get_rng_state()  # the dropout masks of the first pass follow
            return super().forward(features, labels)

    # 1. exactness: float64, learnable scale, dropout on
    model = make_model(a.model, torch.float64)
    loss = Recording(model, scale=20.0, mini_batch_size=CHUNK).double()
    with torch.no_grad():  # exactly 20 in float64, not float32's nearest value
        loss.loss.info_nce.logit_scale.log_scale.fill_(math.log(20.0))
    exact = train_one_step(model, loss, out, "exact", capture=True)
    rank = int(os.environ["RANK"])
    torch.save({"features": loss.seen, "rng": loss.rng}, out / f"exact_batch_rank{rank}.pt")

    # 2. counts at the same batch and chunk, float32
    bb_model = make_model(a.model, torch.float32)
    counts = {"bigbatch": train_one_step(bb_model, CachedInfoNCELoss(bb_model, mini_batch_size=CHUNK),
                                         out, "bb", False)}
    st_model = make_model(a.model, torch.float32)
    counts["sentence_transformers"] = train_one_step(
        st_model, CachedMultipleNegativesRankingLoss(st_model, mini_batch_size=CHUNK,
                                                     gather_across_devices=True),
        out, "st", False)
    counts["exact_run"] = exact
    if rank == 0:
        (out / "counts.json").write_text(json.dumps(counts, indent=1))
    print(f"rank {rank}: world {dist.get_world_size()}, gradient all-reduces per step: bigbatch "
          f"{counts['bigbatch']['gradient_all_reduces']}, sentence-transformers cached MNRL "
          f"{counts['sentence_transformers']['gradient_all_reduces']}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
