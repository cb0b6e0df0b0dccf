"""The walk of a configuration through the trainer: which of trainers/' files a reader enters, in order, when
following one `train(config)` call, and how often the path comes back to a file it had already left.

    python benchmarks/walk.py [--package trainers]

The rule. The traced call is a resumed run: a tiny cnn1d on MNIST-1D (2 epochs, b = 32, k = 2, CPU, a
checkpoint folder) stopped by its callback after epoch 1, then `train` again on the same configuration, which
restores the checkpoint and trains epoch 2; only that second call is traced, on the calling thread (the
checkpoint's writer thread is left out). `sys.setprofile` sees every Python call; a call is a step of the walk
when its function is defined in a file of trainers/ and one of its arguments is a `TrainConfig` (the config
itself or one derived from it, e.g. `config.at_epoch(e)`), or an argument other than `self` that carries one as
its `.config` (what the probes are given, `Run`). A method of TrainConfig counts through `self` too
(`at_epoch`, `to_dict`), except its properties (`config.lr` reads a value, a reader does not go there) and its
private and dunder methods (the validation a new config runs on itself). A function counts at its first call
only: a reader reads it once, whatever the epochs and windows that call it again (a generator's resumptions are
calls too). Consecutive steps in one file are one stay; a stay in a file that an earlier stay had
already been in is a return. The setup is the stays before the first epoch's windows are asked for (`Feed.epoch`: device, data, model,
optimizer, loss, probes, checkpoint, resume and the schedule). Prints the stays
(file and the functions entered, in order), the setup's stays and returns, the stays and files, and last
`returns=<n>`.

`--package trainers` measures a checkout from before batchsweep's one installed name (the trainer was then the
top-level package `trainers`): `PYTHONPATH=/path/to/that/checkout python benchmarks/walk.py --package trainers`.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from dataclasses import dataclass, field

import torch


@dataclass
class Stay:
    file: str  # relative to trainers/
    functions: list[str] = field(default_factory=list)


def walk(package, **fields) -> tuple[list[Stay], int]:
    """The stays of a resumed `package.train(TrainConfig(**fields))` (the rule in the module's docstring), and
    how many of them came before the first epoch's windows were asked for (the setup)."""
    config_type, train = package.TrainConfig, package.train
    folder = os.path.dirname(os.path.abspath(package.__file__)) + os.sep
    skipped = {name for name, value in vars(config_type).items()
               if isinstance(value, property) or name.startswith("_")}
    config = config_type(**fields)
    started, stays, setup = set(), [], []

    def profile(frame, event, arg):
        code = frame.f_code
        if not setup and event == "call" and code.co_qualname == "Feed.epoch":
            setup.append(len(stays))  # the first epoch's windows asked for: the setup is the stays before
        if event != "call" or not code.co_filename.startswith(folder):
            return
        if code in started:
            return
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        args = [frame.f_locals.get(name) for name in names]
        if not any(isinstance(a, config_type) or (i or names[0] != "self") and
                   isinstance(getattr(a, "config", None), config_type) for i, a in enumerate(args)):
            return
        if names and names[0] == "self" and isinstance(args[0], config_type) and code.co_name in skipped:
            return
        started.add(code)
        file = code.co_filename[len(folder):]
        if not stays or stays[-1].file != file:
            stays.append(Stay(file))
        stays[-1].functions.append(code.co_qualname)

    class Stop(Exception):
        pass

    def stop(row):
        if row.get("epoch") == 1:
            raise Stop

    with tempfile.TemporaryDirectory() as folder_:
        checkpoint = package.Checkpointing(folder_)
        try:
            train(config, on_epoch=stop, checkpoint=checkpoint)
        except Stop:
            pass
        sys.setprofile(profile)
        try:
            result = train(config, checkpoint=checkpoint)
        finally:
            sys.setprofile(None)
    if result.resumed_after != 1:
        raise SystemExit(f"the traced run did not resume after epoch 1 (resumed_after={result.resumed_after})")
    return stays, setup[0]


def returns(stays: list[Stay]) -> int:
    """The stays in a file that an earlier stay had already been in."""
    seen, count = set(), 0
    for stay in stays:
        count += stay.file in seen
        seen.add(stay.file)
    return count


TINY = dict(model="cnn1d", dataset="mnist1d", physical_batch=32, accum_steps=2, epochs=2, device="cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", default="batchsweep.trainers",
                        help="the trainer's package (trainers: a checkout from before the one installed name)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # (two threads on a shared 2-core machine ran its epochs 10 times slower)
    stays, setup = walk(importlib.import_module(args.package), **TINY)
    seen = set()
    for i, stay in enumerate(stays, 1):
        mark = "return" if stay.file in seen else ""
        seen.add(stay.file)
        functions = ", ".join(dict.fromkeys(stay.functions))
        print(f"{i:3d} {stay.file:16s} {mark:6s} {functions}")
        if i == setup:
            print("    (the first epoch's windows)")
    print(f"the setup: stays={setup} returns={returns(stays[:setup])}")
    print(f"stays={len(stays)} files={len(seen)}")
    print(f"returns={returns(stays)}")
    if not stays:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
