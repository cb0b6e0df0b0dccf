"""`batchsweep audit`: a user's training script run at (b, k) and at (b*k, 1) from the same start, and the
mistake that separates them, named from measurements: the relative difference of the weights, the ratio and
angle of single updates, where in an epoch the runs part, the step counts and the state dict's keys.

    batchsweep audit --study study.toml --physical-batch 8 --accum-steps 4 [--steps N] [--json PATH]

The study file's [program] is the script, unmodified: its command passes {physical_batch} and {accum_steps} (and
{seed} where it takes one). The tracer (sweeps/launch/tracer) runs inside its processes: it counts each window's calls,
stops a run after N optimizer steps, and saves the weights and the window's gradient before any clipping; the
script's own rows and saved weights are not read. Runs are of one epoch where the command takes {epochs} (and
where their LR decayed by its end, of the study's {epochs} too: `stretch`), else as long as the script trains.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from batchsweep.trainers import FIELDS, BatchsweepError, ConfigError, TrainConfig, check_output, interrupt

from ..commands import Parser
from ..stores.urls import check_tracking_uri
from .diagnose import audit
from .ranks import per_rank
from .runs import Auditor
from .verdicts import sentence, taken_out

# Torch and MLflow (seconds) are imported where they are used, so that --help and bad flags answer at once.


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser("audit", description="Run your training script (the [program] of a study file) at (b, k) and at "
               "(b*k, 1) from the same start, and name every accumulation mistake that separates them. Exit status: "
               "1 where a mistake is named (beside anything else), otherwise 0 exact or batchnorm, 2 bad input, a "
               "script that differs from itself, windows that hold other samples, a forward or a step that draws "
               "random numbers, a forward that updates its own buffers, a zero_grad signature the trace "
               "contradicts, a difference within rounding, a step that a GradScaler skipped in the true batch "
               "alone, or "
               "a micro-batch that holds the whole epoch; on ranks (--nproc), also ranks that train apart or "
               "whose windows hold other samples, another LR or other random numbers than one rank's.",
               epilog="The script's command passes {physical_batch} and {accum_steps} on (and {seed}); batchsweep "
               "observes the script from inside its processes, with no edit to it (docs/audit.md).")
    p.add_argument("--study", required=True, help="a study file with a [program]")
    p.add_argument("--physical-batch", type=int, required=True, help="b: the micro-batch")
    p.add_argument("--accum-steps", type=int, required=True, help="k: micro-batches per step (at least 2)")
    p.add_argument("--steps", type=int, default=0, help="compare the first N optimizer steps (default: one epoch)")
    p.add_argument("--nproc", type=int, default=1, help="ranks: run (b, k) and (b*k, 1) on N ranks, and (b*k*N, 1) on "
                   "one, through a command that passes {world_size} to its launcher (torchrun --nproc-per-node "
                   "{world_size} ...)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: SQLite in mlruns/mlflow.db)")
    p.add_argument("--json", metavar="PATH", help="also write the verdict and its figures as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ..stores.mlflow_store import quiet_library_logs

    quiet_library_logs()
    try:
        with interrupt.trapped():  # SIGTERM and SIGINT stop an audit as Ctrl-C does
            return _main(args)
    except BatchsweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{interrupt.received()}: the audit's runs end KILLED; run the same command again to audit from the "
              f"start", file=sys.stderr)
        interrupt.handled()
        return 130


def _auditor(args: argparse.Namespace, folder: Path) -> Auditor:
    """The study's script at the audit's point: [fixed], the first value of every other [grid] axis, LR rule none."""
    from ..study.files import load
    from ..stores.mlflow_store import Tracker, default_tracking_uri

    study = load(args.study)
    if study.program is None:
        raise ConfigError(f"{args.study}: the audit runs a script: add a [program] (docs/programs.md)")
    missing = [p for p in ("physical_batch", "accum_steps") if p not in study.program.placeholders()]
    if missing:
        raise ConfigError(f"{args.study}: program.command: pass {{{missing[0]}}} on to the script: the audit runs it "
                          f"at (b, k) and at (b*k, 1)")
    if args.physical_batch < 1 or args.accum_steps < 2 or args.steps < 0 or args.nproc < 1:
        raise ConfigError("--physical-batch must be at least 1, --accum-steps at least 2, --steps at least 0 and "
                          "--nproc at least 1")
    if args.nproc > 1 and "world_size" not in study.program.placeholders():
        raise ConfigError(f"{args.study}: program.command: pass {{world_size}} to the launcher (torchrun "
                          f"--nproc-per-node {{world_size}} ...): --nproc {args.nproc} runs the script on that many "
                          f"ranks and on one")
    check_output("--json", args.json)  # before any run: a verdict that cannot be written would be lost
    point = {**study.fixed, **{f: v[0] for key, v in study.grid.items() for f, v in [(key, v)] if "+" not in key}}
    fields = {k: v for k, v in point.items() if k in FIELDS and k not in ("physical_batch", "accum_steps")}
    config = TrainConfig(**{**fields, "lr_rule": "none"})
    own = {k: v for k, v in point.items() if k not in FIELDS}
    tracker = Tracker(check_tracking_uri(args.tracking_uri or default_tracking_uri()), f"{study.name}-audit")
    tracker.close_orphans()  # the runs an earlier audit of this study left RUNNING when it was killed
    parent = tracker.start_parent(f"audit b{args.physical_batch} k{args.accum_steps}",
                                  {"physical_batch": args.physical_batch, "accum_steps": args.accum_steps,
                                   "steps": args.steps, **({"nproc": args.nproc} if args.nproc > 1 else {}), **own},
                                  {"study_file": study.source})
    # A command without {epochs} trains as long as the script does (or --steps): there is no epoch to stretch.
    epochs = config.epochs if "epochs" in study.program.placeholders() else 1
    return Auditor(study, dataclasses.replace(config, epochs=1), own, tracker, parent, folder, epochs, args.nproc)


def _main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..trials.tables import format_table
    from ..stores.mlflow_store import first_line

    b, k = args.physical_batch, args.accum_steps
    with tempfile.TemporaryDirectory(prefix="batchsweep-audit-") as folder:
        auditor = _auditor(args, Path(folder))  # (a mistake in the study is one line, with no bar before it)
        with tqdm(total=0, unit="step", file=sys.stderr, dynamic_ncols=True, leave=False) as auditor.bar:
            try:
                finding = audit(auditor, b, k, args.steps)
            except KeyboardInterrupt:  # a stop signal: the script's group is stopped by now (program.run)
                from ..stores.outcomes import INTERRUPTED  # (Optuna's import, which --help does without)

                auditor.tracker.end_open_runs(INTERRUPTED.status, reason=INTERRUPTED.name)
                raise
            except BaseException as exc:
                auditor.tracker.finish(auditor.parent, "FAILED", tags={"error": first_line(exc, auditor.tracker.uri)})
                auditor.tracker.end_open_runs("FAILED")
                raise
    f = finding.figures
    sentences = [sentence(v, f) for v in finding.verdicts]
    ranked = args.nproc > 1  # (a column of the ranks where they vary)
    print(format_table(["run", "b", "k", *["ranks"] * ranked, "epochs", "max steps", "steps run"],
                       [[r.name, str(r.b), str(r.k), *[str(r.nproc)] * ranked, str(r.epochs),
                         str(r.max_steps) if r.max_steps else "epoch", str(len(r.losses))] for r in auditor.runs]))
    differing = per_rank(auditor.runs[0]) if ranked else []
    if differing:  # (the accumulated run's ranks, where they did not all do the same)
        print()
        print(format_table(["rank", "steps", "micro-batches (window 1)", "samples", "tokens"], differing))
    print()
    for what, diff in finding.compared:
        print(f"relative weight difference {what}: {diff:.3g} (equal within {f['tolerance']:g}, {f['dtype']})")
    if "first_differing_update" in f:
        print(f"first update where they part: {f['first_differing_update']} of {f['steps_true_batch']}" + (
            f"; the accumulated update is {f['update_ratio']:.4g} x the true batch's along it, at cosine "
            f"{f['update_cosine']:.4f}, and differs from it by {f['update_difference']:.3g} of its length"
            f"{taken_out(f)}" if "update_ratio" in f else ""))
    if "gradient_ratio" in f:
        print(f"the windows' gradients there, before any clipping: the accumulated one is {f['gradient_ratio']:.4g} x "
              f"the true batch's along it, at cosine {f['gradient_cosine']:.4f}")
    for verdict, said in zip(finding.verdicts, sentences):
        print(f"verdict: {verdict}")
        print(said[0].upper() + said[1:])
    for note in finding.notes:
        print(f"note: {note[0].upper() + note[1:]}.")
    auditor.tracker.describe(auditor.parent,
                             " ".join(f"verdict: {v}. {s}" for v, s in zip(finding.verdicts, sentences)))
    auditor.tracker.finish(auditor.parent, "FINISHED", metrics={k: v for k, v in f.items()
                                                                 if isinstance(v, (int, float))},
                           tags={"verdict": finding.verdict, "verdicts": ",".join(finding.verdicts)})
    if args.json:
        Path(args.json).write_text(json.dumps({"verdict": finding.verdict, "verdicts": finding.verdicts,
                                               "sentence": sentences[0], "sentences": sentences,
                                               "notes": finding.notes, **f,
                                               "runs": len(auditor.runs), "compared": dict(finding.compared)},
                                              indent=2) + "\n")
    return finding.status
