"""The diagnosis: which runs to make, in what order, and the verdicts that what they show supports. What the tracer
saw comes first; the weights and the windows' gradients decide what it could not."""
from __future__ import annotations

import dataclasses
from typing import Any

from .compare import (LOW_PRECISION_ROUNDING, Update, buffers_differ, gradients, live_batchnorm, rel, tolerance,
                      update, weight_penalty, weights)
from . import ranks
from .runs import Auditor, ScriptRun
from .traces import (GENERATORS, SHORT_WINDOW, data_parting, drew, generators, lr_parting, norm_parting,
                     random_figures, rows_part, seen_in_loop, refutes, skipped_windows)
from .verdicts import Finding, site

def classify(ratio: float, cos: float, k: int, first: bool, last: bool, clipped: bool = False, short: int = 0) -> str:
    """The mistake whose signature one differing update has. zero_grad per micro-batch and an undivided loss
    change every window, so they part the runs at the first update: a later update is neither. `clipped`: both
    updates were cut to one length (Update.clipped). `short`: the micro-batches of the update's window where the
    tracer saw fewer than k, wherever it falls; `last`: the epoch's last update, which may be short. A turned
    update of a short window is not named a mean of micro-batch means: Adam turns a short window divided by k so
    too (ratio 0.98, cosine 0.996)."""
    if first and cos > 0.999 and abs(ratio / k - 1) < 0.02:
        return "loss_not_divided"
    m = short or (round(ratio * k) if last else 0)  # the window's micro-batches, seen or read off the ratio
    if (short or last) and cos > 0.99 and ratio < 0.98 and 1 <= m < k and abs(ratio * k - m) < 0.1:
        return "short_window_divided_by_k"
    if cos > 1 - 1e-6:  # the same gradient, scaled: a mean of means would also turn it
        return "update_scaled"
    if clipped:  # and turned
        return "differs_under_clipping"
    # (At the last update alone a short window under Adam turns so too: `unexplained`, whose sentence says where.)
    if cos > 0.98 and 0.5 < ratio < 2 and (first or not (last or short)):
        return "mean_of_micro_batch_means"
    if first and ratio < 0.75 and cos < 0.999:
        return "zero_grad_per_micro_batch"
    return "unexplained"


def audit(auditor: Auditor, b: int, k: int, steps: int) -> Finding:
    """The diagnosis, each verdict held against what the trace recorded: one that the trace refutes is not given
    (`unexplained`, with the figures, and `contradicted` naming it). On N ranks, ranks whose weights part come
    first (`grads_not_synced`, alone), then a mistake of the reduction where it deals each rank other samples in
    the two runs (alone too); otherwise the reduction across ranks is checked after the accumulation."""
    if auditor.nproc > 1:
        dtype, tol = tolerance(auditor.run("accumulated", b, k, steps).state)
        first = (ranks.unsynced(auditor, b, k, steps, tol, dtype) or
                 ranks.reduction_first(auditor, b, k, steps, tol, dtype))
        if first:
            return first
    config = auditor.config  # (one epoch: the diagnosis may go on within the study's epochs, `stretch`)
    finding = diagnose(auditor, b, k, steps)
    ea, et = (next(r for r in auditor.runs if r.name == name) for name in ("accumulated", "true batch"))
    refuted = [v for v in finding.verdicts if refutes(v, ea, et, k, finding.figures)]
    if refuted:
        finding.figures["contradicted"] = ", ".join(refuted)
        finding.verdicts = list(dict.fromkeys(v if v not in refuted else "unexplained" for v in finding.verdicts))
    randomized(finding, ea.trace)
    if "zero_grad_step" not in finding.figures:
        # Its signature, but the tracer saw one zero_grad() a window: what else makes it cannot be told from it.
        finding.verdicts = list(dict.fromkeys("zero_grad_unseen" if v == "zero_grad_per_micro_batch" else v
                                              for v in finding.verdicts))
    if auditor.nproc > 1:
        auditor.config = config
        ranks.across(auditor, finding, b, k, steps)
    return finding


