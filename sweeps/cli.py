"""Command line of `python sweeps/run.py`."""
from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import queue
import subprocess
import sys
import time
from pathlib import Path

from trainers.cli import format_bytes
from trainers.config import BatchsweepError, ConfigError, TrainConfig, parse_overrides, parse_value

from .studies import STUDIES, check_name, describe, get_study
from .tracking import HOST, Tracker, default_tracking_uri
from .urls import check_storage, check_tracking_uri, redact, sqlite_path

# Flags that set one trainer field for every trial of the study.
CONFIG_FLAGS = ("epochs", "model", "dataset", "device", "seed")
# Upper bounds of the counts, each with its reason.
LIMITS = {
    "--seeds": (1000, "error bars need 3 to 10 seeds; more than 1,000 is a typo"),
    "--workers": (4 * (os.cpu_count() or 1), "more than 4 worker processes per CPU core only thrash"),
    "--n-trials": (1_000_000, "a budget beyond a million trials is a typo"),
}
MAX_UNITS = 100_000  # points x seeds: a study this size takes days; beyond it, a typo


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sweeps/run.py", description="Run an Optuna study of gradient accumulation, "
                                "every trial tracked in MLflow. Running the same command again resumes it.")
    p.add_argument("--study", default="accum_lr", help="which study (see --list); default accum_lr")
    p.add_argument("--list", action="store_true", help="list the studies and exit")
    p.add_argument("--n-trials", type=int, help="run at most this many trials now (default: all that are left)")
    for name in CONFIG_FLAGS:
        p.add_argument("--" + name, help=f"set {name} for every trial")
    p.add_argument("--seeds", type=int, help="repeat every point over this many seeds (from --seed); default: the "
                   "study's own (3 for accum_lr and bn_momentum)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any trainer field, e.g. --set weight_decay=5e-4 (repeatable)")
    p.add_argument("--storage", help="Optuna storage URL (default: SQLite in mlruns/optuna.db)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: SQLite in mlruns/mlflow.db)")
    p.add_argument("--study-name", help="Optuna study and MLflow experiment name (default: the study's id)")
    p.add_argument("--workers", type=int, help="worker processes on the same storage; default: the study's own "
                   "(2 for accum_lr and bn_momentum), at most the CPU cores")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first trial that raises an error")
    p.add_argument("--dry-run", action="store_true", help="print the trials it would run and exit")
    p.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    p.add_argument("--plan", action="store_true", help="plan b and k for --target-batch within --memory-budget")
    p.add_argument("--target-batch", type=int, help="with --plan: the effective batch to reach")
    p.add_argument("--memory-budget", help="with --plan: e.g. 6GiB, 512MiB")
    return p.parse_args(argv)


def build_plan(args: argparse.Namespace):
    from .runner import Plan, default_storage

    study = get_study(args.study)
    if args.seeds is None:
        args.seeds = study.seeds
    if args.workers is None:
        args.workers = min(study.workers, os.cpu_count() or 1)
    for flag, value in (("--seeds", args.seeds), ("--workers", args.workers), ("--n-trials", args.n_trials)):
        high, why = LIMITS[flag]
        if value is not None and not 1 <= value <= high:
            raise ConfigError(f"{flag} must be between 1 and {high:,} ({why}), got {value}")
    if len(study.points) * args.seeds > MAX_UNITS:
        raise ConfigError(f"{len(study.points)} points x {args.seeds} seeds is more than {MAX_UNITS:,} trials: "
                          f"lower --seeds")
    flags = {name: parse_value(name, getattr(args, name)) for name in CONFIG_FLAGS if getattr(args, name)}
    base = TrainConfig(**{**study.fixed, **flags, **parse_overrides(args.set)})
    plan = Plan(study=study, base=base, seeds=tuple(range(base.seed, base.seed + args.seeds)),
                study_name=check_name(args.study_name or study.name),
                storage=check_storage(args.storage or default_storage()),
                tracking_uri=check_tracking_uri(args.tracking_uri or default_tracking_uri()), n_trials=args.n_trials,
                fail_fast=args.fail_fast)
    for _, point, seed in plan.units():
        plan.config(point, seed)  # validates every trial's configuration before anything is written
    return plan


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    # Numbers are right-aligned, text left-aligned.
    numeric = [bool(rows) and all(r[i][:1] in "0123456789-." for r in rows) for i in range(len(headers))]
    line = lambda cells: "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def list_studies() -> str:
    rows = [[s.name, str(len(s.points) * (s.tune.trials_per_point if s.tune else 1) * s.seeds), str(s.seeds),
             s.summary] for s in STUDIES.values()]
    return format_table(["study", "trials", "seeds", "what it varies"], rows)


