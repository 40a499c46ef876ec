"""colpali-engine / ViDoRe training data: Parquet files or ``datasets`` ``save_to_disk``
folders whose page images are held in the rows, converted to records whose images are files.

colpali-engine trains on tables with a ``query`` column and the page as a Hugging Face
``Image`` column (``vidore/colpali_train_set``: ``image``, which colpali-engine's
``ColPaliEngineDataset`` takes as its positive target; that class's own column names are
``pos_target`` / ``neg_target``; its older collators take one negative page as
``neg_image``). An ``Image`` feature is stored in Parquet and Arrow as a struct ``{bytes,
path}`` (``bytes`` null when ``path`` names a file). Other columns (``image_filename``,
``answer``, ``source``, ``page``, ...) are metadata and reported as not read. Query tables
that name their pages by id in a separate corpus (``positive_passages`` /
``negative_passages``, as colpali-engine's ``load_train_set_ir``) hold no images and are
refused with a message.

bigbatch's records refer to page images by path (:class:`~bigbatch.data.records.types.ImageDoc`),
so such data is converted, never trained on directly: :func:`convert_colpali` streams the
rows (a record batch at a time), checks each image by decoding it with Pillow, writes each
distinct image once, with its original bytes and format, to ``<output stem>_images/<row>.<ext>``
beside the output (named by the first row that holds it; the same page in several rows is
one file, so training never takes it as a negative of itself), and writes the records with
paths relative to the output file.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from pathlib import Path
from typing import Any

from ..._progress import progress_bar
from ...errors import DataError, shown
from ..formats import check_output, write_records
from ..formats.colpali import (
    NEGATIVE_COLUMNS,
    POSITIVE_COLUMNS,
    QUERY_COLUMN,
    colpali_columns,
    convert_command,
    is_colpali,
)
from ..readers.tables import count_table_rows, table_rows
from ..records.types import Doc, Problem, Record, problem_lines

# is_colpali, colpali_columns, convert_command and the column names are defined in
# bigbatch.data.formats.colpali and stay importable from here
__all__ = ["is_colpali", "colpali_columns", "convert_colpali", "convert_command",
           "POSITIVE_COLUMNS", "NEGATIVE_COLUMNS"]

_FORMAT_SUFFIX = {"PNG": ".png", "JPEG": ".jpg", "MPO": ".jpg", "WEBP": ".webp", "BMP": ".bmp",
                  "GIF": ".gif", "TIFF": ".tiff"}
_ROWS_PER_SLICE = 64  # rows turned into Python objects at a time (each may hold a page image)


def _image_suffix(data: bytes) -> tuple[str | None, str | None]:
    """(file suffix of the image's own format, or None if bigbatch has none for it; why the
    bytes are not a usable image, or None), decoding the pixels with Pillow."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = im.format
            im.verify()
        with Image.open(io.BytesIO(data)) as im:  # verify() leaves it unusable; decode it
            im.load()
    except Image.DecompressionBombError as e:
        return None, f"image too large to open safely ({e})"
    except UnidentifiedImageError:
        return None, (f"not a readable image: Pillow recognises no image format in its "
                      f"{len(data)} bytes (starting {data[:8]!r})")
    except (OSError, SyntaxError, ValueError) as e:
        return None, f"not a readable image: {e}"
    return _FORMAT_SUFFIX.get(fmt or ""), None


class _ImageWriter:
    """Writes each distinct image once into ``folder`` (named by its first row)."""

    def __init__(self, folder: Path, source: Path) -> None:
        self.folder = folder
        self.source = source
        self.seen: dict[str, str] = {}  # sha1 of the bytes -> file name
        self.written = self.reencoded = self.reused = 0

    def add(self, value: Any, row: int, col: str, problems: list[Problem]) -> str | None:
        """The written file's name for one ``Image`` cell, or None (a problem is added)."""
        where = (str(self.source), row, col)
        if not isinstance(value, dict):
            problems.append(Problem(*where, "not an image (expected a Hugging Face Image "
                                    "value, {bytes, path})"))
            return None
        data, ref = value.get("bytes"), value.get("path")
        if data is None and ref:
            full = Path(os.path.expanduser(ref))
            cands = [full] if full.is_absolute() else [
                (self.source if self.source.is_dir() else self.source.parent) / ref,
                Path.cwd() / ref]
            found = next((c for c in cands if c.is_file()), None)
            if found is None:
                problems.append(Problem(*where, f"no image bytes, and the image path {shown(ref)} "
                                        f"is not a file (looked at "
                                        f"{', '.join(repr(str(c)) for c in cands)})"))
                return None
            data = found.read_bytes()
        if not data:
            problems.append(Problem(*where, "no image (bytes and path both empty)"))
            return None
        digest = hashlib.sha1(data).hexdigest()
        if digest in self.seen:
            self.reused += 1
            return self.seen[digest]
        suffix, why = _image_suffix(data)
        if why is not None:
            problems.append(Problem(*where, why))
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        if suffix is None:  # a format bigbatch's image paths do not name: PNG
            from PIL import Image

            with Image.open(io.BytesIO(data)) as im:
                buf = io.BytesIO()
                im.save(buf, format="PNG")
            data, suffix = buf.getvalue(), ".png"
            self.reencoded += 1
        name = f"{row}{suffix}" if col in POSITIVE_COLUMNS else \
            f"{row}_{re.sub(r'[^A-Za-z0-9]+', '_', col).strip('_')}{suffix}"
        (self.folder / name).write_bytes(data)
        self.written += 1
        self.seen[digest] = name
        return name


