"""``make demo-jax``: fine-tune all-MiniLM-L6-v2 in JAX (the Flax BERT of
:mod:`bigbatch.jax.bert`) on SciFact with the cached step and Optax AdamW, and print the
base and fine-tuned retrieval metrics as ``make demo`` does.

The settings are ``make demo``'s, read from its ``configs/demo_scifact.yaml`` (``--config``
for another file; a flag overrides one setting): the batch and its chunks, the epochs, AdamW's
learning rates and weight decay (the temperature's without decay), the warmup then cosine
decay, the learnable temperature, the max length, the seed. The batches are bigbatch's
(:class:`bigbatch.data.batches.EpochBatches` over
:func:`bigbatch.data.readers.beir_dir.beir_training_records`), a duplicate passage masked by
its content id; the metrics are :func:`bigbatch.retrieval.evaluate.evaluate_beir`'s on the
model wrapped as :class:`bigbatch.jax.encode.FlaxTextEncoder`. Both are PyTorch bigbatch, so
the two demos train on the same batches and are scored by the same code; ``bigbatch.jax``
itself imports no torch.

    python examples/jax_demo.py --model PATH --data ../shared/data/scifact
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo_scifact.yaml"

# the settings read from the YAML file: key (flag: --key-with-dashes) -> type, help
SETTINGS: dict[str, tuple[type, str]] = {
    "train_split": (str, "qrels split to train on"),
    "eval_split": (str, "qrels split to evaluate on"),
    "batch_size": (int, "queries per step"),
    "grad_cache_chunk": (int, "rows embedded at once"),
    "epochs": (int, "passes over the training pairs"),
    "lr": (float, "peak learning rate of the model"),
    "logit_scale_lr": (float, "learning rate of the temperature"),
    "weight_decay": (float, "AdamW weight decay"),
    "scheduler": (str, "learning-rate schedule (the demo runs cosine)"),
    "warmup_steps": (int, "linear warmup steps"),
    "temperature": (float, "initial temperature (learnable)"),
    "max_length": (int, "tokens per text"),
    "eval_batch_size": (int, "texts per evaluation batch"),
    "seed": (int, "data order and dropout"),
}


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


def read_settings(path: str | Path) -> dict[str, Any]:
    """The :data:`SETTINGS` of a ``bigbatch train`` YAML file (its other keys are left).

    Raises:
        ConfigError: a setting missing, of the wrong type, or a schedule other than cosine.
    """
    import yaml

    from bigbatch.errors import ConfigError

    values = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    missing = [k for k in SETTINGS if k not in values]
    if missing:
        raise ConfigError(f"{path}: the JAX demo reads {', '.join(missing)} from this file; "
                          f"add them")
    out = {}
    for key, (kind, _) in SETTINGS.items():
        value = values[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ConfigError(f"{path}: {key} must be {kind.__name__}, got {value!r}")
        out[key] = value
    if out["scheduler"] != "cosine":
        raise ConfigError(f"{path}: scheduler {out['scheduler']!r}: the JAX demo runs the "
                          f"cosine schedule")
    return out


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, each setting's default read from ``--config``."""
    ap = argparse.ArgumentParser(prog="python examples/jax_demo.py",
                                 description="Fine-tune a BERT sentence encoder in JAX on a BEIR "
                                             "data set with the cached step; print the base and "
                                             "fine-tuned metrics. Settings default to the "
                                             "--config file's.")
    ap.add_argument("--model", required=True, help="a BERT folder (config.json, model.safetensors, "
                                                   "tokenizer), e.g. all-MiniLM-L6-v2")
    ap.add_argument("--data", required=True, help="a BEIR folder (corpus.jsonl, queries.jsonl, "
                                                  "qrels/)")
    ap.add_argument("--config", default=str(CONFIG),
                    help="the bigbatch train YAML file the settings are read from "
                         "(default: make demo's configs/demo_scifact.yaml)")
    ap.add_argument("--max-steps", type=int, default=0,
                    help="stop after this many steps (default 0: the epochs' steps)")
    for key, (kind, text) in SETTINGS.items():
        ap.add_argument(f"--{key.replace('_', '-')}", dest=key, type=kind, default=None,
                        help=f"{text} (default: the --config file's {key})")
    args = ap.parse_args(argv)
    for key, value in read_settings(args.config).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Evaluate, fine-tune, evaluate; returns ``{"base", "final", "steps", "seconds",
    "losses"}``."""
    import jax
    import numpy as np
    import optax

    from bigbatch.data.batches import EpochBatches
    from bigbatch.data.readers.beir_dir import beir_training_records
    from bigbatch.jax.bert import bert_embed_fn, load_bert
    from bigbatch.jax.encode import FlaxTextEncoder
    from bigbatch.jax.losses import InfoNCE, id_codes
    from bigbatch.jax.step import cached_value_and_grad
    from bigbatch.retrieval.evaluate import evaluate_beir

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
    step = cached_value_and_grad(bert_embed_fn(model), loss, args.grad_cache_chunk)

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
    from bigbatch.retrieval.report import format_eval_table

    print("\n" + format_eval_table([{"model": "base", "metrics": result["base"]},
                                    {"model": "fine-tuned", "metrics": result["final"]}]))
    print(f"\ndone: {result['steps']} steps in {result['seconds'] / 60:.1f} min")


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if not Path(args.data).is_dir():
        from bigbatch.errors import DataError

        raise DataError("--data must be a BEIR folder (corpus.jsonl, queries.jsonl, qrels/)",
                        path=args.data)
    print_table(train(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
