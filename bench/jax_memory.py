"""Peak memory of the JAX GradCache step against batch size, from the compiled program:
``jax.jit(step).lower(...).compile().memory_analysis()`` (XLA's buffer assignment: the
temporary bytes the program needs beside its arguments and outputs), without running it.

Model: all-MiniLM-L6-v2's BERT (bigbatch.jax.bert, 6 layers, width 384; random weights,
only the shapes matter) in train mode (dropout on), InfoNCE over queries and documents of
--max-length tokens (k = 0). Contenders at each batch size: the cached step
(``cached_value_and_grad`` with --chunk rows per chunk) and plain ``jax.value_and_grad``
of the same loss over the whole batch.

    python bench/jax_memory.py --batches 256,1024 --chunk 32 --max-length 32

Writes bench/results/jax-memory-cpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, now

MIB = 2 ** 20


def compiled_memory(step, params, batch, rng) -> dict:
    """The compiled program's memory figures, in MiB, and the compile time."""
    import jax

    t0 = time.time()
    stats = jax.jit(step).lower(params, batch, rng).compile().memory_analysis()
    return {"temp_mib": stats.temp_size_in_bytes / MIB,
            "argument_mib": stats.argument_size_in_bytes / MIB,
            "output_mib": stats.output_size_in_bytes / MIB,
            "compile_s": round(time.time() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="256,1024", help="query counts, comma-separated")
    ap.add_argument("--chunk", type=int, default=32, help="rows per chunk of the cached step")
    ap.add_argument("--max-length", type=int, default=32, help="tokens per row")
    ap.add_argument("--layers", type=int, default=6, help="BERT layers (MiniLM: 6)")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from bigbatch.jax import InfoNCE, cached_value_and_grad, embed_batch
    from bigbatch.jax.bert import BertConfig, BertEncoder, bert_embed_fn

    model = BertEncoder(BertConfig(num_hidden_layers=args.layers))
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32),
                                               jnp.ones((1, 2), jnp.int32)))["params"]
    loss = InfoNCE(temperature=0.05)
    params = {"model": shapes,
              **{k: jax.ShapeDtypeStruct((), jnp.float32) for k in loss.init_params()}}
    embed = bert_embed_fn(model)
    rng = jax.random.key(0)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        tokens = {k: jax.ShapeDtypeStruct((b, args.max_length), jnp.int32)
                  for k in ("input_ids", "attention_mask")}
        batch = {"query": tokens, "doc": tokens}
        cached = cached_value_and_grad(embed, loss, args.chunk)

        def plain(p, data, key, b=b):
            def value(q):
                return loss(q, embed_batch(embed, q, data, key, b))
            (val, metrics), grads = jax.value_and_grad(value, has_aux=True)(p)
            return val, metrics, grads

        for name, step in (("bigbatch.jax cached", cached), ("plain value_and_grad", plain)):
            row = {"method": name, "batch": b, "chunk": args.chunk if "cached" in name else b,
                   **compiled_memory(step, params, batch, rng)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    result = {"what": "compiled temp memory of one step (XLA memory_analysis), MiniLM-shaped "
                      "BERT in train mode, InfoNCE k=0", "date": now(),
              "command": "python " + " ".join(sys.argv), "machine": machine("cpu"),
              "jax": jax.__version__, "max_length": args.max_length, "layers": args.layers,
              "rows": rows}
    out = RESULTS / "jax-memory-cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'method':<24}{'batch':>7}{'chunk':>7}{'temp MiB':>11}{'args MiB':>11}")
    for r in rows:
        print(f"{r['method']:<24}{r['batch']:>7}{r['chunk']:>7}{r['temp_mib']:>11.1f}"
              f"{r['argument_mib']:>11.1f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