def dry_run_table(plan) -> str:
    rows = []
    for name, point, seed in plan.units():
        c = plan.config(point, seed)
        tuned = f"TPE x{plan.study.tune.trials_per_point} over {plan.study.tune.field}" if plan.study.tune else ""
        rows.append([describe(point), str(c.physical_batch), str(c.accum_steps), str(c.effective_batch),
                     c.lr_rule, tuned or f"{c.lr:.4g}", c.bn_momentum_rule, f"{c.bn_momentum:.4g}",
                     str(c.epochs), str(seed)])
    return format_table(["trial", "b", "k", "B", "lr_rule", "lr", "bn_rule", "bn_momentum", "epochs", "seed"], rows)


def results_table(plan, storage) -> str:
    """Every trial of the study, best first."""
    import optuna

    trials = []
    for name in plan.study_names():
        trials += [t for t in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
                   if t.user_attrs.get("reason") != "duplicate" and t.state.is_finished()]
    sign = -1 if plan.direction == "maximize" else 1
    trials.sort(key=lambda t: (t.value is None, sign * (t.value or 0)))
    varied = list(dict.fromkeys(k for t in trials for k in t.user_attrs.get("config", {})))
    objective = "param_rel_diff" if plan.study.kind == "equivalence" else "val_acc"
    headers = ["#", *varied, "B", "lr", "state", "health", objective, "samples/s", "peak memory"]
    rows = []
    for t in trials:
        m = t.user_attrs.get("metrics", {})
        value = m.get(objective)
        config = t.user_attrs.get("config", {})
        derived = plan.config({k: v for k, v in config.items() if k != "seed"}, config.get("seed", 0))
        rows.append([str(t.number), *(_fmt(config.get(k)) for k in varied), str(derived.effective_batch),
                     f"{derived.lr:.4g}",
                     t.user_attrs.get("reason") or t.state.name.lower(), t.user_attrs.get("health", "-"),
                     "-" if value is None else (f"{value:.2e}" if objective == "param_rel_diff" else f"{value:.4f}"),
                     f"{m['samples_per_s']:,.0f}" if "samples_per_s" in m else "-",
                     format_bytes(m["peak_memory_bytes"]) if "peak_memory_bytes" in m else "-"])
    return format_table(headers, rows)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def _worker_process(plan, parent_run_id: str, index: int, budget: int | None, messages) -> None:
    """One of --workers N: one torch thread (several multi-threaded workers thrash a small CPU); its lines go
    to the main process, which prints them above the bar. A fatal error is its last line, and exit status 2."""
    import optuna
    import torch

    from .runner import Hooks, Worker

    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    try:
        Worker(plan, parent_run_id, index, Hooks(say=messages.put)).run(budget)
    except KeyboardInterrupt:
        pass
    except BatchsweepError as exc:
        messages.put(f"error: {exc}")
        sys.exit(2)


