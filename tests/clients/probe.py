"""The client side of the client matrix (tests/clients/matrix.py), run by each client's own
interpreter (its virtual environment, without bigbatch): load every model folder bigbatch
trained as a user of that library would, embed the matrix's texts, and save folders the
library writes itself (the reverse direction), each with its own embeddings.

    python probe.py SPEC.json OUT_DIR

SPEC.json (written by matrix.py): ``{"texts": {"query": [...], "doc": [...]}, "models":
{name: {"folder", "kind" ("dense" or "colbert"), "base", "adapter", "pooling",
"prompts"}}, "reverse_base": path}``. OUT_DIR gets ``rows.json`` (one row per client and
model: library, version, model, direction, a file of embeddings or an error) and one
``.npz`` per row.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import sys
import traceback
from pathlib import Path

import numpy as np


def version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _hf_dense(model, tok, texts, pooling, max_length):
    import torch

    batch = tok(texts, padding=True, truncation=True, max_length=max_length,
                return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"]
    if pooling == "cls":
        emb = hidden[:, 0]
    else:
        m = mask[..., None].to(hidden.dtype)
        emb = (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(emb, dim=-1).numpy()


def _sides(model_spec, texts):
    """(side, texts with the side's prefix, prompt name) for both sides."""
    prompts = model_spec.get("prompts") or {}
    return [("query", texts["query"], prompts.get("query", ""), "query"),
            ("doc", texts["doc"], prompts.get("doc", ""), "document")]


def probe_sentence_transformers(spec, name, m):
    from sentence_transformers import SentenceTransformer

    if m["kind"] == "colqwen":
        return None
    if m["kind"] != "dense":
        import sentence_transformers as st
        if not hasattr(st, "MultiVectorEncoder"):
            return None  # MultiVectorEncoder came in sentence-transformers 6.0
        enc = st.MultiVectorEncoder(m["folder"], device="cpu")
        return {"query": [np.asarray(x) for x in enc.encode_query(spec["texts"]["query"])],
                "doc": [np.asarray(x) for x in enc.encode_document(spec["texts"]["doc"])]}
    model = SentenceTransformer(m["folder"], device="cpu")
    return {side: model.encode(texts, prompt_name=prompt_name)
            for side, texts, _, prompt_name in _sides(m, spec["texts"])}


def probe_colpali(spec, name, m):
    """A ColQwen-style folder in colpali-engine's class for its architecture, fed the inputs
    bigbatch made (as the model card shows): the tokens each query and page scores."""
    if m["kind"] != "colqwen":
        return None
    import torch
    from colpali_engine.models import ColQwen2, ColQwen2_5

    cls = {"qwen2_vl": ColQwen2, "qwen2_5_vl": ColQwen2_5}[m["family"]]
    model = cls.from_pretrained(m["folder"], torch_dtype=torch.float32).eval()
    out = {}
    for side, files in m["inputs"].items():
        for i, f in enumerate(files):
            batch = {k: torch.from_numpy(v) for k, v in np.load(f).items()}
            scored = batch.pop("skip_mask").logical_not() & batch["attention_mask"].bool()
            if "pixel_values" in batch:  # ColQwen2 takes pixel values padded per image
                batch["pixel_values"] = batch["pixel_values"].unsqueeze(0)
            else:  # a text: the positions bigbatch gives
                pos = (batch["attention_mask"].cumsum(-1) - 1).clamp_min(0)
                batch["position_ids"] = pos.unsqueeze(0).expand(3, -1, -1)
            with torch.no_grad():
                out[f"{side}_{i}"] = model(**batch)[scored].numpy()
    return out


def probe_transformers(spec, name, m):
    if m["kind"] != "dense":
        return None
    from transformers import AutoModel, AutoTokenizer

    model, tok = AutoModel.from_pretrained(m["folder"]).eval(), AutoTokenizer.from_pretrained(
        m["folder"])
    return {side: _hf_dense(model, tok, [prefix + t for t in texts], m["pooling"],
                            m["max_length"])
            for side, texts, prefix, _ in _sides(m, spec["texts"])}


def probe_peft(spec, name, m):
    if m["kind"] != "dense" or not m.get("adapter"):
        return None
    from peft import PeftModel
    from transformers import AutoModel, AutoTokenizer

    model = PeftModel.from_pretrained(AutoModel.from_pretrained(m["base"]), m["adapter"]).eval()
    tok = AutoTokenizer.from_pretrained(m["folder"])
    return {side: _hf_dense(model, tok, [prefix + t for t in texts], m["pooling"],
                            m["max_length"])
            for side, texts, prefix, _ in _sides(m, spec["texts"])}


def probe_pylate(spec, name, m):
    if m["kind"] != "colbert":
        return None
    from pylate import models

    model = models.ColBERT(model_name_or_path=m["folder"], device="cpu")
    return {"query": [np.asarray(x) for x in model.encode(spec["texts"]["query"],
                                                          is_query=True)],
            "doc": [np.asarray(x) for x in model.encode(spec["texts"]["doc"],
                                                        is_query=False)]}


# the clients a model folder is loaded in: (library's distribution, probe)
PROBES = {"sentence-transformers": ("sentence-transformers", probe_sentence_transformers),
          "transformers": ("transformers", probe_transformers),
          "peft": ("peft", probe_peft),
          "PyLate": ("pylate", probe_pylate),
          "colpali-engine": ("colpali-engine", probe_colpali)}


def reverse_sentence_transformers(spec, out):
    """A CLS-pooled model at max length 100, saved by this sentence-transformers."""
    from sentence_transformers import SentenceTransformer, models

    t = models.Transformer(spec["reverse_base"], max_seq_length=100)
    dim = (t.get_embedding_dimension() if hasattr(t, "get_embedding_dimension")
           else t.get_word_embedding_dimension())
    pool = models.Pooling(dim, "cls")
    model = SentenceTransformer(modules=[t, pool, models.Normalize()], device="cpu")
    folder = out / "made-by-sentence-transformers"
    model.save(str(folder))
    return folder, "dense", {"query": model.encode(spec["texts"]["query"]),
                             "doc": model.encode(spec["texts"]["doc"])}


def reverse_pylate(spec, out):
    """A ColBERT model PyLate builds on the base (its own new projection), saved."""
    import torch
    from pylate import models

    torch.manual_seed(0)
    model = models.ColBERT(model_name_or_path=spec["reverse_base"], device="cpu")
    folder = out / "made-by-pylate"
    model.save(str(folder))
    return folder, "colbert", {
        "query": [np.asarray(x) for x in model.encode(spec["texts"]["query"], is_query=True)],
        "doc": [np.asarray(x) for x in model.encode(spec["texts"]["doc"], is_query=False)]}


REVERSE = {"sentence-transformers": ("sentence-transformers", reverse_sentence_transformers),
           "PyLate": ("pylate", reverse_pylate)}


def _save(out: Path, key: str, emb) -> str:
    arrays = {}
    for side, value in emb.items():
        if isinstance(value, list):
            arrays.update({f"{side}_{i}": np.asarray(v, dtype=np.float32)
                           for i, v in enumerate(value)})
        else:
            arrays[side] = np.asarray(value, dtype=np.float32)
    path = out / f"{key}.npz"
    np.savez(path, **arrays)
    return str(path)


def _error(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {first}"


def main(spec_path: str, out_dir: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = {d: version(d) for d in ("torch", "transformers", "sentence-transformers", "peft",
                                   "pylate", "colpali-engine")}
    rows = []
    for client, (dist, probe) in PROBES.items():
        if env.get(dist) is None and version(dist) is None:
            continue
        for name, m in spec["models"].items():
            row = {"client": client, "version": version(dist), "model": name,
                   "direction": "bigbatch -> client", "environment": env}
            try:
                emb = probe(spec, name, m)
                if emb is None:
                    continue
                row["embeddings"] = _save(out, f"{client}-{name}", emb)
            except Exception as e:  # noqa: BLE001 - every failure is a row of the table
                row["error"] = _error(e)
                row["traceback"] = traceback.format_exc()[-2000:]
            rows.append(row)
    for client, (dist, make) in REVERSE.items():
        if version(dist) is None:
            continue
        row = {"client": client, "version": version(dist), "direction": "client -> bigbatch",
               "environment": env}
        try:
            folder, kind, emb = make(spec, out)
            row.update(model=kind, folder=str(folder),
                       embeddings=_save(out, f"reverse-{client}", emb))
        except Exception as e:  # noqa: BLE001
            row.update(model="-", error=_error(e), traceback=traceback.format_exc()[-2000:])
        rows.append(row)
    (out / "rows.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
