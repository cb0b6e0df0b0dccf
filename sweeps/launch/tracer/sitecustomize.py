"""Python runs this at start-up where batchsweep put this folder first on PYTHONPATH: the environment's own
sitecustomize (if any) runs first, as it would have without batchsweep, then the tracer starts."""
import importlib
import os
import sys


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as exc:
        if exc.name != "sitecustomize":
            raise
    finally:
        sys.path[:] = saved
        sys.modules["sitecustomize"] = ours


_chain()
if os.environ.get("BATCHSWEEP_TRACE"):
    import batchsweep_trace

    batchsweep_trace.start()
