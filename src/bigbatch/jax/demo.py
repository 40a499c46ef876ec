"""``make demo-jax``: fine-tune all-MiniLM-L6-v2 in JAX (the Flax BERT of
:mod:`bigbatch.jax.bert`) on SciFact with the cached step and Optax AdamW, and print the
base and fine-tuned retrieval metrics as ``make demo`` does.

The settings are ``make demo``'s (``configs/demo_scifact.yaml``): batch 128 in chunks of 32,
2 epochs, AdamW at 5e-5 with weight decay 0.01 (the temperature at 1e-3, without decay),
2 warmup steps then cosine decay, temperature 0.05 learnable, max length 256, seed 42.
The batches are bigbatch's (:class:`bigbatch.data.batches.EpochBatches` over
:func:`bigbatch.data.readers.beir_dir.beir_training_records`), a duplicate passage masked by its
content id; the metrics are :func:`bigbatch.retrieval.evaluate.evaluate_beir`'s on the model wrapped
as :class:`bigbatch.jax.encode.FlaxTextEncoder`.

    python -m bigbatch.jax.demo --model PATH --data ../shared/data/scifact
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "train", "lr_schedule"]


def lr_schedule(peak: float, warmup_steps: int, total_steps: int) -> Any:
    """Linear warmup from ``peak / warmup_steps`` to ``peak``, then cosine decay to 0 at
    ``total_steps`` (bigbatch train's ``cosine`` schedule), as an Optax schedule."""
    import jax.numpy as jnp

    span = max(1, total_steps - warmup_steps)

    def schedule(step: Any) -> Any:
        warm = (step + 1) / max(warmup_steps, 1)
        progress = jnp.minimum(1.0, (step - warmup_steps) / span)
        return peak * jnp.where(step < warmup_steps, warm, 0.5 * (1 + jnp.cos(math.pi * progress)))

    return schedule


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bigbatch.jax.demo",
                                 description="Fine-tune a BERT sentence encoder in JAX on a BEIR "
                                             "data set with the cached step; print the base and "
                                             "fine-tuned metrics.")
    ap.add_argument("--model", required=True, help="a BERT folder (config.json, model.safetensors, "
                                                   "tokenizer), e.g. all-MiniLM-L6-v2")
    ap.add_argument("--data", required=True, help="a BEIR folder (corpus.jsonl, queries.jsonl, "
                                                  "qrels/)")
    ap.add_argument("--train-split", default="train", help="qrels split to train on")
    ap.add_argument("--eval-split", default="test", help="qrels split to evaluate on")
    ap.add_argument("--batch-size", type=int, default=128, help="queries per step")
    ap.add_argument("--chunk", type=int, default=32, help="rows embedded at once")
    ap.add_argument("--epochs", type=int, default=2, help="passes over the training pairs")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps "
                                                              "(0: the epochs' steps)")
    ap.add_argument("--lr", type=float, default=5e-5, help="peak learning rate of the model")
    ap.add_argument("--logit-scale-lr", type=float, default=1e-3,
                    help="learning rate of the temperature")
    ap.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    ap.add_argument("--warmup-steps", type=int, default=2, help="linear warmup steps")
    ap.add_argument("--temperature", type=float, default=0.05, help="initial temperature")
    ap.add_argument("--max-length", type=int, default=256, help="tokens per text")
    ap.add_argument("--eval-batch-size", type=int, default=64, help="texts per evaluation batch")
    ap.add_argument("--seed", type=int, default=42, help="data order and dropout")
    return ap.parse_args(argv)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Evaluate, fine-tune, evaluate; returns ``{"base", "final", "steps", "seconds",
    "losses"}``."""
    import jax
    import numpy as np
    import optax

    from ..data.batches import EpochBatches
    from ..data.readers.beir_dir import beir_training_records
    from ..retrieval.evaluate import evaluate_beir
    from .bert import bert_embed_fn, load_bert
    from .encode import FlaxTextEncoder
    from .losses import InfoNCE, id_codes
    from .step import cached_value_and_grad

    t0 = time.time()
    records = beir_training_records(args.data, args.train_split)
    batches = EpochBatches(records, args.batch_size, seed=args.seed)
    total = args.max_steps or args.epochs * len(batches)
    model, bert = load_bert(args.model)
    encoder = FlaxTextEncoder(model, bert, args.model, args.max_length)

    def evaluate(label: str) -> dict[str, float]:
        t = time.time()
        out = evaluate_beir(encoder, args.data, args.eval_split, batch_size=args.eval_batch_size,
                            progress=False)
        print(f"{label}: ndcg@10 {out['ndcg@10']:.4f} ({time.time() - t:.0f} s)", flush=True)
        return out

    base = evaluate("base")
    loss = InfoNCE(temperature=args.temperature)
    params = {"model": bert, **loss.init_params()}
    labels = {"model": "model", **{k: "scale" for k in loss.init_params()}}
    optimizer = optax.multi_transform(
        {"model": optax.adamw(lr_schedule(args.lr, args.warmup_steps, total),
                              weight_decay=args.weight_decay),
         "scale": optax.adam(lr_schedule(args.logit_scale_lr, args.warmup_steps, total))},
        labels)
    state = optimizer.init(params)
    step = cached_value_and_grad(bert_embed_fn(model), loss, args.chunk)

    @jax.jit
    def update(params: Any, state: Any, batch: Any, key: Any, ids: Any) -> tuple:
        value, metrics, grads = step(params, batch, key, doc_ids=ids)
        updates, state = optimizer.update(grads, state, params)
        return loss.clamp(optax.apply_updates(params, updates)), state, value, metrics

    # one width per tower, the longest of its training texts: one compiled program, and
    # short queries are not padded to the documents' length
    widths = {side: encoder.tokenize(texts, args.max_length)["input_ids"].shape[1]
              for side, texts in (("query", [r.query for r in records]),
                                  ("doc", [r.positive for r in records]))}

    def tokens(texts: list[str], side: str) -> dict[str, Any]:
        enc = encoder.tokenize(texts, args.max_length)
        extra = widths[side] - enc["input_ids"].shape[1]
        return {k: np.pad(v, ((0, 0), (0, extra))) for k, v in enc.items()}

    rng = jax.random.key(args.seed)
    losses = []
    for n, b in zip(range(total), batches.iterate()):
        batch = {"query": tokens(b.queries, "query"), "doc": tokens(b.docs, "doc")}
        ids = id_codes(b.doc_ids, len(b.docs))
        params, state, value, metrics = update(params, state, batch, jax.random.fold_in(rng, n),
                                               ids)
        losses.append(float(value))
        print(f"step {n + 1}/{total}: loss {float(value):.4f}, accuracy "
              f"{float(metrics['accuracy']):.3f}, temperature {float(metrics['temperature']):.4f}",
              flush=True)
    encoder.params = params["model"]
    final = evaluate("fine-tuned")
    return {"base": base, "final": final, "steps": len(losses), "losses": losses,
            "seconds": time.time() - t0}


def print_table(result: dict[str, Any]) -> None:
    """The base and fine-tuned rows (``bigbatch eval``'s table, with the unseen-document
    queries' rows) and the wall time."""
    from ..retrieval.report import format_eval_table

    print("\n" + format_eval_table([{"model": "base", "metrics": result["base"]},
                                    {"model": "fine-tuned", "metrics": result["final"]}]))
    print(f"\ndone: {result['steps']} steps in {result['seconds'] / 60:.1f} min")


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    if not Path(args.data).is_dir():
        from ..errors import DataError

        raise DataError("--data must be a BEIR folder (corpus.jsonl, queries.jsonl, qrels/)",
                        path=args.data)
    result = train(args)
    print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