def randomized(finding: Finding, trace) -> None:
    """Where random numbers were drawn and the runs part by any measure (the weights, the windows' gradients, the
    study's schedule), a verdict that other draws could make too is not given: `random_forward` where the training
    forward drew (or a module random by kind was in training at the run's end: a p raised after the first
    windows), else `random_step` where the step drew outside the forward (noise on the targets or the gradients, a
    teacher in training mode under no_grad). A verdict of a factor (k, m/k), a call seen, or the step counts,
    random numbers do not make, and stays. Where the forward drew and the windows held other samples, its draws
    moved the generator the batches are drawn from: `random_forward` too. The note that the forward drew and the
    runs agreed all the same is given beside `exact` alone."""
    forward = drew(trace, "forward") or bool(trace and trace.random_late)
    if finding.verdicts == ["exact"]:
        finding.notes += randomness(trace)
        return
    # Modules random by kind in training, though no generator the tracer watches moved: they may draw from one of
    # their own (or not be called); a guess is then not given either.
    own = not forward and bool(trace and trace.random_modules)
    if own and any(v in GUESSES for v in finding.verdicts):
        finding.figures.update(random_figures(trace))
        finding.verdicts = list(dict.fromkeys("random_forward" if v in GUESSES else v for v in finding.verdicts))
        return
    if not (forward or drew(trace, "step")):
        return
    seen = finding.figures.get("zero_grad_step")
    guesses = [v for v in finding.verdicts if v in GUESSES or v == "zero_grad_per_micro_batch" and not seen
               or v == "data_differs" and forward]
    if guesses:
        if forward:
            finding.figures.update(random_figures(trace))
        else:
            finding.figures["step_generators"] = " and ".join(GENERATORS[n] for n in generators(trace, "step"))
        instead = "random_forward" if forward else "random_step"
        finding.verdicts = list(dict.fromkeys(v if v not in guesses else instead for v in finding.verdicts))


# The verdicts that a difference of another kind (other random numbers, state the forward reads) can make too.
GUESSES = ("mean_of_micro_batch_means", "update_scaled", "differs_under_clipping", "unexplained", "stateful_forward")


def diagnose(auditor: Auditor, b: int, k: int, steps: int) -> Finding:
    """The runs and the diagnosis; see the module's docstring. What the tracer saw comes first: the loop's calls
    (zero_grad, step, scheduler, clip within a window), the windows it left unstepped, the samples of each window
    and the LRs; then the weights and each window's gradient, which decide: a call the tracer saw is a verdict only
    where the measurements differ, and a note beside `exact` where they agree. Every fault found is a verdict, in
    the order met."""
    B = b * k
    ea, et = auditor.run("accumulated", b, k, steps), auditor.run("true batch", B, 1, steps)
    dtype, tol = tolerance(et.state)
    na, nt = len(ea.steps), len(et.steps)
    counts = f"{nt}" if na == nt else f"{na} and {nt}"
    compared = [(f"after {counts} step{'' if counts == '1' else 's'}", rel(ea, et))]
    figures = {"dtype": dtype, "tolerance": tol, "steps_accumulated": na, "steps_true_batch": nt}
    seen = seen_in_loop(ea, et, k, figures)
    notes: list[str] = []  # (the forward's randomness is noted in audit, once the verdict is known)
    if "step_per_micro_batch" in seen:  # windows that do not line up
        return Finding(seen, figures, compared, notes)
    limit = counted(ea, et, k, seen, figures)  # the steps both runs made over the same windows
    if limit is False:
        return Finding(seen or ["unexplained"], figures, compared, notes)
    parted = data_parting(ea, et, limit)
    if parted:
        figures["data_window"] = parted
        return Finding([*seen, same_samples(auditor.run("repeat", B, 1, steps), ea, et, figures)], figures, compared,
                       notes)
    lr_step = lr_parting(ea, et)
    if lr_step and na == nt:  # a constant factor is the script's own scaling; one that changes, a schedule out of step
        figures.update(lr_step=lr_step, lr_a=ea.lrs[lr_step - 1], lr_t=et.lrs[lr_step - 1])
        factors = {round(x / y, 9) for x, y in zip(ea.lrs, et.lrs) if y}
        scaled = "lr_differs" if len(factors) == 1 else "schedule_per_micro_batch"
        return Finding(list(dict.fromkeys([*seen, scaled])), figures, compared, notes)
    calls = [v for v in seen if v not in SHORT_WINDOW]
    if calls and na == nt and compared[0][1] <= tol and not norm_parting(ea, et, dtype):
        # The measurement wins: the weights, the windows' gradients and the LRs agree, so what the trace saw is a note.
        notes += [f"the tracer saw {v} ({site(v, figures)}), but the weights, the windows' gradients and the LRs of "
                  f"the two runs agree, so it changed nothing here" for v in calls]
        return Finding(["exact"], figures, compared, notes)
    if calls:  # a call in every window: what the weights show is its doing
        return Finding(seen, figures, compared, notes)
    if na != nt or limit is not None:  # (windows carried over leave the counts equal)
        return Finding([*seen, *common_windows(auditor, ea, et, b, k, lr_step, limit, tol, dtype, figures, compared)],
                       figures, compared, notes)
    if compared[0][1] <= tol:
        # An epoch of one window may be one micro-batch (b at least the training set): nothing accumulated.
        if steps == 0 and nt == 1 and len(auditor.run("per micro-batch", b, 1, 0).steps) == 1:
            return Finding(["nothing_accumulated"], figures, compared, notes)
        hidden = norm_parting(ea, et, dtype)
        if hidden:  # equal weights from gradients that differ: a clip, or Adam, hid it
            return Finding([by_gradient(auditor, b, k, hidden, et, tol, figures)], figures, compared, notes)
        stretched = stretch(auditor, ea, et, tol, figures, compared)
        if stretched is None:
            return Finding(["exact"], figures, compared, notes + kept_apart(ea, et, tol))
        ea, et = stretched  # they part within the study's schedule: the audit goes on in it
    return Finding([*seen, *weighed(auditor, ea, et, b, k, tol, dtype, figures, compared)], figures, compared, notes)


