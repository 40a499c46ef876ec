"""A visual-document retrieval set from a text BEIR set: each document (title and text) is
rendered to a page image with PIL, the queries stay text. With SciFact this gives claims
against abstract pages, so the whole image path (loading, visual tokens, training,
evaluation) runs end to end on a CPU.

    bigbatch render-pages data/scifact runs/scifact-pages --max-docs 600

writes a BEIR directory whose ``corpus.jsonl`` records carry ``"image": "images/<id>.png"``
(the text is kept for reference), the queries and qrels of the rendered documents, and a
contrastors-format ``train.jsonl`` (``query``, ``chunk_path``, ``neg_chunk_paths``). Rendering into
an existing folder reuses a page only when it was drawn from the same title, text and
settings (``images/manifest.json`` records what each page was drawn from).
"""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import random
from pathlib import Path
from typing import Any

from ..._progress import progress_bar
from ...errors import DataError, shown
from ..readers.beir_dir import load_qrels
from ..readers.jsonl import iter_jsonl

__all__ = ["render_page", "render_beir_pages", "load_font"]

FONT_NAMES = ("DejaVuSans.ttf", "LiberationSans-Regular.ttf", "Arial.ttf")


@functools.lru_cache(maxsize=16)
def load_font(size: int, path: str | None = None) -> Any:
    """A TrueType font: ``path``, else a common system font, else Pillow's built-in one."""
    from PIL import ImageFont

    for name in ([path] if path else []) + list(FONT_NAMES):
        try:
            return ImageFont.truetype(name, size)
        except OSError:
            if name == path:
                raise DataError(f"cannot load font {path!r}") from None
    return ImageFont.load_default(size=size)


