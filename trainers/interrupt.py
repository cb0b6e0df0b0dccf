"""Ctrl-C that is never lost. Python raises KeyboardInterrupt wherever the main thread is; inside a finalizer
(the CPU memory counter lets go of saved tensors in weakref callbacks, many per micro-batch) that exception is
printed as "ignored" and dropped, and the run would go on. The entry points' handler also sets a flag, which
the training loop checks at every optimizer step."""
from __future__ import annotations

import signal
import threading

_interrupted = False


def _handler(signum, frame) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def trap() -> None:
    """Take over SIGINT where Python's own handler has it (not where it is ignored or someone else's)."""
    global _interrupted
    _interrupted = False
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _handler)


def pending() -> bool:
    """Whether a Ctrl-C came since trap() and check() has not raised it again: where code that caught the
    KeyboardInterrupt raised something else instead, this tells the two apart."""
    return _interrupted


def handled() -> None:
    """The KeyboardInterrupt reached the code that ends the run (exit 130): a later run in this process starts
    with none pending."""
    global _interrupted
    _interrupted = False


def check() -> None:
    """Raise the KeyboardInterrupt again if one was dropped since trap(); once."""
    global _interrupted
    if _interrupted:
        _interrupted = False
        raise KeyboardInterrupt
