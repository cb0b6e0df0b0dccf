"""batchsweep's tracer: what a training script does, seen from inside its own process through PyTorch's global
hooks, with no edit to the script. sitecustomize.py (beside this file, on PYTHONPATH) installs it in every Python
process of a command that batchsweep launches, children included; it needs torch and nothing else, so that it
runs in whatever interpreter the command names. Its files sit beside this one, each imported here at start-up
(while the tracer's folder is on sys.path): batchsweep_trace_window.py (the record of the process),
batchsweep_trace_hooks.py (the hooks that feed it), batchsweep_trace_tensors.py (how it reads tensors) and
batchsweep_trace_sites.py (where in the script a call was made).

It writes one JSON line per optimizer step into $BATCHSWEEP_TRACE/trace-<pid>.jsonl:
    {"step": 3, "events": "ZFBFBCS", "samples": [8, 8], "fingerprint": [s, s2], "lrs": [0.1],
     "grad_norm": 1.7, "clip": 1.0, "skipped": false, "wall_s": 0.012, ...}
(the steps of every optimizer, each window holding what happened since the step before, whichever optimizer made
it; "opt" numbers them where more than one stepped), and at the process's end the model ({"trained": [...],
"random_modules": [...], "random_draws": [...], "random_late": [...]}: modules random by kind at the first step,
where a generator moved in the first windows, modules random by kind at the end only), the DataLoaders it
iterated ({"loaders": [[size, batch], ...]}), the places of its calls ({"sites": [...]}) and on a GPU the
allocator's peak.
`events` are what happened since the step before, in order: F a training forward of a model (a root module call
with parameters, in training mode, with grad enabled), B backward(), Z zero_grad(), C clip_grad_norm_(), L a
scheduler step (a scheduler's own construction, and the steps a SequentialLR or ChainedScheduler makes of its
children, are not the script's), S the optimizer step (K: a step that a GradScaler skipped); `at` names, for each
event but F, the place in the script that made the call (an index into "sites": the caller's file and line outside
torch). `samples` are the first dimension of the first model's first tensor input at each micro-batch (the forwards
before each backward), `fingerprint` the sum and the sum of squares of those inputs over the window, in float64: the
same samples give the same two numbers. The first model is the first module called in training mode with grad
enabled and parameters, outside any other module's call; the models whose weights are saved are those of the modules
so called whose parameters the optimizer trains (a frozen encoder called first is not one), chosen at the first step
(global hooks find them until then; then a hook of the first one's own follows it, so that no other module pays).

Variables (all optional but the first):
    BATCHSWEEP_TRACE        the folder it writes into
    BATCHSWEEP_TRACE_STOP   stop the process (exit status 0) after this many optimizer steps
    BATCHSWEEP_TRACE_SAVE   "1": save the model's state dict at its first training forward (start.pt, the weights
                            before any update) and at the stop or the process's end (state.pt)
    BATCHSWEEP_TRACE_GRADS  steps (1, 3, ...) whose window gradient, before any clipping, is saved (grad-<s>.pt);
                            "last": the last step's, whichever it is (a copy is kept at every step)
                            (ranks other than 0 save theirs as start-r<rank>.pt, state-r<rank>.pt, ...)
    BATCHSWEEP_TRACE_KEEP   bytes: the weights after each step and its window's gradient (state-<s>.pt, grad-<s>.pt)
                            for the first steps whose files fit in them (twice the state dict a step), as a run
                            stopped there would have left them
    BATCHSWEEP_TRACE_LOSS   "1": record each backward's loss (a synchronization per micro-batch on a GPU)
    BATCHSWEEP_TRACE_DATA   "1": the fingerprint of each window's inputs
    BATCHSWEEP_TRACE_NOISE  "1": each micro-batch's own gradient's squared norm (`micro_sq`), for the noise scale,
                            in one window of NOISE_EVERY (not across ranks)
"""
from __future__ import annotations

import functools
import importlib.abc
import os
import sys

from batchsweep_trace_hooks import install_hooks, uninstall
from batchsweep_trace_tensors import grad_norm, plain
from batchsweep_trace_window import NOISE_EVERY, Tracer

__all__ = ["NOISE_EVERY", "Tracer", "grad_norm", "install_hooks", "plain", "start", "uninstall"]


class AfterTorch(importlib.abc.MetaPathFinder):
    """Runs `then` once torch's module has executed: its spec's loader is wrapped for that one import."""

    def __init__(self, then):
        self.then = then

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        loader, then = spec.loader, self.then

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                spec.loader = module.__loader__ = loader  # torch sees its own loader afterwards
                loader.exec_module(module)
                then()

        spec.loader = Loader()
        return spec


# Not files a trial could share with another: devices (/dev/null), the kernel's views of processes and devices.
NOT_FILES = ("/dev/", "/proc/", "/sys/")


def watch_writes(folder: str):
    """Each file this process writes, once, as a line of writes-<pid>.txt, written at once: the sweep compares
    them between trials that run at the same time. Seen: what open() opens for writing (numpy, json, logging,
    pickle) and the target of os.rename and os.replace (an atomic save); torch.save writes a path through its
    own C++ writer, which open() never sees, so `watch_saves` wraps it. Returns the function that records one."""
    seen, out = set(), []

    def record(name) -> None:
        name = os.path.abspath(os.fsdecode(name))
        if "\n" in name or name in seen or name.startswith(NOT_FILES):
            return
        seen.add(name)
        if not out:
            out.append(os.open(os.path.join(folder, f"writes-{os.getpid()}.txt"),
                               os.O_WRONLY | os.O_CREAT | os.O_APPEND))
        os.write(out[0], os.fsencode(name + "\n"))

    def hook(event, args):
        if event == "os.rename" and isinstance(args[1], (str, bytes)) and args[3] in (None, -1):
            record(args[1])  # (relative to the working folder: a dst_dir_fd is not followed)
        elif event == "open" and isinstance(args[1], str) and any(c in args[1] for c in "wax+"):
            if isinstance(args[0], (str, bytes)):  # (not a file descriptor; os.open's mode is None: the write of
                record(args[0])                    # writes-<pid>.txt above never comes back here)

    sys.addaudithook(hook)
    return record


def watch_saves(record) -> None:
    """torch.save to a path (not to a file object, which open() made) is recorded as written."""
    import torch

    save = torch.save

    @functools.wraps(save)
    def saving(obj, f, *args, **kwargs):
        if isinstance(f, (str, bytes, os.PathLike)):
            record(f)
        return save(obj, f, *args, **kwargs)

    torch.save = torch.serialization.save = saving


def start() -> None:
    folder = os.environ.get("BATCHSWEEP_TRACE")
    if not folder or not os.path.isdir(folder):
        return
    record = watch_writes(folder)
    tracer = Tracer(folder)

    def after_torch() -> None:
        watch_saves(record)
        installed(tracer)

    if "torch" in sys.modules:
        after_torch()
    else:
        sys.meta_path.insert(0, AfterTorch(after_torch))


def installed(tracer: Tracer) -> None:
    """The hooks, or where this torch lacks what they need, one line saying why in the trace folder: the script
    runs unobserved rather than fail inside its own `import torch`, and none of the hooks put in before the one
    that failed stays (half a tracer would write windows that miss calls)."""
    try:
        install_hooks(tracer)
    except Exception as exc:  # (an older torch: a hook API it does not have)
        import torch

        uninstall(tracer)
        with open(os.path.join(tracer.folder, f"unobservable-{os.getpid()}.txt"), "w") as f:
            f.write(f"the tracer cannot observe torch {torch.__version__}: {type(exc).__name__}: {exc}\n")