def _wrap(text: str, font: Any, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        trial = f"{line} {word}" if line else word
        if font.getlength(trial) <= width or not line:
            line = trial
        else:
            lines.append(line)
            line = word
    if line:
        lines.append(line)
    return lines


def render_page(title: str, text: str, size: tuple[int, int] = (448, 448),
                font_size: int = 13, font: str | None = None) -> Any:
    """A white page with the title (larger) and the text wrapped below; what does not fit is
    cut at the bottom margin. Returns a ``PIL.Image``."""
    from PIL import Image, ImageDraw

    w, h = size
    margin = max(8, w // 28)
    page = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(page)
    y = margin
    for body, px in ((title, font_size + 3), (text, font_size)):
        if not body:
            continue
        f = load_font(px, font)
        step = int(px * 1.3)
        for line in _wrap(body, f, w - 2 * margin):
            if y + step > h - margin:
                return page
            draw.text((margin, y), line, fill="black", font=f)
            y += step
        y += step // 2
    return page


def _page_key(title: str, text: str, size: tuple[int, int], font_size: int,
              font: str | None) -> str:
    """What a page image is drawn from, as a short hash (kept in the images manifest)."""
    what = json.dumps([title, text, list(size), font_size, font], ensure_ascii=True)
    return hashlib.sha1(what.encode("ascii")).hexdigest()[:16]


def _read_manifest(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _read_qrels(path: Path) -> list[tuple[str, str, int]]:
    """A split's qrels as ``bigbatch eval`` reads them (BEIR's 3 columns or TREC's 4, checked:
    :func:`~bigbatch.data.readers.beir_dir.load_qrels`); none when the split has no file."""
    if not path.exists():
        return []
    return [(q, d, s) for q, docs in load_qrels(path).items() for d, s in docs.items()]


def render_beir_pages(src: str | Path, out: str | Path, *, splits: tuple[str, ...] = ("train", "test"),
                      max_docs: int | None = None, num_negatives: int = 0, seed: int = 0,
                      size: tuple[int, int] = (448, 448), font_size: int = 13,
                      font: str | None = None, progress: bool = True) -> dict[str, int]:
    """Render a BEIR directory's documents to pages in ``out`` (see the module docstring).

    Every document relevant to a query of ``splits`` is rendered; with ``max_docs``, other
    documents fill the corpus up to that size (all of them without it). ``num_negatives``
    random non-relevant pages per training record go to ``train.jsonl``.
    Returns counts (documents, queries, train records).
    """
    src, out = Path(src), Path(out)
    qrels = {s: _read_qrels(src / "qrels" / f"{s}.tsv") for s in splits}
    if not any(qrels.values()):
        raise DataError(f"no qrels for splits {splits}", path=str(src / "qrels"))
    needed = {d for rows in qrels.values() for _, d, s in rows if s > 0}
    corpus: list[dict] = []
    for n, rec, problem in iter_jsonl(src / "corpus.jsonl"):
        if problem is not None:
            raise DataError(problem, path=str(src / "corpus.jsonl"), line=n, field=problem.field)
        corpus.append(rec)
    extra = [r for r in corpus if str(r["_id"]) not in needed]
    room = len(extra) if max_docs is None else max(0, max_docs - len(needed))
    keep = {str(r["_id"]) for r in corpus if str(r["_id"]) in needed} | \
        {str(r["_id"]) for r in extra[:room]}
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "qrels").mkdir(exist_ok=True)
    bar = progress_bar(total=len(keep), desc="render pages", unit="page") if progress else None
    # a page is reused only when drawn from the same title, text and settings; the manifest
    # is removed while pages change, so an interrupted run never vouches for a stale page
    manifest_path = out / "images" / "manifest.json"
    drawn = _read_manifest(manifest_path)
    manifest_path.unlink(missing_ok=True)
    manifest: dict[str, str] = {}
    with open(out / "corpus.jsonl", "w") as f:
        for rec in corpus:
            did = str(rec["_id"])
            if did not in keep:
                continue
            image = Path("images") / f"{did}.png"
            title, text = rec.get("title") or "", rec.get("text") or ""
            manifest[did] = _page_key(title, text, size, font_size, font)
            if drawn.get(did) != manifest[did] or not (out / image).exists():
                render_page(title, text, size, font_size, font).save(out / image)
            f.write(json.dumps({"_id": did, "title": rec.get("title", ""),
                                "text": rec.get("text", ""), "image": str(image)}) + "\n")
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    manifest_path.write_text(json.dumps(manifest, indent=0), encoding="utf-8")
    qids = set()
    for split, rows in qrels.items():
        rows = [r for r in rows if r[1] in keep]
        qids |= {q for q, _, _ in rows}
        with open(out / "qrels" / f"{split}.tsv", "w", newline="") as f:
            w = csv.writer(f, delimiter="\t")
            w.writerow(["query-id", "corpus-id", "score"])
            w.writerows(rows)
    queries = {}
    for n, rec, problem in iter_jsonl(src / "queries.jsonl"):
        missing = next((k for k in ("_id", "text") if rec is not None and k not in rec), None)
        if problem is not None or missing is not None:
            raise DataError(problem or "missing key", path=str(src / "queries.jsonl"), line=n,
                            field=missing)
        if str(rec["_id"]) in qids:
            queries[str(rec["_id"])] = rec
    absent = sorted(qids - set(queries))
    if absent:
        raise DataError(f"{len(absent)} query ids of the qrels are not in queries.jsonl "
                        f"(first: {shown(absent[0])})", path=str(src / "queries.jsonl"))
    with open(out / "queries.jsonl", "w") as f:
        for q in queries.values():
            f.write(json.dumps(q) + "\n")
    rng = random.Random(seed)
    pool = sorted(keep)
    n_train = 0
    with open(out / "train.jsonl", "w") as f:
        for q, d, s in qrels.get("train", []):
            if s <= 0 or d not in keep or q not in queries:
                continue
            relevant = {dd for qq, dd, ss in qrels["train"] if qq == q and ss > 0}
            negs = []
            while len(negs) < num_negatives and len(negs) < len(pool) - len(relevant):
                cand = rng.choice(pool)
                if cand not in relevant and cand not in negs:
                    negs.append(cand)
            f.write(json.dumps({"query_id": q, "query": queries[q]["text"],
                                "chunk_path": f"images/{d}.png",
                                "neg_chunk_paths": [f"images/{n}.png" for n in negs]}) + "\n")
            n_train += 1
    return {"documents": len(keep), "queries": len(queries), "train_records": n_train}
