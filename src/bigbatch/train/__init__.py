"""The training pipeline: configuration, building a run's parts, the loop, resume checks,
schedules, checkpoints, corpus negatives and logging."""

from .config import TrainConfig, load_config
from .loop import StepCallback, train

__all__ = ["TrainConfig", "load_config", "train", "StepCallback"]
