"""batchsweep's trainer: one configuration, trained with exact gradient accumulation and measured.

Imports torch, torchvision and mnist1d only, so it runs on a bare GPU machine. This is its whole surface for
sweeps/ (tests/test_house.py holds it to that); the benchmarks and tests also reach into its modules. Each name
is imported where it is first used (PEP 562), so that `from trainers import ConfigError` does not import torch:
the commands' --help and bad flags answer at once.
"""
import importlib

# name: (its module, its name there; None for the module itself)
_SURFACE = {
    "CHECKPOINT_FILE": ("checkpoint", "FILE"), "HOW_NOT_WHAT": ("checkpoint", "HOW_NOT_WHAT"),
    "Checkpointing": ("checkpoint", "Checkpointing"), "make_writable_folder": ("checkpoint", "make_writable_folder"),
    "pid_alive": ("checkpoint", "pid_alive"), "check_output": ("cli", "check_output"),
    "INVOKED": ("cli", "INVOKED"), "OneLineParser": ("cli", "OneLineParser"),
    "format_bytes": ("cli", "format_bytes"),
    "DERIVED": ("config", "DERIVED"), "FIELDS": ("config", "FIELDS"), "MAX_COUNT": ("config", "MAX_COUNT"),
    "TrainConfig": ("config", "TrainConfig"),
    "parse_overrides": ("config", "parse_overrides"), "parse_value": ("config", "parse_value"),
    "BatchsweepError": ("errors", "BatchsweepError"), "ConfigError": ("errors", "ConfigError"),
    "DataError": ("errors", "DataError"), "import_object": ("imports", "import_object"),
    "interrupt": ("interrupt", None), "METRICS": ("loop", "METRICS"), "TrainResult": ("loop", "TrainResult"),
    "device_name": ("build", "device_name"), "memory_source": ("build", "memory_source"),
    "load": ("build", "load"), "preflight": ("build", "preflight"), "prepare": ("build", "prepare"),
    "resolve_device": ("build", "resolve_device"), "train": ("loop", "train"),
    "fold_noise": ("noise", "fold"), "noise_scale": ("noise", "value"),
    "NotFusable": ("fused", "NotFusable"), "group_key": ("fused", "group_key"), "train_fused": ("fused", "train_fused"),
}
__all__ = sorted(_SURFACE)


def __getattr__(name: str):
    if name not in _SURFACE:
        raise AttributeError(f"module 'trainers' has no attribute {name!r}")
    module, attribute = _SURFACE[name]
    module = importlib.import_module(f"{__name__}.{module}")
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # the next use is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
