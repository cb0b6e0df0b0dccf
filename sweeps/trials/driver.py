"""Running a study: its worker processes, the progress bars, the parent MLflow run, the report at the end."""
from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

from batchsweep.trainers import BatchsweepError, interrupt, make_writable_folder

from ..commands import command
from ..stores.outcomes import OUTCOMES, outcome_of
from ..launch.processes import TOKEN_VARIABLE, die_with_parent, killed_of, left_behind, worker_token
from ..study.spec import describe
from .places import FIX
from .tables import results_table
from ..stores.mlflow_store import (HOST, Tracker, TrackingError, first_line, git_commit, quiet_library_logs,
                                   standard_tags)
from ..stores.urls import redact, runs_address

# A worker's message that moves the bar: counting this invocation's trials, not the study's, keeps the bar
# right when another machine's workers share the study or a point claimed twice is given back. Its bar over
# epochs moves by ("start", worker, trial name, epochs, time) and ("epoch", worker, metrics, time), each at
# the time.time() that the worker sent it.
TRIAL_DONE = "\0trial done"
STOP_GRACE_S = 30  # how long a stopped worker may take to record its trial before it is killed


def epoch_bar(position: int):
    """The bar over one trial's epochs, under the bar over trials: a frame for every epoch (however fast)."""
    from tqdm import tqdm

    return tqdm(total=0, unit="epoch", file=sys.stderr, dynamic_ncols=True, position=position, leave=False,
                mininterval=0, miniters=1)


def start_trial(bar, name: str, epochs: int | None) -> None:
    """One frame: the trial's name, at epoch 0, and no metric of the trial before it. (Also an audit's script
    run, over steps, of no total where it runs an epoch.)"""
    bar.set_description_str(name, refresh=False)  # (set_description's ': ' doubles on a bar of no total)
    bar.set_postfix_str("", refresh=False)
    bar.total = epochs  # (reset(total=None) would keep the last one's)
    bar.reset()


def end_epoch(bar, metrics: dict[str, str]) -> None:
    bar.set_postfix(metrics, refresh=False)  # the metric and its epoch in the same frame
    bar.update(1)


def show_epoch(epochs: list, message: tuple) -> None:
    """A worker's message on its bar over epochs, timed by when the worker sent it (time.time(), tqdm's own
    clock): the main process shows a second's messages together, and by its clock a 0.3 s epoch read as 10,000
    epoch/s."""
    kind, index, *args, when = message
    epochs[index]._time = lambda: when  # tqdm reads its clock through this attribute
    (start_trial if kind == "start" else end_epoch)(epochs[index], *args)


def shown(inv, row: dict) -> dict[str, str]:
    """An epoch's objective metrics, as its bar shows them."""
    return {m: f"{row[m]:.3f}" for m in inv.study.metrics if m in row}


def _worker_process(inv, parent_run_id: str, index: int, budget: int | None, messages, placement=None,
                    parent: int = 0, token: str = "") -> None:
    """One of --workers N: one torch thread (several multi-threaded workers thrash a small CPU); its lines go
    to the main process, which prints them above the bars. A fatal error is its last line, and exit status 2.
    With a placement it sees one GPU (its CUDA_VISIBLE_DEVICES was set when it started). It never outlives the
    main process: the kernel sends it SIGTERM when the main process dies, however (SIGKILL included), and it
    records its trial as interrupted. What it starts carries `token` (see stop_tagged)."""
    if token:
        os.environ[TOKEN_VARIABLE] = token
    interrupt.trap(once=True)  # a second stop is the main process's to act on
    ask = die_with_parent()
    if ask is not None:
        ask()
    if parent and os.getppid() != parent:  # the main process died before the request
        return
    import optuna
    import torch

    from .worker import Progress, Worker

    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    quiet_library_logs()
    try:
        hooks = Progress(say=messages.put, trial_done=lambda t: messages.put(TRIAL_DONE),
                      trial_start=lambda name, epochs: messages.put(("start", index, name, epochs, time.time())),
                      epoch_done=lambda row: messages.put(("epoch", index, shown(inv, row), time.time())))
        Worker(inv, parent_run_id, index, hooks, placement).run(budget)
    except KeyboardInterrupt:
        pass
    except BatchsweepError as exc:
        messages.put(f"error: {exc}")
        sys.exit(2)


