"""colpali-engine / ViDoRe data (a ``query`` column and the page as a Hugging Face ``Image``
struct ``{bytes, path}``) converted to records whose images are files: original bytes kept,
rows without query text skipped and counted, bad images named by file, row and column,
metadata columns reported, and validate / train on the unconverted file giving the command."""

from __future__ import annotations

import io
import json

import pytest

from bigbatch.cli import main
from bigbatch.data.formats import detect_format, read_records
from bigbatch.data.records.validate import validate_file
from bigbatch.data.tools.convert_colpali import convert_colpali, is_colpali
from bigbatch.errors import DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
Image = pytest.importorskip("PIL.Image")

IMAGE_TYPE = None


def _image_bytes(seed: int, fmt: str = "PNG") -> bytes:
    import numpy as np

    rng = np.random.default_rng(seed)
    arr = (rng.random((40 + seed, 30 + seed, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def _image_type():
    return pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _table(rows: list[dict], negatives: bool = False):
    cols = {"query": pa.array([r["query"] for r in rows], pa.string()),
            "image": pa.array([r["image"] for r in rows], _image_type()),
            "image_filename": pa.array([r.get("image_filename", "f") for r in rows]),
            "answer": pa.array(["a"] * len(rows)),
            "page": pa.array(["1"] * len(rows))}
    if negatives:
        cols["neg_image"] = pa.array([r.get("neg_image") for r in rows], _image_type())
    return pa.table(cols)


@pytest.fixture
def images():
    return [_image_bytes(0), _image_bytes(1, "JPEG"), _image_bytes(2), _image_bytes(3)]


def _rows(images, bad: bool = True):
    rows = [
        {"query": "what is on page zero?", "image": {"bytes": images[0], "path": "p0.png"}},
        {"query": None, "image": {"bytes": images[1], "path": None}},       # 2: null query
        {"query": "a jpeg page", "image": {"bytes": images[1], "path": "p1.jpg"}},
        {"query": "   ", "image": {"bytes": images[2], "path": None}},      # 4: empty query
        {"query": "page two", "image": {"bytes": images[2], "path": None}},
        {"query": "the same page zero again", "image": {"bytes": images[0], "path": None}},
    ]
    if bad:
        rows.append({"query": "broken page", "image": {"bytes": b"\x89PNG not really",
                                                       "path": None}})    # 7: bad image
        rows.append({"query": "cut page", "image": {"bytes": images[2][:len(images[2]) // 2],
                                                    "path": None}})       # 8: truncated
    return rows


def test_parquet_converts_keeping_image_bytes_and_validates(tmp_path, images, capsys):
    src = tmp_path / "train.parquet"
    pq.write_table(_table(_rows(images)), src)
    assert detect_format(src) == "colpali" and is_colpali(src)

    # validate and train-loading on the unconverted file say to convert it, with the command
    n, problems = validate_file(src)
    assert n == 0 and len(problems) == 1
    assert f"bigbatch convert --from colpali {src} {tmp_path / 'train.jsonl'}" in str(problems[0])
    assert main(["validate", str(src)]) == 1
    assert "convert it first" in capsys.readouterr().out
    _, problems = read_records(src, "st")  # an explicit --format st says the same
    assert "convert it first" in str(problems[0])

    out = tmp_path / "out" / "train.jsonl"
    # the bad image stops the conversion, named by file, row and column
    with pytest.raises(DataError) as e:
        convert_colpali(src, out, progress=False)
    assert f"{src}:7, field 'image': not a readable image" in str(e.value)
    assert f"{src}:8, field 'image': not a readable image" in str(e.value)  # header fine
    assert not out.exists()

    assert main(["convert", "--allow-lossy", str(src), str(out)]) == 0  # detected, contrastors
    printed = capsys.readouterr().out
    assert f"{src}:2, field 'query': null query text; row skipped" in printed
    assert f"{src}:4, field 'query': empty query text; row skipped" in printed
    assert "skipped 2 without query text" in printed and "dropped 2 with bad images" in printed
    assert "not read: column(s) image_filename, answer, page" in printed

    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["query"] for r in recs] == ["what is on page zero?", "a jpeg page", "page two",
                                          "the same page zero again"]
    paths = [r["chunk_path"] for r in recs]
    assert paths == ["train_images/1.png", "train_images/3.jpg", "train_images/5.png",
                     "train_images/1.png"]  # one file per distinct image, first row's name
    for p, data in zip(paths, [images[0], images[1], images[2], images[0]]):
        assert (out.parent / p).read_bytes() == data  # original bytes, not re-encoded
    assert validate_file(out) == (4, [])
    assert main(["validate", str(out)]) == 0


def test_swift_output_and_negative_images(tmp_path, images, capsys):
    rows = _rows(images, bad=False)
    rows[0]["neg_image"] = {"bytes": images[3], "path": None}
    rows[2]["neg_image"] = {"bytes": images[0], "path": None}
    rows[4]["neg_image"] = {"bytes": images[3], "path": None}
    rows[5]["neg_image"] = {"bytes": images[2], "path": None}
    src = tmp_path / "negs.parquet"
    pq.write_table(_table(rows, negatives=True), src)
    out = tmp_path / "negs_swift.jsonl"
    assert main(["convert", "--from", "colpali", "--to", "swift", str(src), str(out)]) == 0
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(recs) == 4
    assert recs[0]["positive_images"] == [["negs_swift_images/1.png"]]
    assert recs[0]["negative_images"] == [["negs_swift_images/1_neg_image.png"]]
    assert (tmp_path / recs[0]["negative_images"][0][0]).read_bytes() == images[3]
    assert validate_file(out) == (4, [])


def test_datasets_folder_and_image_given_by_path(tmp_path, images):
    """A save_to_disk folder (Arrow IPC stream + state.json); an image with null bytes and a
    path relative to the data is read from that file."""
    (tmp_path / "pages").mkdir()
    (tmp_path / "pages" / "p9.png").write_bytes(images[3])
    rows = _rows(images, bad=False)
    rows.append({"query": "by path", "image": {"bytes": None, "path": "../pages/p9.png"}})
    folder = tmp_path / "ds"
    folder.mkdir()
    table = _table(rows)
    with pa.ipc.new_stream(str(folder / "data-00000-of-00001.arrow"), table.schema) as w:
        w.write_table(table, max_chunksize=3)
    (folder / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": None}))
    (folder / "dataset_info.json").write_text("{}")
    assert detect_format(folder) == "colpali"
    out = tmp_path / "conv" / "ds.jsonl"
    report = convert_colpali(folder, out, progress=False)
    assert report["written"] == 5 and report["skipped_no_query"] == 2
    last = json.loads(out.read_text().splitlines()[-1])
    assert (out.parent / last["chunk_path"]).read_bytes() == images[3]
    assert validate_file(out) == (5, [])


def test_corpus_id_tables_are_refused_with_the_reason(tmp_path):
    src = tmp_path / "queries.parquet"
    pq.write_table(pa.table({"query": ["q"], "positive_passages": [[3]],
                             "negative_passages": [[1, 2]]}), src)
    with pytest.raises(DataError, match="separate corpus"):
        convert_colpali(src, tmp_path / "o.jsonl", progress=False)