def _cells(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def convert_colpali(path: str | Path, out: str | Path, fmt: str = "contrastors", *,
                    split: str = "train", allow_lossy: bool = False,
                    progress: bool = True, **write_kw: Any) -> dict[str, Any]:
    """Convert colpali-engine data at ``path`` to training records in ``out`` (format ``fmt``,
    ``contrastors`` or ``swift``), writing its images to ``<out stem>_images/``.

    Rows without query text are skipped and counted (``skipped_no_query``, with the rows in
    ``skipped``). A row whose image does not decode (or is missing, or is not an image
    value) is a problem naming the file, row and column: the conversion stops listing every
    one, unless ``allow_lossy`` (the row is dropped and counted). Returns a report: rows,
    written, skipped, dropped, images written / reused / re-encoded, the images folder, the
    columns not read (``not_read``), and what :func:`write_records` reports.

    Raises:
        DataError: not colpali data, corpus-id tables, or problems (listed, with file, row
            and column).
    """
    path, out = Path(path), Path(out)
    if not path.exists():
        raise DataError("not found", path=str(path))
    cols = colpali_columns(path, split)
    if cols is None:
        raise DataError("not colpali-engine data: expected Parquet or a datasets folder with "
                        f"a '{QUERY_COLUMN}' column and a page-image column "
                        f"({' or '.join(POSITIVE_COLUMNS)}, a Hugging Face Image)",
                        path=str(path))
    if not cols["positive"]:
        raise DataError(f"columns {', '.join(cols['corpus_ids'])} name pages by id in a "
                        "separate corpus (as colpali-engine's load_train_set_ir); this table "
                        "holds no images. Join the corpus's images into the rows (an 'image' "
                        "column) first, or write records with image paths", path=str(path))
    if fmt not in ("contrastors", "swift"):
        raise DataError(f"colpali data has page images; write it as contrastors or swift, "
                        f"not {fmt}")
    check_output(out, fmt)  # before any image is written
    qcol, pcol, ncols = cols["query"][0], cols["positive"][0], cols["negatives"]
    folder = out.parent / f"{out.stem}_images"
    images = _ImageWriter(folder, path)
    records: list[Record] = []
    problems: list[Problem] = []
    skipped: list[Problem] = []
    rows = 0
    bar = progress_bar(total=count_table_rows(path, split), desc="colpali rows",
                       unit="row") if progress else None
    try:
        for n, row in table_rows(path, split, [qcol, pcol, *ncols], _ROWS_PER_SLICE):
            rows += 1
            if bar is not None:
                bar.update(1)
            q = row.get(qcol)
            if q is None or (isinstance(q, str) and not q.strip()):
                skipped.append(Problem(str(path), n, qcol, f"{'null' if q is None else 'empty'}"
                                       " query text; row skipped"))
                continue
            if not isinstance(q, str):
                problems.append(Problem(str(path), n, qcol, f"must be text, not "
                                        f"{type(q).__name__}"))
                continue
            before = len(problems)
            pos_cells = _cells(row.get(pcol))
            if len(pos_cells) != 1:
                problems.append(Problem(str(path), n, pcol, "no image" if not pos_cells else
                                        f"{len(pos_cells)} positive images; a record holds one"))
                continue
            pos = images.add(pos_cells[0], n, pcol, problems)
            negs = []
            for c in ncols:
                for i, v in enumerate(_cells(row.get(c))):
                    name = images.add(v, n, c if not isinstance(row.get(c), list)
                                      else f"{c}[{i}]", problems)
                    if name is not None:
                        negs.append(Doc(image=f"{folder.name}/{name}", key=c))
            if len(problems) > before or pos is None:
                continue
            records.append(Record(q, Doc(image=f"{folder.name}/{pos}", key=pcol), negs,
                                  None, n, ""))
    finally:
        if bar is not None:
            bar.close()
    if problems and not allow_lossy:
        shown = "\n  ".join(problem_lines(problems))
        raise DataError(f"{len(problems)} problem(s) in {path} ({len(records)} of {rows} rows "
                        f"usable, {len(skipped)} without query text skipped):\n  {shown}\n"
                        f"fix them, or pass --allow-lossy to drop those rows (counted in the "
                        f"report)")
    if not records:
        raise DataError(f"no usable rows ({rows} read, {len(skipped)} without query text)",
                        path=str(path))
    report = write_records(records, out, fmt, allow_lossy=allow_lossy, **write_kw)
    dropped_rows = sorted({p.line for p in problems})
    report.update({"rows": rows, "skipped_no_query": len(skipped), "skipped": skipped,
                   "dropped_rows": len(dropped_rows), "problems": problems,
                   "images_folder": str(folder), "images_written": images.written,
                   "images_reused": images.reused, "images_reencoded": images.reencoded,
                   "not_read": cols["other"]})
    return report
