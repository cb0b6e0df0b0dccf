"""batchsweep's trainer: one configuration, trained with exact gradient accumulation and measured.

Imports torch, torchvision and mnist1d only, so it runs on a bare GPU machine.
"""
from .checkpoint import Checkpointing
from .config import BatchsweepError, ConfigError, TrainConfig
from .data import DataError
from .loop import METRICS, TrainResult, train

__all__ = ["METRICS", "BatchsweepError", "Checkpointing", "ConfigError", "DataError", "TrainConfig", "TrainResult",
           "train"]
