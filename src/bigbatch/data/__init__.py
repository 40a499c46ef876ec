"""Training data: record schema and validation, BEIR directories, records read by index,
batching with exact resume."""

from .beir import BeirData, load_beir, beir_training_records
from .records import load_records, load_jsonl_records
from .types import TrainRecord
from .batches import EpochBatches
from .record_store import RecordStore, open_records

__all__ = ["BeirData", "load_beir", "beir_training_records", "TrainRecord", "load_records",
           "load_jsonl_records", "EpochBatches", "open_records", "RecordStore"]
