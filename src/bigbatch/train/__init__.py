"""The training pipeline: configuration, loop, schedules, checkpoints and logging."""

from .config import TrainConfig, load_config
from .loop import train

__all__ = ["TrainConfig", "load_config", "train"]
