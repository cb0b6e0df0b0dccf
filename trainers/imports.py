"""Resolve user code given as `package.module:factory`. Importing it runs that code."""
from __future__ import annotations

import importlib
import os
import sys
from typing import Callable

from .errors import ConfigError


def import_object(path: str, what: str):
    """The object that `package.module:name` names (None when the module lacks it)."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{what} import path {path!r} is malformed: write package.module:name")
    if os.getcwd() not in sys.path:  # like `python -m`: the user's own modules from the current folder
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure while importing user code
        raise ConfigError(f"{what} import path {path!r} does not import ({type(exc).__name__}: {exc}): "
                          f"check the module is on PYTHONPATH or in the current folder") from None
    return getattr(module, attr, None)


def load_factory(path: str, what: str) -> Callable:
    factory = import_object(path, what)
    if not callable(factory):
        module_name, _, attr = path.partition(":")
        raise ConfigError(f"{what} import path {path!r}: module {module_name!r} has no callable {attr!r}")
    return factory
