"""batchsweep's trainer: one configuration, trained with exact gradient accumulation and measured.

Imports torch, torchvision and mnist1d only, so it runs on a bare GPU machine. This is its whole surface:
sweeps/ and the benchmarks use nothing else of it.
"""
from . import interrupt
from .checkpoint import FILE as CHECKPOINT_FILE
from .checkpoint import HOW_NOT_WHAT, Checkpointing, make_writable_folder, pid_alive
from .cli import format_bytes
from .config import FIELDS, MAX_COUNT, BatchsweepError, ConfigError, TrainConfig, parse_overrides, parse_value
from .data import DataError
from .imports import import_object
from .loop import METRICS, TrainResult, device_name, memory_source, prepare, resolve_device, train

__all__ = ["CHECKPOINT_FILE", "FIELDS", "HOW_NOT_WHAT", "MAX_COUNT", "METRICS", "BatchsweepError", "Checkpointing",
           "ConfigError", "DataError", "TrainConfig", "TrainResult", "device_name", "format_bytes", "import_object",
           "interrupt", "make_writable_folder", "memory_source", "parse_overrides", "parse_value", "pid_alive",
           "prepare", "resolve_device", "train"]
