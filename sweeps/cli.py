"""Command line of `python sweeps/run.py` (and `batchsweep run`): parse, validate, print; sweeps/trials/driver.py runs."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from batchsweep.trainers import (FIELDS, BatchsweepError, ConfigError, TrainConfig, format_bytes, interrupt,
                                 parse_overrides, parse_value)

from .commands import Parser, command
from .study.spec import LAUNCHERS, check_name, check_size
from .stores.urls import check_storage, check_tracking_uri, redact, sqlite_path, unreachable

# Torch, MLflow and Optuna (seconds) are imported once the command line is parsed: --help and bad flags answer
# at once.

# Flags that set one trainer field for every trial of the study.
CONFIG_FLAGS = ("epochs", "model", "dataset", "device", "seed", "metrics")
# Upper bounds of the counts, each with its reason.
LIMITS = {
    "--seeds": (1000, "error bars need 3 to 10 seeds; more than 1,000 is a typo"),
    "--workers": (4 * (os.cpu_count() or 1), "more than 4 worker processes per CPU core only thrash"),
    "--workers-per-gpu": (64, "trials that small train faster one after another"),
    "--n-trials": (1_000_000, "a budget beyond a million trials is a typo"),
}
LOG_MODELS = ("none", "best", "all")
SET_HELP = "override any trainer field, e.g. --set weight_decay=5e-4 (repeatable)"
TRACKING_HELP = "MLflow tracking URI (default: SQLite in mlruns/mlflow.db)"
RUNS_CODE = ("An import path runs code: --study package.module:STUDY, --model and --dataset package.module:factory, "
             "--set loss=package.module:fn, and the same paths inside a study file import that module, which runs "
             "with your permissions. Name only code you trust (docs/security.md).")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser("run", description="Run an Optuna study of gradient accumulation, every trial tracked in MLflow. "
               "Running the same command again resumes it.", epilog=RUNS_CODE)
    p.add_argument("--study", default="accum_lr", help="a built-in study (see --list), a study file "
                   "(path/to/study.toml) or package.module:STUDY; default accum_lr")
    p.add_argument("--list", action="store_true", help="list the studies and exit")
    p.add_argument("--n-trials", type=int, help="run at most this many trials now (default: all that are left)")
    for name in CONFIG_FLAGS:
        p.add_argument("--" + name, help=f"set {name} for every trial")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    p.add_argument("--seeds", type=int, help="repeat every point over this many seeds (from --seed); default: the "
                   "study's own (3 for accum_lr and bn_momentum)")
    p.add_argument("--storage", help="Optuna storage URL (default: SQLite in mlruns/optuna.db)")
    p.add_argument("--tracking-uri", help=TRACKING_HELP)
    p.add_argument("--study-name", help="Optuna study and MLflow experiment name (default: the study's id)")
    p.add_argument("--workers", type=int, help="worker processes on the same storage; default: the study's own "
                   "(2 for accum_lr and bn_momentum), at least one per visible GPU, at most the CPU cores. On GPUs "
                   "they are placed round-robin, and each trial waits until its GPU has room for its predicted "
                   "memory (docs/gpus.md)")
    p.add_argument("--workers-per-gpu", type=int, metavar="M", help="M workers on each visible GPU, instead of "
                   "--workers")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first trial that raises an error")
    p.add_argument("--system-metrics", action="store_true", help="log MLflow's system metrics (CPU, memory, disk, "
                   "network, and on a GPU the trial's own GPU) for every trial, sampled every second")
    p.add_argument("--checkpoint-dir", help="a checkpoint folder per trial configuration, written every epoch: a "
                   "killed trial resumes from it when its point runs again (default: mlruns/checkpoints; a folder "
                   "all machines share when several run the study; 'none' turns checkpoints off)")
    p.add_argument("--log-models", choices=LOG_MODELS, default="best", help="the trained models kept in MLflow "
                   "at the end: of the invocation's trial with the best objective, one seed's run (the Pareto front "
                   "for several objectives), of all its trials, or none (default: best)")
    p.add_argument("--launcher", choices=LAUNCHERS, help="where each trial trains: in the worker process, or as a "
                   "`torchrun --nproc-per-node N` job with N = its world_size (data-parallel; see README); default: "
                   "the study's own (process)")
    p.add_argument("--no-fuse", action="store_true", help="train each trial alone (default: a grid's trials that "
                   "share the model, data, b, seed and epochs train as one fused group on a worker without a GPU, "
                   "each still its own trial; docs/trainer.md)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the trials it would run (of a study the storage holds, with each one's status) and "
                        "exit; writes nothing")
    p.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    p.add_argument("--plan", action="store_true", help="plan b and k for --target-batch within --memory-budget "
                   "(the flags of batchsweep plan)")
    plan_flags(p)
    return p.parse_args(argv)


def plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target-batch", type=int, help="the effective batch to reach")
    p.add_argument("--memory-budget", help="the memory one training process may hold, e.g. 6GiB, 512MiB")


def plan(argv: list[str] | None = None) -> int:
    """`batchsweep plan`: run's --plan, with only the flags it reads."""
    p = Parser("plan", description="Plan b and k: the largest physical batch b whose predicted peak memory fits "
               "--memory-budget, and the accumulation steps k that reach --target-batch. The fit of memory against "
               "b comes from a batch_memory study in the MLflow store, or else from a quick probe.")
    plan_flags(p)
    for name in ("model", "dataset", "device"):
        p.add_argument("--" + name, help=f"the {name} to plan for (default: {FIELDS[name].default})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    p.add_argument("--tracking-uri", help=TRACKING_HELP)
    args = p.parse_args(argv)
    try:
        quiet_stores()
        return memory_plan(args, "batchsweep plan")
    except BatchsweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def workers_and_gpus(args: argparse.Namespace, study) -> tuple[int, list]:
    """How many worker processes, and the GPUs they are placed on (none under torchrun, which places its own)."""
    from .gpus.placement import visible_gpus

    gpus = visible_gpus() if (args.launcher or study.launcher) == "process" else []
    if args.workers_per_gpu is not None:
        if args.workers is not None or not gpus:
            raise ConfigError("--workers-per-gpu places workers on GPUs: give it without --workers, on a machine "
                              "where torch sees a GPU" + ("" if gpus else " (none is visible here: use --workers)"))
        return args.workers_per_gpu * len(gpus), gpus
    if args.workers is not None:
        return args.workers, gpus
    return min(max(study.workers, len(gpus)), os.cpu_count() or 1), gpus


def build_invocation(args: argparse.Namespace):
    from .study.files import load

    study = load(args.study)  # before torch and MLflow are imported: a study file's mistake answers at once
    from .trials.invocation import Invocation
    from .trials.objective import make_objective
    from .stores.optuna_store import default_storage
    from .stores.mlflow_store import default_tracking_uri

    make_objective(study)  # its metrics are checked before anything runs
    if args.seeds is None:
        args.seeds = study.seeds
    args.workers, args.gpus = workers_and_gpus(args, study)
    for flag, value in (("--seeds", args.seeds), ("--workers-per-gpu", args.workers_per_gpu),
                        ("--workers", args.workers), ("--n-trials", args.n_trials)):
        high, why = LIMITS[flag]
        if value is not None and not 1 <= value <= high:
            raise ConfigError(f"{flag} must be between 1 and {high:,} ({why}), got {value}")
    check_size(study, args.seeds, "--seeds")  # from the axes' lengths: before any point is enumerated
    flags = {name: parse_value(name, getattr(args, name)) for name in CONFIG_FLAGS if getattr(args, name)}
    fixed = {k: v for k, v in study.fixed.items() if k in FIELDS}  # not a [program] study's own fields
    base = TrainConfig(**{**fixed, **flags, **parse_overrides(args.set)})
    inv = Invocation(study=study, base=base, seeds=tuple(range(base.seed, base.seed + args.seeds)),
                     study_name=check_name(study.name if args.study_name is None else args.study_name),
                     storage=check_storage(args.storage or default_storage()),
                     tracking_uri=check_tracking_uri(args.tracking_uri or default_tracking_uri()),
                     n_trials=args.n_trials, fail_fast=args.fail_fast, system_metrics=args.system_metrics,
                     # A [program] keeps its own checkpoints: its killed trial's point runs again from the start.
                     checkpoint_dir=None if args.checkpoint_dir == "none" or study.program else str(
                         Path(args.checkpoint_dir or "mlruns/checkpoints").resolve()),
                     log_models=args.log_models, launcher=args.launcher or study.launcher, fuse=not args.no_fuse,
                     workers=args.workers)
    if inv.launcher == "torchrun" and study.program:
        raise ConfigError("a [program] runs your command as it is: put torchrun into its command instead of "
                          "--launcher torchrun")
    if inv.launcher == "torchrun" and study.kind == "equivalence":
        raise ConfigError("an equivalence study compares two models in one process: run it without --launcher "
                          "torchrun")
    # Every trial's configuration is valid before anything is written: each grid point, and each at the ends
    # of every searched range.
    ends = [(name, v) for name, p in study.tune.items() for v in (p.choices or (p.low, p.high))]
    for unit in inv.units():
        for config in [inv.config(unit.point, unit.seed),
                       *(inv.config({**unit.point, name: value}, unit.seed) for name, value in ends)]:
            if config.world_size > 1 and inv.launcher != "torchrun":
                raise ConfigError(f"world_size {config.world_size} trains data-parallel under torchrun: add "
                                  f"--launcher torchrun (or launcher = \"torchrun\" in the study file)")
    if not inv.units():
        raise ConfigError(f"every point of study {study.name} breaks a constraint ({inv.dropped[0][1]}): nothing "
                          f"to run; loosen [search] constraints")
    return inv


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from .trials.tables import dry_run_table, list_studies

    try:
        if args.list:  # the study files only: no torch or MLflow
            print(list_studies())
            return 0
        if args.plan:
            quiet_stores()
            return memory_plan(args, "--plan")
        inv = build_invocation(args)
        if args.dry_run:
            from .stores.optuna_store import peek

            print(dry_run_table(inv, peek(inv)))
            return 0
        preflight_study(inv)
        quiet_stores()
        from .trials.driver import run_invocation, write_report

        with interrupt.trapped():  # SIGTERM and SIGINT stop a study as Ctrl-C does, however it was started
            code = run_invocation(inv, args.workers, args.gpus)
    except BatchsweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if code or args.no_report:
        return code
    return write_report(inv)


def preflight_study(inv) -> None:
    """Before the study is written to, once for each model and data of its trials: what would make every one of
    them invalid alike (an import path that does not import, a built-in model given data it cannot take). A
    [program] trains in the user's script, which the trainer does not check."""
    from batchsweep.trainers import preflight

    if inv.study.program:
        return
    checked = set()
    for unit in inv.units():
        config = inv.config(unit.point, unit.seed)
        key = (config.device, config.model, config.dataset, config.data_dir, config.label_key, config.loss,
               config.metrics)
        if key not in checked:
            checked.add(key)
            preflight(config)


def quiet_stores() -> None:
    """Before a store opens: its libraries' INFO lines stay out of the bars, and MLflow's "View run … at
    http://…" line for every run a tracking server ends out of the results table."""
    from .stores.mlflow_store import quiet_library_logs

    quiet_library_logs()
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


def memory_plan(args: argparse.Namespace, asked: str) -> int:
    """Answer --plan (`asked`, as typed): the largest physical batch within the budget and the steps to the target
    batch."""
    from batchsweep.trainers import load, preflight

    from .gpus.planner import check_target, parse_bytes, plan
    from .stores.mlflow_store import default_tracking_uri

    if args.target_batch is None or args.memory_budget is None:
        raise ConfigError(f"{asked} needs --target-batch N and --memory-budget SIZE (e.g. 6GiB)")
    budget = parse_bytes(args.memory_budget)
    flags = {name: parse_value(name, getattr(args, name)) for name in CONFIG_FLAGS if getattr(args, name, None)}
    config = TrainConfig(**{**flags, **parse_overrides(args.set)})
    check_target(args.target_batch)
    data = preflight(config) or load(config)  # the model and data that the probe would train, as for a study
    if args.target_batch > (n := data.n_train):
        raise ConfigError(f"--target-batch {args.target_batch} is larger than the training set of {config.dataset} "
                          f"({n} samples): a step holds each sample once at most; give at most {n}")
    fitted = memory_fit(config, check_tracking_uri(args.tracking_uri or default_tracking_uri()), data)
    answer = plan(fitted, args.target_batch, budget)
    print(f"{config.model} on {config.dataset}: peak memory ({fitted.memory_source}) = "
          f"{format_bytes(fitted.fixed)} + {format_bytes(fitted.per_sample)} x b, from the {fitted.source}")
    print(f"plan: physical batch {answer.physical_batch} x {answer.accum_steps} accumulation steps = "
          f"{answer.effective_batch} (peak about {format_bytes(fitted.peak(answer.physical_batch))} of "
          f"{format_bytes(budget)})")
    if fitted.ceiling:
        print(f"note: kept below b = {fitted.ceiling}, the smallest that ran out of memory in a run of the store")
    if answer.note:
        print(f"note: {answer.note}")
    print(f"run it: {command('train')} --model {config.model} --dataset {config.dataset} "
          f"--physical-batch {answer.physical_batch} --accum-steps {answer.accum_steps}")
    return 0


def memory_fit(config: TrainConfig, uri: str, data):
    """The fit of peak memory against b: from a batch_memory study in the store, or else from a probe of `data`
    (`batchsweep.trainers.load(config)`'s)."""
    from batchsweep.trainers import memory_source, resolve_device

    from .gpus.planner import from_study, measure
    from .stores.mlflow_store import TrackingError, first_line

    source = memory_source(resolve_device(config.device))
    no_local_store = sqlite_path(uri) is not None and not sqlite_path(uri).exists()
    if not no_local_store and (why := unreachable(uri)):
        raise TrackingError(why)
    try:
        fitted = None if no_local_store else from_study(config, uri, source)
    except Exception as exc:  # a store that answers but cannot be read: one line, as for any store
        raise TrackingError(f"cannot read the MLflow store {redact(uri)} ({first_line(exc, uri)}): move a damaged "
                            f"store aside, or pass another --tracking-uri") from None
    try:
        return fitted or measure(config, data)
    except BatchsweepError:
        raise
    except Exception as exc:  # the user's model on the user's data: one line, as a trial would record it
        said = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError(f"the memory probe of {config.model} on {config.dataset} raised {type(exc).__name__}: {said}",
                          f"check that `{command('train')} --model {config.model} --dataset {config.dataset}` "
                          f"trains") from None