def _sweep(procs: list, tokens: list[str], swept: set) -> None:
    """What each ended worker left running (a daemon its script double-forked, where it was killed): stopped."""
    from tqdm import tqdm

    for i in [i for i, proc in enumerate(procs) if i not in swept and not proc.is_alive()]:
        swept.add(i)
        if line := left_behind(tokens[i].__eq__, f"worker {i} ended leaving"):
            tqdm.write(line, file=sys.stderr)


def _drain(messages, fatal: list, bar=None, epochs: list | None = None) -> None:
    """The workers' messages: their lines above the bars, and the bars moved (none once they are closed); a
    worker's error goes to `fatal`."""
    from tqdm import tqdm

    while True:
        try:
            line = messages.get_nowait()
        except queue.Empty:
            return
        if isinstance(line, tuple):
            if epochs:
                show_epoch(epochs, line)
        elif line == TRIAL_DONE:
            if bar is not None:
                bar.update(1)
        elif line.startswith("error: "):
            fatal.append(line.removeprefix("error: "))
        else:
            tqdm.write(line, file=sys.stderr)


def run_workers(inv, parent_run_id: str, workers: int, total: int, placements: list) -> None:
    """Start the worker processes (each on its GPU, where there are placements) and draw a bar over the
    study's trials while they work, and under it a bar over each worker's epochs."""
    from tqdm import tqdm

    budgets = [None] * workers if inv.n_trials is None else \
        [inv.n_trials // workers + (i < inv.n_trials % workers) for i in range(workers)]
    ctx = multiprocessing.get_context("spawn")
    messages = ctx.Queue()
    placements = placements or [None] * workers
    tokens = [worker_token(i, inv.storage + inv.study_name) for i in range(workers)]
    procs = [ctx.Process(target=_worker_process, args=(inv, parent_run_id, i, b, messages, placements[i],
                                                       os.getpid(), tokens[i])) for i, b in enumerate(budgets)]
    for proc, placement in zip(procs, placements):
        start_on(proc, placement)
    fatal, swept = [], set()
    sweep, drain = partial(_sweep, procs, tokens, swept), partial(_drain, messages, fatal)
    try:
        with tqdm(total=total, unit="trial", file=sys.stderr, dynamic_ncols=True, position=0) as bar:
            epochs = [epoch_bar(i + 1) for i in range(workers)]
            try:
                while any(p.is_alive() for p in procs):
                    time.sleep(1.0)
                    interrupt.check()
                    drain(bar, epochs)
                    sweep()
                    bar.refresh()  # the elapsed time moves on between trials too
                for proc in procs:
                    proc.join()
                drain(bar, epochs)
                sweep()
            finally:
                for epoch in reversed(epochs):
                    epoch.close()
    except KeyboardInterrupt:
        try:
            stop_workers(procs, drain)
        finally:
            sweep()
        raise
    if fatal:
        raise BatchsweepError(fatal[0])
    for i, proc in enumerate(procs):
        if proc.exitcode is not None and proc.exitcode < 0:  # e.g. the kernel's out-of-memory killer
            print(f"warning: worker {i} was killed by {signal.Signals(-proc.exitcode).name}; its trial is marked "
                  f"failed, and its point runs again (in this invocation, or the next)", file=sys.stderr)


def stop_workers(procs, drain=lambda: None) -> None:
    """After a stop signal (Ctrl-C, SIGINT to this process alone, SIGTERM): each worker gets SIGTERM, records its
    trial as interrupted and ends (from a terminal it got SIGINT too; a worker acts on the first signal alone). A
    second signal to this process ends them at once, as does a worker that is not done in STOP_GRACE_S. Their
    lines are read meanwhile (`drain`): a worker whose queue is full would not end."""
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGTERM)
    try:
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            alive = [p for p in procs if p.is_alive()]
            if not alive:
                break
            drain()
            alive[0].join(timeout=0.1)
    finally:  # (a second signal lands here as KeyboardInterrupt)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


