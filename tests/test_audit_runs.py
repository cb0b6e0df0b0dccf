"""Which runs `batchsweep audit` makes: a run to step s is read from a longer run that kept its weights after that
step, as a run stopped there leaves them, and the first update where two runs part is found with few runs."""
import math

import pytest
import torch
from tqdm import tqdm

from batchsweep.sweeps.audit.command import _auditor, parse_args
from batchsweep.sweeps.audit.diagnose import first_parting
from batchsweep.sweeps.audit.runs import ScriptRun
from tests.test_audit import study


@pytest.mark.slow
def test_a_run_read_from_a_longer_runs_kept_step_is_the_run_stopped_there(tmp_path):
    """BatchNorm in training mode (buffers that each forward moves), SGD with momentum and a clip: the weights,
    the buffers, the trace and the window's gradient of step 3, read from the epoch's run, are those of a run of
    the script stopped after step 3, bit for bit; reading them makes no run."""
    path = study(tmp_path, "batchnorm", "sample", "float32", momentum=0.9, clip=0.5)
    args = parse_args(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri",
                       f"sqlite:///{tmp_path}/mlflow.db"])
    (tmp_path / "runs").mkdir()
    auditor = _auditor(args, tmp_path / "runs")
    auditor.bar = tqdm(disable=True)
    epoch = auditor.run("accumulated", 8, 4, 0)
    read = auditor.run("accumulated", 8, 4, 3)
    assert len(epoch.steps) == 8 and read.folder == epoch.folder and len(auditor.runs) == 1
    stopped = auditor.run("repeat", 8, 4, 3)  # made whatever was made before: the script stopped after step 3
    assert len(auditor.runs) == 2 and stopped.folder != epoch.folder
    grads = [torch.load(run.folder / "grad-3.pt", weights_only=True) for run in (read, stopped)]
    for kept, made in ((read.state, stopped.state), (read.buffers, stopped.buffers), grads):
        assert kept.keys() == made.keys() and kept and all(torch.equal(kept[key], made[key]) for key in kept)
    assert any("running_mean" in key for key in read.buffers)
    assert [(s.events, s.samples, s.lrs, s.losses, s.fingerprint, s.grad_norm) for s in read.steps] == \
        [(s.events, s.samples, s.lrs, s.losses, s.fingerprint, s.grad_norm) for s in stopped.steps]
    assert read.trace.dangling == stopped.trace.dangling == ""


class Parting:
    """Runs whose weights agree up to update `u` and differ from it on, and the steps each run was taken to."""

    def __init__(self, u: int):
        self.u, self.steps = u, []

    def run(self, name: str, b: int, k: int, max_steps: int, lr=None) -> ScriptRun:
        self.steps.append(max_steps)
        parted = name == "accumulated" and max_steps >= self.u
        return ScriptRun(name, b, k, max_steps, 0.1, 1, state={"w": torch.tensor([max_steps + 1.0 + parted])})


@pytest.mark.parametrize("n", [1, 2, 3, 8, 13])
def test_the_first_update_where_runs_part_is_found_anywhere_and_where_the_rows_point_with_two_pairs(n):
    """Wherever the loss rows point (nowhere, or at any step: rounded rows part late, rows in a mistake's scale
    at once), the bisection finds the first update that differs without making the epoch's runs again; where
    they point right (at the parting or the step after it), it takes two pairs of runs at most, and one for the
    last update when the rows agree throughout."""
    for u in range(1, n + 1):
        for rows in (None, *range(1, n + 1)):
            auditor = Parting(u)
            assert first_parting(auditor, 8, 4, n, 1e-10, rows) == u, (u, rows)
            assert max(auditor.steps, default=0) < n  # runs of n steps are the epoch's, made already
            assert len(auditor.steps) <= 2 * (math.ceil(math.log2(n)) + 2)  # pairs, however wrong the rows are
            if rows in (u, u + 1) or rows is None and u == n:
                assert len(auditor.steps) <= 4, (u, rows, auditor.steps)
    last = Parting(n)
    first_parting(last, 8, 4, n, 1e-10, None)
    assert last.steps == ([n - 1, n - 1] if n > 1 else [])
