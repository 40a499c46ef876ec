"""colpali-engine / ViDoRe Parquet (page images held in the rows), converted, trains a tiny
Qwen-VL retriever; the unconverted file is refused before training with the command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bigbatch.cli import main
from bigbatch.data import load_records
from bigbatch.errors import DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def test_converted_colpali_parquet_trains(tiny_vl, page_images, tmp_path):
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    rows = [{"query": f"what does page {i} show?",
             "image": {"bytes": Path(p).read_bytes(), "path": Path(p).name}}
            for i, p in enumerate(page_images)]
    src = tmp_path / "colpali_train.parquet"
    pq.write_table(pa.table({"query": [r["query"] for r in rows],
                             "image": pa.array([r["image"] for r in rows], image),
                             "source": ["docvqa"] * len(rows)}), src)
    with pytest.raises(DataError, match="convert it first: bigbatch convert --from colpali"):
        load_records(src)
    data = tmp_path / "train.jsonl"
    assert main(["convert", str(src), str(data)]) == 0
    model = tiny_vl("qwen2_vl")
    out = tmp_path / "run"
    assert main(["train", "--model", str(model), "--train-data", str(data), "--output-dir",
                 str(out), "--batch-size", "4", "--grad-cache-chunk", "2", "--max-steps", "2",
                 "--warmup-steps", "1", "--eval-steps", "0", "--save-steps", "0",
                 "--lora-r", "4", "--lora-alpha", "8", "--max-length", "32",
                 "--max-num-visual-tokens", "16"]) == 0
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]