def start_on(proc, placement) -> None:
    """Start a worker process that sees only its placement's GPU, from its first instruction on."""
    if placement is None:
        return proc.start()
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = placement.gpu.index
    try:
        proc.start()
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def run_in_process(inv, parent_run_id: str, total: int, placement=None) -> None:
    from tqdm import tqdm

    from .worker import Progress, Worker

    trials = tqdm(total=total, unit="trial", file=sys.stderr, dynamic_ncols=True, position=0)
    epochs = epoch_bar(1)
    hooks = Progress(trial_done=lambda t: trials.update(1),
                  trial_start=lambda name, n: start_trial(epochs, name, n),
                  epoch_done=lambda row: end_epoch(epochs, shown(inv, row)),
                  say=lambda line: tqdm.write(line, file=sys.stderr))
    before = os.environ.get(TOKEN_VARIABLE)
    os.environ[TOKEN_VARIABLE] = worker_token(0, inv.storage + inv.study_name)  # (killed: the next one looks)
    try:
        return Worker(inv, parent_run_id, 0, hooks, placement).run(inv.n_trials)
    finally:
        epochs.close()
        trials.close()
        if before is None:
            del os.environ[TOKEN_VARIABLE]
        else:
            os.environ[TOKEN_VARIABLE] = before


def write_report(inv) -> int:
    """Run `analysis/report.py` as its own command: the analysis reads MLflow, never the sweep code. The
    tracking URI goes through the environment (MLFLOW_TRACKING_URI), never on a command line that `ps` shows."""
    script = Path(__file__).resolve().parents[2] / "analysis" / "report.py"
    # The table of trials is out; the report reads every run's history and draws its figures (20 s for the
    # default study on 2 cores): a line, so that the wait is not taken for a hang.
    sys.stdout.flush()  # the table, before the report's own "report: ..." line
    print(f"writing the report of {inv.study_name} ...", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, str(script), "--study", inv.study_name],
                          env={**os.environ, "MLFLOW_TRACKING_URI": inv.tracking_uri})
    if done.returncode:
        print(f"warning: the report failed; the study's runs are complete. Retry with: {command('report')} "
              f"--study {inv.study_name} --tracking-uri {redact(inv.tracking_uri)}", file=sys.stderr)
    return done.returncode


def _opened(inv):
    """The study's storage and tracker, its Optuna studies made and checked; the runs that ended invocations left
    open closed (their points run again), and what a killed invocation of this study left running stopped:
    (storage, tracker, runs closed)."""
    import optuna

    from ..stores.optuna_store import check_protocol, create_studies, open_storage

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # trial failures are reported in one line each
    storage = open_storage(inv.storage)
    tracker = Tracker(inv.tracking_uri, inv.study_name)
    if inv.checkpoint_dir:  # one line now rather than one per trial; before the study is created
        make_writable_folder(Path(inv.checkpoint_dir))
    try:
        create_studies(inv, storage)
        check_protocol(inv, storage)
    except BatchsweepError:
        raise
    except Exception as exc:
        raise BatchsweepError(f"cannot use the Optuna storage {redact(inv.storage)} ({first_line(exc, inv.storage)}):"
                              f" check it, or pass another --storage") from None
    closed = end_dead(inv, storage, tracker)  # before counting: their points run again in this invocation
    if line := left_behind(killed_of(inv.storage + inv.study_name), "an invocation of this study that was killed had"
                                                                    " left"):
        print(line, file=sys.stderr)
    return storage, tracker, closed


