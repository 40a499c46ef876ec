"""The accelerator's checks before its timings: GradCache's gradients equal the unchunked
reference in float64 on the device (dropout on, replayed by the device's generator), and
bf16 autocast against float32 (the cosine of each parameter's gradient).

Exactness: all-MiniLM-L6-v2's network (``--model minilm``; or the dry run's tiny BERT) in
float64, in train mode (dropout 0.1), on SciFact pairs cut to ``--max-length`` tokens. Each
case runs one GradCache step from a seed, then the reference from the same seed: the same
rows, with gradients, in the chunks the engine's first pass ran (so dropout draws the same
masks), one loss and one backward. Cases: chunks of 5 rows with and without the kept last
chunk, length ordering, a token budget (3 rows of the longest), and ``chunk_size="auto"``
with a budget above the plain step (one pass, the whole batch). The largest relative error over parameters is
``max |g - g_ref| / max |g_ref|`` per parameter (scale floored at 1e-6 of the largest).

bf16 against float32: one GradCache step of ``--batch`` pairs in float32 and one under bf16
autocast (dropout off, so only precision differs), then each parameter's gradient cosine
(parameters whose gradient is zero analytically, the attention key biases, left out: only
rounding is in them).

    python bench/gpu_checks.py --device cuda --out bench/results/gpu/checks-cuda.json

Writes a JSON file with both and prints them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    MODELS,
    RESULTS,
    machine,
    minilm,
    now,
    scifact_pairs,
    tiny_sentence_model,
    weights,
)

BOUND = 1e-9  # float64: what an exact engine stays far below


def _grads(params: dict) -> dict:
    return {k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}


def _zero(params: dict) -> None:
    for p in params.values():
        p.grad = None


def rel_err(got: dict, ref: dict) -> float:
    largest = max(v.abs().max().item() for v in ref.values())
    return max((got[k] - ref[k]).abs().max().item() / max(ref[k].abs().max().item(),
                                                            1e-6 * largest) for k in ref)


def _chunks_of(inputs: dict, rows: list[list[int]]) -> list[dict]:
    """The rows of each chunk, each chunk cut to its longest row (as the engine runs it)."""
    import torch

    out = []
    for idx in rows:
        index = torch.tensor(idx, device=inputs["attention_mask"].device)
        chunk = {k: v.index_select(0, index) for k, v in inputs.items()}
        width = int((chunk["attention_mask"] != 0).sum(1).max())
        out.append({k: v[:, :width] for k, v in chunk.items()})
    return out


def exactness(st, device: str, batch: int, max_length: int, seed: int = 0) -> list[dict]:
    import torch

    import bigbatch as bb
    from bigbatch.engine import chunking

    st = st.to(device=device, dtype=torch.float64).train()
    params = dict(st.named_parameters())
    queries, docs = scifact_pairs(batch)

    def tok(texts):
        f = st.preprocess(texts)
        return {k: v.to(device) for k, v in f.items() if isinstance(v, torch.Tensor)}

    inputs = {"query": tok(queries), "doc": tok(docs)}

    def tower(**f):
        return st(dict(f))["sentence_embedding"]

    loss_fn = bb.InfoNCE(temperature=0.05).to(device=device, dtype=torch.float64)
    params |= {f"loss.{k}": p for k, p in loss_fn.named_parameters()}
    cases = {"chunks of 5, last kept": dict(chunk_size=5),
             "chunks of 5, all replayed": dict(chunk_size=5, reuse_last_chunk=False),
             "length-ordered": dict(chunk_size=5, sort_by_length=True),
             "token budget of 3 rows": dict(chunk_size=batch, chunk_tokens=3 * max_length,
                                            sort_by_length=True),
             "auto, plain step": dict(chunk_size="auto", memory_budget=2 ** 40)}
    out = []
    for name, options in cases.items():
        cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, **options)
        torch.manual_seed(seed)
        if device.startswith("cuda"):
            torch.cuda.manual_seed_all(seed)
        _zero(params)
        cache.step(**inputs)
        got = _grads(params)
        layout = {}  # the rows of each chunk, in the order the first pass embedded them
        for tower_name, x in inputs.items():
            order = chunking.length_order(x) if cache.sort_by_length else None
            idx = list(range(len(x["input_ids"]))) if order is None else order.tolist()
            if tower_name in cache.chunk_tokens:
                bounds = chunking.token_bounds(x, cache.chunk_tokens[tower_name],
                                               cache.chunk_sizes[tower_name], name=tower_name,
                                               order=order)
            else:
                bounds = chunking.chunk_bounds(len(idx), cache.chunk_sizes[tower_name])
            layout[tower_name] = (idx, [idx[lo:hi] for lo, hi in bounds])
        torch.manual_seed(seed)
        if device.startswith("cuda"):
            torch.cuda.manual_seed_all(seed)
        _zero(params)
        reps = {}
        for tower_name, (idx, rows) in layout.items():
            emb = torch.cat([tower(**c) for c in _chunks_of(inputs[tower_name], rows)])
            where = torch.tensor(idx, device=emb.device)
            back = torch.empty_like(where)
            back[where] = torch.arange(len(idx), device=emb.device)
            reps[tower_name] = emb.index_select(0, back)  # the original order
        loss, _ = loss_fn(**reps)
        loss.backward()
        err = rel_err(got, _grads(params))
        out.append({"case": name, "max_rel_err": err, "sizes": dict(cache.chunk_sizes),
                    "tokens": dict(cache.chunk_tokens)})
        print(f"{name}: max relative gradient error {err:.3g}", flush=True)
    return out


def bf16_cosines(st, device: str, batch: int, chunk: int, max_length: int) -> dict:
    import torch

    import bigbatch as bb

    st = st.to(device=device, dtype=torch.float32).eval()  # dropout off: precision alone
    st.max_seq_length = max_length
    params = dict(st.named_parameters())
    queries, docs = scifact_pairs(batch)

    def tok(texts):
        f = st.preprocess(texts)
        return {k: v.to(device) for k, v in f.items() if isinstance(v, torch.Tensor)}

    inputs = {"query": tok(queries), "doc": tok(docs)}

    def tower(**f):
        return st(dict(f))["sentence_embedding"]

    loss_fn = bb.InfoNCE(temperature=0.05, learnable_temperature=False).to(device)
    grads = {}
    for dtype in (None, torch.bfloat16):
        _zero(params)
        bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=chunk,
                     autocast_dtype=dtype, sort_by_length=True).step(**inputs)
        grads[dtype] = _grads(params)
    ref = grads[None]
    largest = max(g.abs().max().item() for g in ref.values())
    # an attention key bias's gradient is zero analytically (softmax ignores a constant added
    # to every score): only rounding is left in it, which no precision reproduces
    kept = [k for k, g in ref.items() if g.abs().max().item() > 1e-6 * largest]
    cos = {k: torch.nn.functional.cosine_similarity(ref[k].flatten().double(),
                                                    grads[torch.bfloat16][k].flatten().double(),
                                                    dim=0).item() for k in kept}
    worst = sorted(cos.items(), key=lambda kv: kv[1])[:5]
    out = {"parameters": len(cos), "left_out": sorted(set(ref) - set(kept)),
           "min": min(cos.values()), "median": statistics.median(cos.values()),
           "worst": dict(worst), "all": cos}
    print(f"bf16 against float32: gradient cosine per parameter min {out['min']:.5f}, median "
          f"{out['median']:.5f} over {len(cos)} parameters (worst: {worst[0][0]}; left out, "
          f"gradient zero analytically: {len(out['left_out'])})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", choices=sorted(MODELS), default="minilm")
    ap.add_argument("--exact-batch", type=int, default=12, help="pairs of the float64 cases")
    ap.add_argument("--exact-length", type=int, default=64, help="their max length")
    ap.add_argument("--batch", type=int, default=256, help="pairs of the bf16 comparison")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    load = minilm if args.model == "minilm" else tiny_sentence_model
    st = load("cpu")
    st.max_seq_length = args.exact_length
    cases = exactness(st, args.device, args.exact_batch, args.exact_length)
    worst = max(c["max_rel_err"] for c in cases)
    print(f"max relative gradient error {worst:.3g} over {len(cases)} cases on {args.device} "
          f"(bound {BOUND:g})", flush=True)
    cosines = bf16_cosines(load("cpu"), args.device, args.batch, args.chunk, args.max_length)
    result = {"benchmark": "gpu-checks", "date": now(), "machine": machine(args.device),
              "command": "python bench/gpu_checks.py " + " ".join(sys.argv[1:]),
              "settings": vars(args) | {"model": MODELS[args.model], **weights(args.model)},
              "exactness": {"cases": cases, "max_rel_err": worst, "bound": BOUND,
                            "passed": worst <= BOUND},
              "bf16_vs_fp32": cosines}
    out = Path(args.out or RESULTS / f"gpu-checks-{args.device.split(':')[0]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if worst > BOUND:
        sys.exit(f"GradCache's gradient is off the reference by {worst:.3g} on {args.device}")


if __name__ == "__main__":
    main()
