"""A model for tests of shared work: the built-in mlp, whose first training forward in each process waits until n
processes have reached theirs (BATCHSWEEP_TEST_COMPANY is `folder:n`). No trial of a study then ends before n of its
workers, or machines, hold one: "the work was shared" does not depend on which worker started first on a busy
machine."""
import os
import time

from torch import nn

from batchsweep.trainers.models import mlp as builtin_mlp

WAIT_S = 240  # processes that never meet fail the trial saying so, rather than hang the test
_met = False  # in this process


def meet() -> None:
    global _met
    folder, _, n = os.environ.get("BATCHSWEEP_TEST_COMPANY", "").partition(":")
    if _met or not folder:
        return
    open(os.path.join(folder, str(os.getpid())), "w").close()
    deadline = time.monotonic() + WAIT_S
    while (met := len(os.listdir(folder))) < int(n):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{met} of {n} processes reached training in {WAIT_S} s")
        time.sleep(0.05)
    _met = True


class Company(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.net = builtin_mlp(input_shape, num_classes)

    def forward(self, x):
        if self.training:
            meet()
        return self.net(x)


def mlp(input_shape, num_classes, **_):
    return Company(input_shape, num_classes)