def run_invocation(inv, workers: int, gpus: list | tuple = ()) -> int:
    """Run what is left of the study (at most --n-trials of it) in `workers` processes, placed round-robin on
    `gpus` where there are any (sweeps/gpus/placement.py); 0, or 1 when every trial failed or was invalid, or 130 on
    Ctrl-C."""
    from ..gpus.placement import place
    from ..stores.optuna_store import remaining

    storage, tracker, closed = _opened(inv)
    left = remaining(inv, storage)
    total = left if inv.n_trials is None else min(left, inv.n_trials)
    placements = place(workers, list(gpus), inv.tracking_uri, bool(inv.study.program)) if gpus else []
    on = f" on {len(gpus)} GPU{'s' * (len(gpus) > 1)}" if gpus else ""
    print(f"study {inv.study_name}: {left} trials left, running {total} "
          f"({workers} worker{'s' * (workers > 1)}{on}); MLflow {redact(inv.tracking_uri)}"
          + (f"; closed {closed} interrupted runs" if closed else ""), file=sys.stderr)
    if inv.dropped:
        print(f"not run: {len(inv.dropped)} points that break a constraint, e.g. {describe(inv.dropped[0][0])} "
              f"({inv.dropped[0][1]}); --dry-run lists them", file=sys.stderr)
    parent = start_parent(inv, tracker, workers)
    status, left = "FINISHED", None
    try:
        if workers == 1:
            run_in_process(inv, parent, total, placements[0] if placements else None)
        else:
            run_workers(inv, parent, workers, total, placements)
            try:
                end_dead(inv, storage, tracker)  # a killed worker's trial would stay RUNNING, not counted as left
            except Exception:  # the storage went away: the next invocation ends them before it counts
                pass
    except KeyboardInterrupt:
        status = "KILLED"
        print(f"\n{interrupt.received()}: finished trials are kept; run the same command again to resume "
              f"study {inv.study_name}", file=sys.stderr)
        interrupt.handled()
        return 130
    except BaseException:
        status = "FAILED"
        raise
    finally:
        try:
            left = remaining(inv, storage)
        except Exception:  # the storage went away: the parent run still ends
            pass
        tracker.finish(parent, status, tags={"trials_left": left})
    return finish(inv, tracker, parent, storage, left)


def start_parent(inv, tracker: Tracker, workers: int) -> str:
    """The invocation's parent run, with the study's configuration and the UI's descriptions."""
    from .objective import make_objective

    config = make_objective(inv.study).params(inv.base, inv.own({}))
    params = {**config, "seeds": len(inv.seeds), "n_trials": inv.n_trials, "workers": workers}
    try:
        parent = tracker.start_parent(f"{inv.study_name} {time.strftime('%Y-%m-%d %H:%M:%S')}", params,
                                      {"study": inv.study.name, "storage": redact(inv.storage), "host": HOST,
                                       "summary": inv.study.summary, "study_file": inv.study.source,
                                       # What the report's importance, parallel coordinates and fronts read.
                                       "batchsweep.varied": ",".join(inv.study.varied),
                                       "batchsweep.objective": ",".join(f"{m}:{d}" for m, d in zip(
                                           inv.study.metrics, inv.study.directions)),
                                       **standard_tags(git_commit())})
        # The UI's descriptions; the report replaces the parent run's with its findings.
        tracker.describe(None, f"{inv.study.summary}\n\nStudy file: {inv.study.source}. One parent run per "
                               f"invocation of `sweeps/run.py --study`, one nested run per trial.")
        tracker.describe(parent, f"Study {inv.study_name}: {inv.study.summary}. The report is written when the "
                                 f"study finishes: reports/{inv.study_name}/report.html, and in this run's artifacts "
                                 f"under report/.")
    except Exception as exc:  # the store failed after Tracker() reached it: one line, no half-started parent
        tracker.end_open_runs("FAILED")
        reason = first_line(exc, inv.tracking_uri)
        raise TrackingError(f"cannot write the MLflow store {redact(inv.tracking_uri)} ({reason}): check it, then "
                            f"run the same command again") from None
    return parent


