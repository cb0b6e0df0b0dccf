"""Tracking overhead of a study: the share of the trials' wall time spent outside the trainer.

Everything a worker does between and around `train()` calls counts as overhead: Optuna storage reads and
writes (claiming a point, user attributes, tell), MLflow runs, batched logging and the history artifact.
Runs trials of a study into a temporary SQLite store and prints `overhead=<fraction>` on the last line.

    python benchmarks/sweep_overhead.py [--study accum_lr] [--trials 6] [--epochs N] [--system-metrics]

With --system-metrics, MLflow's system-metrics monitor runs beside every trial (sampled every second): the
difference in overhead between a run with and one without it is what it costs.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import optuna

import batchsweep.sweeps.trials.objective as objective
from batchsweep.sweeps.cli import build_invocation, parse_args
from batchsweep.sweeps.stores.optuna_store import create_studies, open_storage
from batchsweep.sweeps.trials.worker import Worker
from batchsweep.sweeps.stores.mlflow_store import Tracker
from batchsweep.trainers.cli import run_script


def timed_trainer() -> list[float]:
    """Make every train() that the sweeps call append its duration to the list returned (for this process)."""
    durations: list[float] = []
    train = objective.train

    def timed_train(*args, **kwargs):  # whatever the objective passes (a checkpoint, probes) passes through
        start = time.perf_counter()
        try:
            return train(*args, **kwargs)
        finally:
            durations.append(time.perf_counter() - start)

    objective.train = timed_train
    return durations


def check_complete(inv, storage, ran: int) -> None:
    """A benchmark that measured failing trials, or none, measured nothing: exit non-zero, never a figure."""
    trials = [t for name in inv.study_names() for t in optuna.load_study(study_name=name, storage=storage).trials
              if t.user_attrs.get("reason") != "duplicate"]
    bad = [t for t in trials if t.state != optuna.trial.TrialState.COMPLETE]
    if not ran or bad:
        reason = bad[0].user_attrs.get("reason", bad[0].state.name) if bad else "no trial ran"
        raise SystemExit(f"error: {len(bad)} of {len(trials)} trials did not complete ({reason}): nothing measured")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", default="accum_lr")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--epochs", help="default: the study's own")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--system-metrics", action="store_true")
    args = parser.parse_args()

    in_train = timed_trainer()
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # as sweeps/run.py does
    with tempfile.TemporaryDirectory() as folder:
        argv = ["--study", args.study, "--n-trials", str(args.trials), "--set", f"data_dir={args.data_dir}",
                "--storage", f"sqlite:///{folder}/optuna.db", "--tracking-uri", f"sqlite:///{folder}/mlflow.db",
                "--checkpoint-dir", f"{folder}/checkpoints"]
        argv += (["--epochs", args.epochs] if args.epochs else []) + (["--system-metrics"] * args.system_metrics)
        inv = build_invocation(parse_args(argv))
        create_studies(inv, open_storage(inv.storage))
        tracker = Tracker(inv.tracking_uri, inv.study_name)
        parent = tracker.start_parent("overhead", {}, {})
        worker = Worker(inv, parent)
        start = time.perf_counter()
        ran = worker.run(inv.n_trials)
        total = time.perf_counter() - start
        check_complete(inv, worker.storage, ran)
    outside = total - sum(in_train)
    print(f"study={args.study} trials={ran} epochs={inv.base.epochs} store=SQLite "
          f"system_metrics={args.system_metrics}")
    print(f"wall time {total:.2f} s, in the trainer {sum(in_train):.2f} s, outside it {outside:.2f} s "
          f"({outside / ran * 1000:.0f} ms a trial)")
    print(f"overhead={outside / total:.4f}")


if __name__ == "__main__":
    run_script(main)
