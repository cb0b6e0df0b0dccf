"""The worked examples of docs/programs.md, each swept at a small size: a transformers Trainer script that
prints JSON lines, and a Lightning script that logs through its own MLFlowLogger. They need the optional
extra (pip install -e '.[scripts]'), which CI installs."""
import importlib.util
import math

import optuna
import pytest

from tests.conftest import ROOT
from tests.test_sweeps import child_runs, stores, sweep

EXTRA = "pip install -e '.[scripts]'"


def needs(*modules: str):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}: {EXTRA}")


def swept(tmp_path, example: str, name: str, steps_per_epoch: int):
    """Two trials of the example's study, one epoch each: every run complete, with per-epoch val_acc at the
    step the script logged it and its memory measured."""
    proc = sweep(tmp_path, "--study", str(ROOT / "examples" / example / "study.toml"), "--n-trials", "2",
                 "--epochs", "1", "--workers", "1", "--no-report", timeout=600)
    assert proc.returncode == 0, proc.stderr
    storage, client = stores(tmp_path)
    trials = optuna.load_study(study_name=name, storage=storage).trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    children, _ = child_runs(client, name)
    for run in children:
        assert run.info.status == "FINISHED"
        b, k = int(run.data.params["physical_batch"]), int(run.data.params["accum_steps"])
        [acc] = client.get_metric_history(run.info.run_id, "val_acc")
        assert acc.step == steps_per_epoch(b, k) and 0.5 < acc.value <= 1
        assert run.data.metrics["peak_memory_bytes"] > 100 * 2 ** 20
    return children


@needs("transformers", "accelerate")
def test_a_transformers_trainer_script_swept_by_program(tmp_path):
    children = swept(tmp_path, "hf_trainer", "hf_trainer", lambda b, k: 1)  # its JSON rows: the epoch
    for run in children:
        assert len(run.data.params) and "loss" in run.data.metrics


@needs("lightning")
def test_a_lightning_script_logging_through_its_mlflow_logger(tmp_path):
    # Lightning logs at its global step: the optimizer steps of the epoch's full windows, less one (0-based),
    # and one more for a short last window.
    swept(tmp_path, "lightning", "lightning", lambda b, k: math.ceil(math.ceil(1000 / b) / k) - 1)