def run_workers(plan, parent_run_id: str, workers: int, total: int) -> None:
    """Start the worker processes and draw one bar over the study's trials while they work."""
    from tqdm import tqdm

    from .runner import open_storage, remaining

    storage = open_storage(plan.storage)
    budgets = [None] * workers if plan.n_trials is None else \
        [plan.n_trials // workers + (i < plan.n_trials % workers) for i in range(workers)]
    ctx = multiprocessing.get_context("spawn")
    messages = ctx.Queue()
    procs = [ctx.Process(target=_worker_process, args=(plan, parent_run_id, i, b, messages))
             for i, b in enumerate(budgets)]
    for proc in procs:
        proc.start()
    start_left = remaining(plan, storage)
    fatal = []

    def drain() -> None:
        while True:
            try:
                line = messages.get_nowait()
            except queue.Empty:
                return
            if line.startswith("error: "):
                fatal.append(line.removeprefix("error: "))
            else:
                tqdm.write(line, file=sys.stderr)

    try:
        with tqdm(total=total, unit="trial", file=sys.stderr, dynamic_ncols=True) as bar:
            while any(p.is_alive() for p in procs):
                time.sleep(1.0)
                drain()
                try:
                    bar.n = min(start_left - remaining(plan, storage), total)
                except Exception:  # the storage is away: the workers report it
                    continue
                bar.refresh()
            for proc in procs:
                proc.join()
            drain()
    except KeyboardInterrupt:  # the workers got the signal too: let them mark their trials first
        for proc in procs:
            proc.join(timeout=30)
        raise
    if fatal:
        raise BatchsweepError(fatal[0])


def run_in_process(plan, parent_run_id: str, total: int) -> None:
    from tqdm import tqdm

    from .runner import Hooks, Worker

    trials = tqdm(total=total, unit="trial", file=sys.stderr, dynamic_ncols=True, position=0)
    epochs = tqdm(total=0, unit="epoch", file=sys.stderr, dynamic_ncols=True, position=1, leave=False)

    def trial_start(name: str, n_epochs: int) -> None:
        epochs.reset(total=n_epochs)
        epochs.set_description(name)

    def epoch_done(row: dict) -> None:
        epochs.set_postfix(val_acc=f"{row['val_acc']:.3f}")
        epochs.update(1)

    hooks = Hooks(trial_done=lambda t: trials.update(1), trial_start=trial_start, epoch_done=epoch_done,
                  say=lambda line: tqdm.write(line, file=sys.stderr))
    try:
        return Worker(plan, parent_run_id, 0, hooks).run(plan.n_trials)
    finally:
        epochs.close()
        trials.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # its INFO lines would break the progress bars
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if args.list:
        print(list_studies())
        return 0
    try:
        if args.plan:
            return memory_plan(args)
        plan = build_plan(args)
        if args.dry_run:
            print(dry_run_table(plan))
            return 0
        code = run(plan, args.workers)
    except BatchsweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if code or args.no_report:
        return code
    return write_report(plan)


def memory_plan(args: argparse.Namespace) -> int:
    """Answer --plan: the largest physical batch within the budget and the steps to the target batch."""
    from trainers.loop import resolve_device

    from .planner import from_study, parse_bytes, plan, probe

    if args.target_batch is None or args.memory_budget is None:
        raise ConfigError("--plan needs --target-batch N and --memory-budget SIZE (e.g. 6GiB)")
    budget = parse_bytes(args.memory_budget)
    flags = {name: parse_value(name, getattr(args, name)) for name in CONFIG_FLAGS if getattr(args, name)}
    config = TrainConfig(**{**flags, **parse_overrides(args.set)})
    memory_source = "cuda_allocator" if resolve_device(config.device).type == "cuda" else "saved_tensors"
    uri = check_tracking_uri(args.tracking_uri or default_tracking_uri())
    no_local_store = sqlite_path(uri) is not None and not sqlite_path(uri).exists()
    fitted = (None if no_local_store else from_study(config, uri, memory_source)) or probe(config)
    answer = plan(fitted, args.target_batch, budget)
    print(f"{config.model} on {config.dataset}: peak memory ({fitted.memory_source}) = "
          f"{format_bytes(fitted.fixed)} + {format_bytes(fitted.per_sample)} x b, from the {fitted.source}")
    print(f"plan: physical batch {answer.physical_batch} x {answer.accum_steps} accumulation steps = "
          f"{answer.effective_batch} (peak about {format_bytes(fitted.peak(answer.physical_batch))} of "
          f"{format_bytes(budget)})")
    if answer.note:
        print(f"note: {answer.note}")
    print(f"run it: python trainers/train.py --model {config.model} --dataset {config.dataset} "
          f"--physical-batch {answer.physical_batch} --accum-steps {answer.accum_steps}")
    return 0


def write_report(plan) -> int:
    """Run `analysis/report.py` as its own command: the analysis reads MLflow, never the sweep code. The
    tracking URI goes through the environment (MLFLOW_TRACKING_URI), never on a command line that `ps` shows."""
    script = Path(__file__).resolve().parents[1] / "analysis" / "report.py"
    done = subprocess.run([sys.executable, str(script), "--study", plan.study_name],
                          env={**os.environ, "MLFLOW_TRACKING_URI": plan.tracking_uri})
    if done.returncode:
        print(f"warning: the report failed; the study's runs are complete. Retry with: python analysis/report.py "
              f"--study {plan.study_name} --tracking-uri {redact(plan.tracking_uri)}", file=sys.stderr)
    return done.returncode


def run(plan, workers: int) -> int:
    import optuna

    from .runner import create_studies, open_storage, remaining

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # trial failures are reported in one line each
    storage = open_storage(plan.storage)
    tracker = Tracker(plan.tracking_uri, plan.study_name)
    try:
        create_studies(plan, storage)
    except Exception as exc:
        from .tracking import first_line

        raise BatchsweepError(f"cannot use the Optuna storage {redact(plan.storage)} ({first_line(exc, plan.storage)}):"
                              f" check it, or pass another --storage") from None
    complete = {t.user_attrs["mlflow_run_id"] for name in plan.study_names()
                for t in optuna.load_study(study_name=name, storage=storage).get_trials(
                    deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)) if "mlflow_run_id" in t.user_attrs}
    closed = tracker.close_orphans(complete)
    left = remaining(plan, storage)
    total = left if plan.n_trials is None else min(left, plan.n_trials)
    print(f"study {plan.study_name}: {left} trials left, running {total} "
          f"({workers} worker{'s' * (workers > 1)}); MLflow {redact(plan.tracking_uri)}"
          + (f"; closed {closed} interrupted runs" if closed else ""), file=sys.stderr)
    params = {**plan.base.to_dict(), "seeds": len(plan.seeds), "n_trials": plan.n_trials, "workers": workers}
    parent = tracker.start_parent(f"{plan.study_name} {time.strftime('%Y-%m-%d %H:%M:%S')}", params,
                                  {"study": plan.study.name, "storage": redact(plan.storage), "host": HOST,
                                   "summary": plan.study.summary})
    status = "FINISHED"
    try:
        if workers == 1:
            run_in_process(plan, parent, total)
        else:
            run_workers(plan, parent, workers, total)
    except KeyboardInterrupt:
        status = "KILLED"
        print(f"\ninterrupted: finished trials are kept; run the same command again to resume "
              f"study {plan.study_name}", file=sys.stderr)
        return 130
    except BaseException:
        status = "FAILED"
        raise
    finally:
        try:
            tags = {"trials_left": remaining(plan, storage)}
        except Exception:  # the storage went away: the parent run still ends
            tags = {}
        tracker.finish(parent, status, tags=tags)
    print(results_table(plan, storage))
    left = remaining(plan, storage)
    if left:
        print(f"{left} trials left: run the same command again to continue", file=sys.stderr)
    return 1 if all_failed(plan, storage) else 0


def all_failed(plan, storage) -> bool:
    """Whether the study has trials and every one that ended failed with an error: then the command fails too."""
    import optuna

    ended = [t for name in plan.study_names()
             for t in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
             if t.state.is_finished() and t.user_attrs.get("reason") != "duplicate"]
    if not ended or any(t.state != optuna.trial.TrialState.FAIL for t in ended):
        return False
    print(f"error: all {len(ended)} trials of study {plan.study_name} failed with an error: see the lines above, "
          f"or the 'error' tag of their MLflow runs", file=sys.stderr)
    return True