def finish(inv, tracker: Tracker, parent: str, storage, left: int | None) -> int:
    """After the workers: the models kept, the checkpoints cleaned up, the table of trials, the files trials
    clashed on."""
    import optuna

    from .checkpoints import Cleanup

    try:
        Cleanup(inv, storage, tracker).keep_models(parent, lambda line: print(line, file=sys.stderr))
    except Exception as exc:  # the trials are recorded; the models and the clean-up are a convenience
        print(f"warning: the models were not logged ({first_line(exc, inv.storage)}); the trials are kept",
              file=sys.stderr)
    print(results_table(inv, storage))
    print(f"MLflow runs: {runs_address(inv.tracking_uri, tracker.experiment_id)}")
    clashed = [t for name in inv.study_names() for t in optuna.load_study(study_name=name, storage=storage).get_trials(
        deepcopy=False) if "clash" in t.user_attrs and t.user_attrs.get("invocation") == parent]
    if clashed:
        print(f"warning: {len(clashed)} trial{'s' * (len(clashed) > 1)} wrote a file that another trial wrote while "
              f"both ran (trial {clashed[0].number}: {clashed[0].user_attrs['clash']}): their results may be each "
              f"other's, so they are marked clash, left out of the report, and run again in the next invocation; "
              f"{FIX}", file=sys.stderr)
    if left:
        print(f"{left} trials left: run the same command again to continue", file=sys.stderr)
    return 1 if all_failed(inv, storage) else 0


def end_dead(inv, storage, tracker: Tracker) -> int:
    """End the MLflow runs and fail the Optuna trials of processes that are gone (killed, crashed): a run whose
    trial was recorded complete ends FINISHED, the others KILLED. Returns how many runs it ended."""
    import optuna

    from ..stores.optuna_store import free_dead_trials

    complete = {t.user_attrs["mlflow_run_id"] for name in inv.study_names()
                for t in optuna.load_study(study_name=name, storage=storage).get_trials(
                    deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)) if "mlflow_run_id" in t.user_attrs}
    closed = tracker.close_orphans(complete)
    free_dead_trials(inv, storage)
    return closed


def all_failed(inv, storage) -> bool:
    """Whether the study has trials and every one that ended failed with an error or was invalid: it measured
    nothing, and the command fails too."""
    import optuna

    ended = [t for name in inv.study_names()
             for t in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
             if t.state.is_finished() and outcome_of(t) != OUTCOMES["duplicate"]]
    invalid = sum(outcome_of(t) == OUTCOMES["invalid"] for t in ended)
    failed = sum(t.state == optuna.trial.TrialState.FAIL for t in ended)
    if not ended or failed + invalid < len(ended):
        return False
    one = len(ended) == 1
    which, runs = ("the one trial", "its MLflow run") if one else (f"all {len(ended)} trials", "their MLflow runs")
    if not invalid:
        how = "failed with an error"
    elif not failed:
        how = f"{'was' if one else 'were'} invalid"
    else:
        how = "failed with an error or were invalid"
    # The last recorded error in the line itself: a study resumed with no trial left to run printed none above.
    said = max((t for t in ended if "error" in t.user_attrs), key=lambda t: t.number, default=None)
    if said is None:
        where = f": see the lines above, or the 'error' tag of {runs}"
    else:
        last = f"trial {said.number}" if one else f"the last, trial {said.number}"
        error = (str(said.user_attrs["error"]).strip().splitlines() or [""])[0]
        where = f"; {last}: {error} (see the 'error' tag of {runs})"
    print(f"error: {which} of study {inv.study_name} {how}{where}", file=sys.stderr)
    return True
