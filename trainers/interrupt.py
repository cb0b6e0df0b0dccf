"""A stop that is never lost: Ctrl-C, SIGINT sent to the process alone, and SIGTERM (`kill`, `timeout`, a
scheduler's cancel, `docker stop`) all raise KeyboardInterrupt, so that every one of them ends a run as Ctrl-C
does. Python raises it wherever the main thread is; inside a finalizer (the CPU memory counter lets go of saved
tensors in weakref callbacks, many per micro-batch) that exception is printed as "ignored" and dropped, and the
run would go on. The handler also sets a flag, which the training loop checks at every optimizer step."""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time

STOPS = (signal.SIGINT, signal.SIGTERM)
# A second stop this soon after the first is the same stop: `timeout` sends its signal to the command and then to
# the command's process group, which holds the command too, and a scheduler may do the same.
REPEAT_S = 1.0
_interrupted = False
_signal: int | None = None  # the first stop signal since trap()
_first_at = 0.0
_once = False  # a worker's: a second signal only sets the flag (its main process ends it at once where asked)
_held = False  # between hold() and release(): a stop only sets the flag


def _handler(signum, frame) -> None:
    global _interrupted, _signal, _first_at
    first = _signal is None
    if first:
        _first_at = time.monotonic()
    _interrupted, _signal = True, _signal or signum
    if _held:
        return
    if first or not _once and time.monotonic() - _first_at >= REPEAT_S:
        raise KeyboardInterrupt


def trap(once: bool = False) -> None:
    """Take over SIGINT and SIGTERM where nobody else's Python handler has them: also where SIGINT is ignored (a
    study started in the background), since a signal sent to this process on purpose must stop it. With `once`
    (a study's worker process), only the first raises."""
    global _interrupted, _signal, _once
    _interrupted, _signal, _once = False, None, once
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOPS:
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler, None):
            signal.signal(sig, _handler)
    if sys.unraisablehook is not _unraisable:
        _unraisable.default = sys.unraisablehook
        sys.unraisablehook = _unraisable


def _unraisable(unraisable) -> None:
    """A stop that landed in a finalizer (SQLAlchemy's and the memory counter's weakref callbacks): Python would
    print it as "Exception ignored" with a traceback. The flag holds it (check() raises it at the next step), so
    it is not printed; any other unraisable exception is, as before."""
    if issubclass(unraisable.exc_type, KeyboardInterrupt) and _interrupted:
        return
    _unraisable.default(unraisable)


_unraisable.default = sys.unraisablehook


@contextlib.contextmanager
def trapped():
    """trap() for the length of a command run inside another program (a test calling main()): the handlers that
    were there before come back after it."""
    before = {sig: signal.getsignal(sig) for sig in STOPS}
    trap()
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in before.items():
                if handler is not None:
                    signal.signal(sig, handler)


def pending() -> bool:
    """Whether a stop came since trap() and check() has not raised it again: where code that caught the
    KeyboardInterrupt raised something else instead, this tells the two apart."""
    return _interrupted


def received() -> str:
    """What stopped this process, as a line names it: 'interrupted' (SIGINT, Ctrl-C) or 'stopped by SIGTERM'."""
    return "stopped by SIGTERM" if _signal == signal.SIGTERM else "interrupted"


def handled() -> None:
    """The KeyboardInterrupt reached the code that ends the run (exit 130): a later run in this process starts
    with none pending."""
    global _interrupted, _signal
    _interrupted, _signal = False, None


def hold() -> None:
    """Until release(), a stop only sets the flag. Optuna creates a trial RUNNING before the objective can give it
    an owner; a stop that lands between the two would leave a trial that nobody records as interrupted."""
    global _held
    _held = True


def release() -> None:
    """End hold(), raising the stop it held; where none is held, nothing."""
    global _held
    if _held:
        _held = False
        check()


def check() -> None:
    """Raise the KeyboardInterrupt again if one was dropped since trap(); once."""
    global _interrupted
    if _interrupted:
        _interrupted = False
        raise KeyboardInterrupt
