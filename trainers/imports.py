"""Resolve user code given as `package.module:factory`. Importing it runs that code."""
from __future__ import annotations

import importlib
from typing import Callable

from .config import ConfigError


def load_factory(path: str, what: str) -> Callable:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{what} import path {path!r} is malformed: write package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure while importing user code
        raise ConfigError(f"{what} import path {path!r} does not import ({type(exc).__name__}: {exc}): "
                          f"check the module is on PYTHONPATH") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"{what} import path {path!r}: module {module_name!r} has no callable {attr!r}")
    return factory