def counted(ea: ScriptRun, et: ScriptRun, k: int, seen: list[str], figures: dict[str, Any]) -> int | None | bool:
    """Where the step counts part: the short-window verdict their difference supports (added to `seen`) and the
    steps made over the same windows (None: all both made), or False where nothing explains the difference."""
    na, nt = len(ea.steps), len(et.steps)
    skips = skipped_windows(ea, k, figures)
    if skips and (na == nt or nt - na == len(skips)):  # every step short is a window seen left unstepped (or carried)
        seen.append("short_window_skipped")
        figures["skipped_windows"] = len(skips)
        return skips[0] - 1
    if na == nt:
        return None
    if abs(na - nt) == 1:  # (an update past the shorter run's last compared with none would read as a mistake)
        seen.append({-1: "short_window_skipped", 1: "short_window_extra"}[na - nt])
        return None
    return False


def same_samples(again: ScriptRun, ea: ScriptRun, et: ScriptRun, figures: dict[str, Any]) -> str:
    """Windows that held other samples: the script's doing at b (data_differs) where the true batch repeats its own
    samples, else a script that differs from itself. Where a run's step drew random numbers between its forwards
    (an augmentation, or batches drawn there), the figures name the generators."""
    if not data_parting(again, et):
        step = next((run.trace for run in (ea, et) if drew(run.trace, "step")), None)
        if step:  # (the sentence names the draws in the step beside those before training)
            figures["step_generators"] = " and ".join(GENERATORS[n] for n in generators(step, "step"))
        return "data_differs"
    figures["repeat_rel_diff"] = rel(again, et)
    return "not_reproducible"


def randomness(trace) -> list[str]:
    """Where the forward drew random numbers and the runs agree all the same: a note (one dropout layer draws its
    masks in the same order at (b, k) as at (b*k, 1); two do not)."""
    if not drew(trace, "forward"):
        return []
    return [f"the training forward drew random numbers {random_figures(trace)['random_drew']}, and the two runs "
            "agreed all the same: the draws fell alike at (b, k) and at (b*k, 1) in these runs (as one dropout "
            "layer's masks do)"]


def kept_apart(a: ScriptRun, t: ScriptRun, tol: float) -> list[str]:
    keys = buffers_differ(a, t, tol)
    return [f"buffers that are not weights differ between the runs ({', '.join(keys[:5])}"
            f"{', ...' if len(keys) > 5 else ''}): each training forward updates them, k times a window at (b, k) "
            f"and once at (b*k, 1); the weights the optimizer trains agree"] if keys else []


def common_windows(auditor: Auditor, ea: ScriptRun, et: ScriptRun, b: int, k: int, lr_step: int | None,
                   aligned: int | None, tol: float, dtype: str, figures: dict[str, Any], compared: list) -> list[str]:
    """A fault besides a short window's, in the full windows both runs stepped. A schedule over the run's own number
    of steps parts the LRs where the counts differ (transformers before 4.46: 12 steps against 13): weights are
    compared only up to the step before the LRs part, and gradients up to that step, whose weights agreed. A window
    left unstepped mid-run puts the runs' later windows on other samples: they are compared up to the step before
    it (`aligned` steps)."""
    n = min(len(ea.steps), len(et.steps), len(ea.steps) if aligned is None else aligned)
    comparable = min(n, lr_step) if lr_step else n  # gradients: of weights made at the same LRs
    if lr_step:
        figures["lr_step"] = lr_step
        n = min(n, lr_step - 1)
    if n >= 1:
        a, t = auditor.run("accumulated", b, k, n), auditor.run("true batch", b * k, 1, n)
        cut = aligned is not None and aligned < min(len(ea.steps), len(et.steps))
        compared.append((f"after the {n} step{'s' * (n != 1)} both made" + (" at the same LRs" if lr_step else "") +
                         (" over the same windows" if cut else ""), rel(a, t)))
        if compared[-1][1] > tol:
            return weighed(auditor, a, t, b, k, tol, dtype, figures, compared)
    hidden = norm_parting(ea, et, dtype, comparable)
    return [by_gradient(auditor, b, k, hidden, et, tol, figures)] if hidden else []


