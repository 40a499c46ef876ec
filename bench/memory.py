"""Peak memory of one training step against batch size, at a fixed chunk, each point in its
own process: resident memory on CPU, torch.cuda.max_memory_allocated on GPU.

Contenders: bigbatch GradCache with the streamed loss (InfoNCE's default automatic blocks,
or --block rows), bigbatch with the dense loss, and plain full-batch training (until it no
longer fits or --plain-max is reached). Model: all-MiniLM-L6-v2, or with --model tiny-bert a
randomly initialised 2-layer, 128-wide BERT (MiniLM's tokenizer and vocabulary), on SciFact
claim/abstract pairs cut to --max-length tokens.

Each point first runs one warm-up step at a batch of one chunk (lazy library set-up is not
the step's), measures one chunk's activations on a probe chunk, then resets the process's
high-water mark (Linux: /proc/self/clear_refs) and runs the measured step. Per point it
records the step's growth (peak during the step minus resident memory before it) beside
the floor that bigbatch.train.memory_estimate.estimate_step_memory computes from the shapes: cached
embeddings and their gradients, per-chunk random states and the parameters' gradients;
plus one loss block and one chunk's activations; and the ratio growth / (floor + block +
chunk).

    python bench/memory.py --model tiny-bert --batches 256,1024,4096,16384 --chunk 32

With --multivector the towers return one 128-d vector per token (a linear projection of the
last hidden states, L2 per token: ColBERT) and the loss is MaxSimInfoNCE: streamed (bounded
query x document blocks, recomputed in the backward) against dense (one block holding every
B x N x Tq x Td similarity); the floor's embeddings are rows x tokens x dim per tower.

    python bench/memory.py --multivector --batches 256,1024,4096,16384 --chunk 128

Writes bench/results/memory-<device>[-<model>].json (with --multivector:
multivector-memory-...json) and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    MODELS,
    RESULTS,
    machine,
    minilm,
    now,
    scifact_pairs,
    status_mb,
    tiny_bert,
    weights,
)


def _reset_peak() -> bool:
    """Reset the process's resident high-water mark to its current size (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


MULTIVECTOR_DIM = 128
SIMILARITY_COPIES = 2  # a MaxSim block's similarities and the masked copy its max reads


def load_multivector(name: str, device: str, max_length: int):
    """(tokenizer, tower function, parameters, width of one row's cached values) of a
    ColBERT tower over ``name``: last hidden states, a linear projection to 128 numbers,
    L2 per token, the attention mask as the token mask."""
    import torch

    import bigbatch as bb

    if name == "minilm":
        st = minilm(device)
        tok, bert = st.tokenizer, st[0].auto_model
    else:
        tok, bert = tiny_bert(add_pooling_layer=False)
    bert = bert.to(device).train()
    torch.manual_seed(0)
    proj = torch.nn.Linear(bert.config.hidden_size, MULTIVECTOR_DIM).to(device)

    def tower(input_ids, attention_mask, **rest):
        h = bert(input_ids=input_ids, attention_mask=attention_mask, **rest).last_hidden_state
        return bb.TokenEmbeddings(torch.nn.functional.normalize(proj(h), dim=-1),
                                  attention_mask)

    return tok, tower, [*bert.parameters(), *proj.parameters()], MULTIVECTOR_DIM * max_length


def load_model(name: str, device: str, max_length: int):
    """(tokenizer, tower function, parameters, embedding width) for ``name``."""
    import torch

    if name == "minilm":
        st = minilm(device)
        st.max_seq_length = max_length
        st.train()
        return st.tokenizer, lambda **f: st(dict(f))["sentence_embedding"], \
            list(st.parameters()), st.get_sentence_embedding_dimension()
    tok, bert = tiny_bert(add_pooling_layer=False)
    bert = bert.to(device)
    bert.train()

    def tower(input_ids, attention_mask, **rest):
        h = bert(input_ids=input_ids, attention_mask=attention_mask, **rest).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp_min(1), dim=-1)

    return tok, tower, list(bert.parameters()), 128


