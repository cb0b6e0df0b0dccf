"""What the sweep command prints as tables: the studies, a dry run's trials, a study's results."""
from __future__ import annotations

import shlex

from optuna.trial import TrialState

from batchsweep.trainers import format_bytes

from ..stores.outcomes import OUTCOMES, holds, outcome_of
from ..study.spec import config_key, describe, point_key
from ..study.files import BUILTIN, builtin_names, load
from ..launch.program import redacted
from .places import trials_folder
from ..stores.urls import redact, scrub


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    # Numbers are right-aligned, text left-aligned.
    numeric = [bool(rows) and all(r[i][:1] in "0123456789-." for r in rows) for i in range(len(headers))]
    line = lambda cells: "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def list_studies() -> str:
    rows = []
    for name in builtin_names():
        s = load(name)
        rows.append([s.name, str(len(s.points) * s.trials_per_unit * s.seeds), str(s.seeds), s.sampler,
                     s.summary, str((BUILTIN / f"{name}.toml").relative_to(BUILTIN.parents[2]))])
    return format_table(["study", "trials", "seeds", "search", "what it varies", "file"], rows) + \
        "\n\nyour own: --study path/to/study.toml (copy one of these files to start)"


def dry_run_table(inv, held: dict | None = None) -> str:
    """The trials the study would run; with `held` (storage.peek: a study resumed), each one's status there."""
    study, rows = inv.study, []
    searched = ", ".join(study.tune)
    # A searched field changes the derived values: the table cannot show them before the sampler draws.
    searched_lr = bool({"base_lr", "base_batch", "lr_rule", "physical_batch", "accum_steps"} & set(study.tune))
    searched_bn = bool({"bn_momentum_rule", "bn_base_momentum", "accum_steps"} & set(study.tune))
    for unit in inv.units():
        c = inv.config(unit.point, unit.seed)
        rows.append([describe(unit.point) or "-", str(c.physical_batch), str(c.accum_steps), str(c.effective_batch),
                     c.lr_rule, "searched" if searched_lr else f"{c.lr:.4g}", c.bn_momentum_rule,
                     "searched" if searched_bn else f"{c.bn_momentum:.4g}", str(c.epochs),
                     str(unit.seed), f"{study.sampler} x{study.trials} over {searched}" if study.tune else ""])
    headers = ["trial", "b", "k", "B", "lr_rule", "lr", "bn_rule", "bn_momentum", "epochs", "seed", "search"]
    if not study.tune:
        headers, rows = headers[:-1], [r[:-1] for r in rows]
    if held is not None:
        counts, statuses = unit_statuses(inv, held)
        headers, rows = [*headers, "status"], [[*r, status] for r, status in zip(rows, statuses)]
    lines = [format_table(headers, rows)]
    if held is not None:
        done, running, left = counts
        more = f" (--n-trials: {inv.n_trials} of them)" if inv.n_trials is not None and inv.n_trials < left else ""
        lines.append(f"study {inv.study_name} in {redact(inv.storage)}: {done} trial{'s' * (done != 1)} done, "
                     f"{running} running, {left} to run{more}")
    for point, why in inv.dropped:
        lines.append(f"not run: {describe(point)} breaks the constraint {why}")
    if study.program:
        lines += ["", "commands (in " + study.program.cwd + "):"]
        lines += [command_line(inv, unit.point, unit.seed) for unit in inv.units()]
    return "\n".join(lines)


def unit_statuses(inv, held: dict) -> tuple[tuple[int, int, int], list[str]]:
    """(trials done, running, to run) and a status per unit: a grid point's outcome ("complete", "oom", ...),
    "running", "interrupted" (its process is gone: it runs again) or "to run"; a search's "n/T done"."""
    from ..stores.optuna_store import orphaned

    grid = inv.study.sampler == "grid"
    total = 1 if grid else inv.study.trials
    done = running = left = 0
    statuses = []
    for unit in inv.units():
        key = point_key(unit.point, unit.seed)
        trials = [t for t in held.get(unit.study_name, []) if holds(t) and
                  (not grid or config_key(t.user_attrs.get("config", {})) == key)]
        ended = [t for t in trials if t.state != TrialState.RUNNING]
        n = min(len(ended), total)
        r = min(sum(not orphaned(t) for t in trials if t.state == TrialState.RUNNING), total - n)
        done, running, left = done + n, running + r, left + total - n - r
        if not grid:
            statuses.append(f"{n}/{total} done" + (f", {r} running" if r else ""))
        else:
            statuses.append(outcome_of(ended[0]).name if n else "running" if r else
                            "interrupted" if trials else "to run")
    return (done, running, left), statuses


