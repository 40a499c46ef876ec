"""Run by tests/integrations/test_hf_trainer.py, on one process or under
``accelerate launch --num_processes 2 --cpu``: one optimizer step of bigbatch's
GradCacheTrainer (transformers.Trainer) and one of a hand-written accelerate loop
(gradcache_loss + accelerator.backward), float64, on a tiny BERT TextEncoder with dropout.
Each rank writes the batches it trained on, the random state each step started from and its
gradients to --out, for the global-batch reference;
both runs accumulate gradients over 2 micro-batches."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch

B_LOCAL, CHUNK, ACCUMULATE = 4, 3, 2
TEMPERATURE = 0.05


def pairs(n: int) -> list[dict[str, str]]:
    return [{"query": f"question {i} about topic {i * 7 % 5}",
             "doc": f"answer {i} " + "words " * (i % 3 + 1)} for i in range(n)]


def make_encoder(path: str):
    from bigbatch.encoders import TextEncoder

    return TextEncoder(path, max_length=32, dtype=torch.float64)


def collate(encoder):
    def fn(rows: list[dict[str, str]]) -> dict:
        return {"query": encoder.tokenize([r["query"] for r in rows], "query"),
                "doc": encoder.tokenize([r["doc"] for r in rows], "doc")}
    return fn


def make_loss():
    import bigbatch as bb

    loss = bb.InfoNCE(temperature=TEMPERATURE).double()
    with torch.no_grad():  # exactly 1/0.05 in float64
        loss.logit_scale.log_scale.fill_(math.log(1 / TEMPERATURE))
    return loss


def record(batch: dict) -> dict:
    """A micro-batch and the random state its step starts from (its dropout masks follow)."""
    return {"batch": {k: {f: t.clone() for f, t in v.items()} for k, v in batch.items()},
            "rng": torch.get_rng_state()}


def grads_of(encoder, loss) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in encoder.named_parameters() if p.grad is not None}
    out["loss.log_scale"] = loss.logit_scale.log_scale.grad.detach().clone()
    return out


def run_trainer(model_path: str, out: Path, rank: int) -> None:
    from transformers import TrainerCallback, TrainingArguments

    from bigbatch.integrations.hf import GradCacheTrainer

    encoder, loss = make_encoder(model_path), make_loss()
    seen: list[dict] = []

    class Recording(GradCacheTrainer):
        def compute_loss(self, model, inputs, *a, **kw):
            if torch.is_grad_enabled():
                seen.append(record(inputs))
            return super().compute_loss(model, inputs, *a, **kw)

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            torch.save({"grads": grads_of(encoder, loss), "batches": seen},
                       out / f"trainer_rank{rank}.pt")

    args = TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=B_LOCAL, max_steps=1,
        gradient_accumulation_steps=ACCUMULATE, learning_rate=1e-3, max_grad_norm=0.0,
        report_to="none", save_strategy="no", use_cpu=True, seed=0,
        logging_strategy="no", disable_tqdm=True, dataloader_drop_last=True)
    trainer = Recording(model=encoder, args=args, train_dataset=pairs(4 * B_LOCAL * ACCUMULATE),
                        data_collator=collate(encoder), loss_fn=loss, chunk_size=CHUNK,
                        callbacks=[Capture()])
    trainer.train()
    # the Trainer's evaluation (the loss, chunk by chunk) and saving (a bigbatch encoder folder)
    metrics = trainer.evaluate(eval_dataset=pairs(B_LOCAL * 2))
    trainer.save_model(str(out / "trainer_saved"))
    if rank == 0:
        (out / "trainer_eval.json").write_text(json.dumps(metrics))


def run_accelerate(model_path: str, out: Path, rank: int) -> None:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    import bigbatch as bb
    from bigbatch.integrations.deferred import gradcache_loss

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    encoder, loss_fn = make_encoder(model_path), make_loss()
    optimizer = torch.optim.AdamW(list(encoder.parameters()) + list(loss_fn.parameters()), lr=1e-3)
    loader = DataLoader(pairs(4 * B_LOCAL * ACCUMULATE), batch_size=B_LOCAL,
                        collate_fn=collate(encoder))
    model, optimizer, loader = accelerator.prepare(encoder, optimizer, loader)
    cache = bb.GradCache({"query": model, "doc": model}, loss_fn, chunk_size=CHUNK)
    model.train()  # dropout on
    seen = []
    for batch in loader:
        with accelerator.accumulate(model):
            seen.append(record(batch))
            loss = gradcache_loss(cache, **batch)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                torch.save({"grads": grads_of(encoder, loss_fn), "batches": seen},
                           out / f"accelerate_rank{rank}.pt")
                break
            optimizer.step()
            optimizer.zero_grad()
            loss_fn.clamp_()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", required=True)
    a = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    out = Path(a.out)
    run_trainer(a.model, out, rank)
    run_accelerate(a.model, out, rank)
    print(f"rank {rank} of {os.environ.get('WORLD_SIZE', '1')}: done")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
