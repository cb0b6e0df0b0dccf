"""batchsweep's trainer: one configuration, trained with exact gradient accumulation and measured.

Imports torch, torchvision and mnist1d only, so it runs on a bare GPU machine.
"""
from .config import BatchsweepError, ConfigError, TrainConfig
from .data import DataError
from .loop import TrainResult, train

__all__ = ["BatchsweepError", "ConfigError", "DataError", "TrainConfig", "TrainResult", "train"]
