"""Training data: record schema and validation, BEIR directories, batching with exact resume."""

from .beir import BeirData, load_beir, beir_training_records
from .records import load_records, load_jsonl_records
from .types import TrainRecord
from .batches import EpochBatches

__all__ = ["BeirData", "load_beir", "beir_training_records", "TrainRecord", "load_records",
           "load_jsonl_records", "EpochBatches"]