def point(mode: str, batch: int, chunk: int, max_length: int, device: str, block: int | None,
          model_name: str, multivector: bool = False) -> dict:
    import torch

    import bigbatch as bb
    from bigbatch.train.memory_estimate import activation_bytes, estimate_step_memory

    loader = load_multivector if multivector else load_model
    tokenizer, tower, params, dim = loader(model_name, device, max_length)
    queries, docs = scifact_pairs(batch)

    def tokenize(texts: list[str]) -> dict:
        # in blocks, padded to max_length: one call on 32k texts would raise the process's
        # high-water mark above the step's own peak (the engine trims each chunk anyway)
        # dict(...): keep the tensors, drop the BatchEncoding and its per-token records
        # (for abstracts cut to 32 tokens they held ~70 KB a text, 1.1 GB at 16,384)
        parts = [dict(tokenizer(texts[i:i + 1024], padding="max_length", truncation=True,
                                max_length=max_length, return_tensors="pt"))
                 for i in range(0, len(texts), 1024)]
        return {k: torch.cat([p[k] for p in parts]).to(device) for k in parts[0].keys()}

    q, d = tokenize(queries), tokenize(docs)
    if multivector:  # dense: one block of every query x document similarity
        loss_fn = bb.MaxSimInfoNCE(temperature=0.05, normalize_query=True, block_size=(
            batch, batch) if mode == "dense" else block).to(device)
    else:
        loss_fn = bb.InfoNCE(temperature=0.05, block_size=block, dense=mode == "dense").to(
            device)
    towers = {"query": tower, "doc": tower}

    def head(x: dict, n: int) -> dict:
        return {k: v[:n] for k, v in x.items()}

    def run(qq: dict, dd: dict) -> None:
        if mode == "plain":
            loss, _ = loss_fn(query=tower(**qq), doc=tower(**dd))
            loss.backward()
        else:
            bb.GradCache(towers, loss_fn, chunk_size=chunk).step(query=qq, doc=dd)

    run(head(q, chunk), head(d, chunk))  # warm-up: lazy set-up of the libraries
    probe = activation_bytes(lambda: tower(**head(d, chunk)), params)
    for p in [*params, *loss_fn.parameters()]:
        p.grad = None
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    reset = _reset_peak()
    before = status_mb("VmRSS") if reset else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    run(q, d)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    est = estimate_step_memory(
        {"query": batch, "doc": batch}, dim, chunk_size=chunk if mode != "plain" else batch,
        chunk_activation_bytes=probe * (batch // chunk if mode == "plain" else 1),
        parameter_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        block_size=block, dense=mode == "dense",
        max_block_logits=getattr(loss_fn, "max_block_logits", 2 ** 24),
        accelerators=int(device.startswith("cuda"))).as_mb()
    if multivector:  # the MaxSim block: its queries x documents x tokens x tokens
        from bigbatch.losses.maxsim import block_shape
        bq, bd = (batch, batch) if mode == "dense" else block_shape(
            batch, batch, max_length, max_length, block, loss_fn.max_block_elements)
        sims = SIMILARITY_COPIES * bq * bd * max_length ** 2 * 4 / 2 ** 20
        est["total"] += sims - est["loss_block"]
        est["loss_block"] = sims
    added = peak - before
    out = {"mode": mode, "batch": batch, "seconds": seconds, "peak_rss_mb": peak,
           "rss_before_step_mb": before, "peak_reset": reset,
           "step_added_mb": added, "floor_mb": est["floor"], "block_mb": est["loss_block"],
           "chunk_mb": est["chunk_activations"], "estimate_mb": est["total"],
           "parts_mb": est}
    key_added = added
    if device.startswith("cuda"):
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["cuda_before_step_mb"] = base / 2**20
        key_added = out["peak_cuda_mb"] - out["cuda_before_step_mb"]
    out["ratio"] = key_added / est["total"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="256,1024,4096,16384")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--max-length", type=int, default=32)
    ap.add_argument("--model", choices=sorted(MODELS), default="minilm")
    ap.add_argument("--block", type=int, default=None,
                    help="streamed loss block rows (default: InfoNCE's automatic blocks)")
    ap.add_argument("--plain-max", type=int, default=4096, help="largest plain full batch tried")
    ap.add_argument("--dense-max", type=int, default=4096, help="largest dense-loss batch tried")
    ap.add_argument("--multivector", action="store_true",
                    help="ColBERT towers (128-d token vectors) and MaxSimInfoNCE: streamed "
                    "blocks against one dense block; no plain full-batch contender")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per point (default: torch's; 1 on a shared machine)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per point")
    ap.add_argument("--out", default=None)
    ap.add_argument("--point", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    if args.point:
        mode, batch = args.point.split(":")
        print(json.dumps(point(mode, int(batch), args.chunk, args.max_length, args.device,
                               args.block, args.model, args.multivector)))
        return
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for mode, limit in (("streamed", None), ("dense", args.dense_max), ("plain", args.plain_max)):
            if (limit is not None and batch > limit) or (args.multivector and mode == "plain"):
                continue
            cmd = [sys.executable, __file__, "--point", f"{mode}:{batch}", "--chunk",
                   str(args.chunk), "--max-length", str(args.max_length), "--device",
                   args.device, "--model", args.model]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            if args.block is not None:
                cmd += ["--block", str(args.block)]
            if args.multivector:
                cmd.append("--multivector")
            try:
                # a fixed mmap threshold makes glibc return freed blocks to the system, so
                # peak RSS follows live memory instead of allocator fragmentation
                env = dict(os.environ, HF_HUB_OFFLINE="1", MALLOC_MMAP_THRESHOLD_="131072")
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                   env=env)
                if p.returncode != 0:
                    row = {"mode": mode, "batch": batch, "failed": p.stderr.strip()[-300:]}
                else:
                    row = json.loads(p.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                row = {"mode": mode, "batch": batch, "failed": f"over {args.timeout} s"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"benchmark": "memory", "date": now(), "machine": machine(args.device),
              "command": "python bench/memory.py " + " ".join(sys.argv[1:]),
              "settings": {k: v for k, v in vars(args).items() if k != "point"}
              | weights(args.model)
              | {"model": MODELS[args.model] + (", ColBERT towers (128-d token vectors), "
                                                 "MaxSimInfoNCE" if args.multivector else ""),
                 "data": "SciFact train pairs"},
              "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    dev = args.device.split(":")[0]
    name = f"memory-{dev}.json" if args.model == "minilm" else f"memory-{dev}-{args.model}.json"
    if args.multivector:
        # not memory-*.json: bench/report.py's single-vector tables read those
        name = "multivector-" + name
    out = Path(args.out or RESULTS / name)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n" + "\n".join(table(rows, args.device)))
    print(f"wrote {out}")


def table(rows: list[dict], device: str) -> list[str]:
    """Peak per contender, and the streamed step's growth beside its floor (MB)."""
    key = "peak_cuda_mb" if device.startswith("cuda") else "peak_rss_mb"
    head = (f"{'batch':>7}" + "".join(f"{m:>10}" for m in ("streamed", "dense", "plain"))
            + f"{'growth':>9}{'floor':>8}{'block':>8}{'chunk':>8}{'ratio':>7}")
    lines = [head + "   (peak MB per contender; streamed step: growth vs floor + block + "
             "chunk)"]
    for b in sorted({r["batch"] for r in rows}):
        cells = []
        for m in ("streamed", "dense", "plain"):
            r = next((r for r in rows if r["batch"] == b and r["mode"] == m), None)
            cells.append("-" if r is None else "failed" if "failed" in r else f"{r[key]:.0f}")
        line = f"{b:>7}" + "".join(f"{c:>10}" for c in cells)
        st = next((r for r in rows if r["batch"] == b and r["mode"] == "streamed"
                   and "ratio" in r), None)
        if st is not None:
            growth = st["ratio"] * st["estimate_mb"]
            line += (f"{growth:>9.0f}{st['floor_mb']:>8.1f}{st['block_mb']:>8.1f}"
                     f"{st['chunk_mb']:>8.1f}{st['ratio']:>7.2f}")
        lines.append(line)
    return lines


if __name__ == "__main__":
    main()
