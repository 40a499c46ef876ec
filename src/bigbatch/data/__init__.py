"""Training data: record schema and validation, BEIR directories, records read by index,
batching with exact resume."""

from .batches import EpochBatches
from .readers.beir_dir import BeirData, beir_training_records, load_beir
from .records.loader import load_jsonl_records, load_records
from .records.store import RecordStore, open_records
from .records.types import TrainRecord

__all__ = ["BeirData", "load_beir", "beir_training_records", "TrainRecord", "load_records",
           "load_jsonl_records", "EpochBatches", "open_records", "RecordStore"]