def by_gradient(auditor: Auditor, b: int, k: int, s: int, et: ScriptRun, tol: float, figures: dict[str, Any]) -> str:
    """The verdict where the weights agree but the windows' gradients of step s differ: named from them."""
    a, t = auditor.run("accumulated", b, k, s), auditor.run("true batch", b * k, 1, s)
    figures["first_differing_gradient"] = s
    grads = gradients(a, t, s)
    if grads is None:
        return "unexplained"
    figures.update(grads.figures("gradient"))
    base = auditor.run("true batch", b * k, 1, s - 1) if s > 1 else auditor.start()
    return _named(auditor, grads, (base, a, t), et, s, k, tol, figures)


def weighed(auditor: Auditor, ea: ScriptRun, et: ScriptRun, b: int, k: int, tol: float, dtype: str,
            figures: dict[str, Any], compared: list) -> list[str]:
    """The verdict of runs that part in their weights: the first update where they do, its two updates and the
    two windows' gradients before any clipping compared."""
    B = b * k
    u = first_parting(auditor, b, k, len(et.losses), tol, rows_part(ea, et, tol))
    a, t = auditor.run("accumulated", b, k, u), auditor.run("true batch", B, 1, u)
    before = auditor.run("true batch", B, 1, u - 1) if u > 1 else None  # the weights before it, which agree
    if before:
        compared.append((f"after step {u - 1}", rel(auditor.run("accumulated", b, k, u - 1), before)))
    if u < len(et.losses):  # the last update's runs are the epoch's, compared already
        compared.append((f"after step {u}", rel(a, t)))
    if not repeats(auditor, t, tol, figures, compared):
        return ["not_reproducible"]
    base = before or auditor.start()
    still = skipped(auditor, base, a, t, u)
    if still:  # (before BatchNorm's verdict: a step that moved nothing is no normalization's doing)
        figures.update(first_differing_update=u)
        return [still]
    if u == 1 and live_batchnorm(a, t):
        return ["batchnorm"]
    stateful = buffers_differ(a, t, tol)  # state the forward may read, which each micro-batch updates
    measured = update(base, a, t, None, tol)
    if measured.shares is None and u > 1:  # no fit without a momentum's share: the weights before the update before u
        prior = auditor.run("true batch", B, 1, u - 2) if u > 2 else auditor.start()
        measured = update(base, a, t, prior, tol)
    figures.update(first_differing_update=u, **measured.figures())
    # The windows' gradients before any clipping: what an optimizer (Adam's scale) or a clip would hide.
    grads = gradients(a, t, u)
    if grads is not None:
        figures.update(grads.figures("gradient"))
        measured = grads
    if dtype != "float64" and measured.difference < LOW_PRECISION_ROUNDING:
        return ["within_rounding"]
    verdict = _named(auditor, measured, (base, a, t), et, u, k, tol, figures)
    if stateful and verdict in GUESSES:  # what parts the runs cannot be told from that state
        figures["stateful_buffers"] = ", ".join(stateful[:5])
        return ["stateful_forward"]
    return [verdict]


def stretch(auditor: Auditor, ea: ScriptRun, et: ScriptRun, tol: float, figures: dict[str, Any],
            compared: list) -> tuple[ScriptRun, ScriptRun] | None:
    """The runs that agreed again, to the same step within the study's own schedule, where theirs decayed by the
    epoch's end and the study trains for more epochs; None where they agree there too (or nothing changes). A
    schedule over {epochs} puts the end of a one-epoch run at its tail, where a mistake of the last window moves
    almost nothing (a loss over k in a short window under Adam and a cosine to 0: 4e-6 of the weights in float32,
    within the tolerance), while in training that window ends epoch 1 at nearly the full LR (there: 1e-3)."""
    n = len(et.losses)
    if auditor.epochs <= 1 or len(et.lrs) != n or not n or et.lrs[-1] >= max(et.lrs):
        return None
    auditor.config = dataclasses.replace(auditor.config, epochs=auditor.epochs)
    t = auditor.run("true batch", et.b, 1, n)
    if t.lrs == et.lrs:  # its schedule does not follow {epochs} (it decays per step, or over {max_steps})
        figures["last_lr_share"] = et.lrs[-1] / max(et.lrs)
        return None
    a = auditor.run("accumulated", ea.b, ea.k, n)
    figures["schedule_epochs"] = auditor.epochs
    compared.append((f"after {n} steps of the schedule over {auditor.epochs} epochs", rel(a, t)))
    return (a, t) if compared[-1][1] > tol else None


