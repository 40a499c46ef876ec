"""Training data: record schema and validation, BEIR directories, records read by index,
batching with exact resume.

The names are imported when first used, so the readers and formats (``bigbatch validate``,
``convert``, the command line's help) do not import torch."""

from typing import TYPE_CHECKING

from .._lazy import lazy_names

__all__ = ["BeirData", "load_beir", "beir_training_records", "TrainRecord", "load_records",
           "load_jsonl_records", "EpochBatches", "open_records", "RecordStore"]

__getattr__, __dir__ = lazy_names(__name__, {
    "EpochBatches": ".batches", "BeirData": ".readers.beir_dir",
    "beir_training_records": ".readers.beir_dir", "load_beir": ".readers.beir_dir",
    "load_jsonl_records": ".records.loader", "load_records": ".records.loader",
    "RecordStore": ".records.store", "open_records": ".records.store",
    "TrainRecord": ".records.types"})

if TYPE_CHECKING:  # for type checkers, editors and the docs: the same names, imported eagerly
    from .batches import EpochBatches
    from .readers.beir_dir import BeirData, beir_training_records, load_beir
    from .records.loader import load_jsonl_records, load_records
    from .records.store import RecordStore, open_records
    from .records.types import TrainRecord
