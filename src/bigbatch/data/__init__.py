"""Training data: record schema and validation, BEIR directories, records read by index,
batching with exact resume."""

from .readers.beir_dir import BeirData, load_beir, beir_training_records
from .records.loader import load_records, load_jsonl_records
from .records.types import TrainRecord
from .batches import EpochBatches
from .records.store import RecordStore, open_records

__all__ = ["BeirData", "load_beir", "beir_training_records", "TrainRecord", "load_records",
           "load_jsonl_records", "EpochBatches", "open_records", "RecordStore"]