def _named(auditor: Auditor, measured: Update, runs: tuple[ScriptRun, ScriptRun, ScriptRun], et: ScriptRun, u: int,
           k: int, tol: float, figures: dict[str, Any]) -> str:
    """The verdict of differing update u, measured from `runs` (the weights before it, and both runs after it)."""
    base, a, t = runs
    penalty = weight_penalty(base, measured) if u == 1 else None  # (a mistake of every window: it parts them at once)
    if penalty:
        figures.update(penalty)
        return "weight_penalty_per_micro_batch"

    window = a.steps[u - 1].micro_batches if len(a.steps) >= u else k
    short = window if 0 < window < k else 0  # a short window, wherever the tracer saw it

    def named(first: bool) -> str:
        return classify(measured.ratio, measured.cosine, k, first=first, last=u == len(et.losses),
                        clipped=measured.clipped, short=short)

    verdict = named(u == 1)
    if verdict != named(True) and not moved_before(auditor, base, et, u, tol):
        verdict = named(True)
    return verdict


def moved_before(auditor: Auditor, base: ScriptRun, et: ScriptRun, u: int, tol: float) -> bool:
    """Whether an update before u (> 1) moved the weights `base` holds (asked only where the verdict depends on
    it). A warmup from LR 0, where transformers' linear schedule starts, leaves them as they started: u is then
    the first update, where a mistake of every window shows. The rows' LRs say it where the script prints them;
    else the start's weights are compared."""
    if len(et.lrs) == len(et.losses):
        return any(et.lrs[:u - 1])
    return rel(base, auditor.start()) > tol


def skipped(auditor: Auditor, base: ScriptRun, a: ScriptRun, t: ScriptRun, u: int) -> str | None:
    """The verdict where one run's update u left every weight exactly as it was and the other's moved them, as a
    GradScaler's skipped step does (fp16 gradients with inf or NaN); None where both moved."""
    import torch

    if torch.equal(weights(t.state), weights(base.state)):
        return "true_batch_step_skipped"
    # From its own weights before u: the runs agree there within the tolerance only.
    before = auditor.run("accumulated", a.b, a.k, u - 1) if u > 1 else base
    return "accumulated_step_skipped" if torch.equal(weights(a.state), weights(before.state)) else None


def repeats(auditor: Auditor, t: ScriptRun, tol: float, figures: dict[str, Any], compared: list) -> bool:
    """Whether a second run of the true batch `t` gives its weights again (recorded in the comparisons): a script
    that differs from itself would pass any difference off as a mistake (an unseeded shuffle reads almost as
    zero_grad: r 0.78)."""
    again = rel(auditor.run("repeat", t.b, t.k, t.max_steps), t)
    figures["repeat_rel_diff"] = again
    n = len(t.losses)
    compared.append((f"between two true-batch runs of {n} step{'' if n == 1 else 's'}", again))
    return again <= tol


def first_parting(auditor: Auditor, b: int, k: int, n: int, tol: float, rows: int | None) -> int:
    """The first update after which the runs' weights differ, by bisection over max_steps: they agree before
    update 1 and differ after n. The loss rows say where to look first, never where it is, since a script with
    a mistake often prints its loss in the mistake's scale. Row s is printed from the weights after s - 1
    updates, so rows that part at step `rows` > 1 point at update rows - 1 (a warmup from LR 0 parts the runs
    at update 2, the first that moves) or, where only the row is printed otherwise, at update rows (a short
    last window): a pair of runs before it and one at it bracket either. Rows that agree throughout point at
    the last update; rows that differ from the first, at update 1 (a mistake of every window), then the last."""
    def agree(steps: int) -> bool:
        return rel(auditor.run("accumulated", b, k, steps), auditor.run("true batch", b * k, 1, steps)) <= tol

    first = [n - 1] if rows is None else [1, n - 1] if rows == 1 else [rows - 1, rows - 2, rows]
    low, high = 0, n  # agree after `low` updates, differ after `high`
    for steps in first:
        if low < steps < high:
            low, high = (steps, high) if agree(steps) else (low, steps)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if agree(mid) else (low, mid)
    return high