def command_line(inv, point, seed: int) -> str:
    """A [program] trial's command as a shell would take it, passwords redacted; a searched field shows as
    <searched>."""
    values = {**inv.config(point, seed).to_dict(), **inv.own(point), **{k: "<searched>" for k in inv.study.tune},
              "trial_dir": str(trials_folder(inv.tracking_uri, inv.study_name) / "<trial number>")}
    args = [redacted(a) for a in inv.study.program.argv(values)]
    return scrub(shlex.join(args), inv.storage, inv.tracking_uri)


def results_table(inv, storage) -> str:
    """Every finished trial of the study, best first; with several objectives, the Pareto front marked with *. A
    study of several searches (one per point, as lr_search's per B) lists each search's trials together, since a
    trial's number is its search's.

    One objective marks no trial: Optuna's best_trial is one run, one of several that seed noise cannot tell apart,
    and naming those needs the report's paired comparisons (analysis/best.py), which sweeps/ does not import."""
    import optuna

    trials, marked = [], set()
    names, several = inv.study_names(), len(inv.study.metrics) > 1
    for name in names:
        study = optuna.load_study(study_name=name, storage=storage)
        done = [t for t in study.get_trials(deepcopy=False)
                if t.state.is_finished() and outcome_of(t) != OUTCOMES["duplicate"]]
        trials += [(name, t) for t in done]
        if several and any(t.state == optuna.trial.TrialState.COMPLETE for t in done):
            marked |= {(name, t.number) for t in study.best_trials}
    metrics, directions = inv.study.metrics, inv.study.directions
    sign = -1 if directions[0] == "maximize" else 1
    trials.sort(key=lambda nt: (names.index(nt[0]), nt[1].values is None,
                                sign * (nt[1].values[0] if nt[1].values else 0)))
    varied = list(dict.fromkeys(k for _, t in trials for k in t.user_attrs.get("config", {})))
    shrunk = inv.study.auto_batch or any("oom_retries" in t.user_attrs.get("metrics", {}) for _, t in trials)
    headers = ["#", *varied, "B", *(["b used (OOM retries)"] if shrunk else []), "lr", "outcome", "health", *metrics,
               "samples/s", "peak memory", *(["front"] if several else [])]
    rows = []
    for name, t in trials:
        m = t.user_attrs.get("metrics", {})
        config = t.user_attrs.get("config", {})
        derived = inv.config({k: v for k, v in config.items() if k != "seed"}, config.get("seed", 0))
        used = [f"{m['physical_batch_used']:.0f} ({m['oom_retries']:.0f})" if "oom_retries" in m else "-"]
        rows.append([str(t.number), *(_fmt(config.get(k)) for k in varied), str(derived.effective_batch),
                     *(used if shrunk else []),
                     f"{derived.lr:.4g}", outcome_of(t).name,
                     "config mismatch" if "config_mismatch" in t.user_attrs else t.user_attrs.get("health", "-"),
                     *(_metric(metric, m.get(metric)) for metric in metrics),
                     f"{m['samples_per_s']:,.0f}" if "samples_per_s" in m else "-",
                     format_bytes(m["peak_memory_bytes"]) if "peak_memory_bytes" in m else "-",
                     *(["*" if (name, t.number) in marked else ""] if several else [])])
    if several:
        return format_table(headers, rows)
    why = ("with one seed no configuration can be told from another (--seeds 3 or more)" if len(inv.seeds) < 2 else
           "the report marks the best configuration and every one that cannot be told from it (★), paired by seed")
    return format_table(headers, rows) + f"\nNo trial is marked best: one trial is one seed's run; {why}."


def _metric(name: str, value) -> str:
    if value is None:
        return "-"
    if name.endswith("_bytes"):
        return format_bytes(value)
    return f"{value:.2e}" if abs(value) < 1e-3 and value else f"{value:.4f}"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)
