"""What the two runs' traces say, before any weight is compared: the loop's calls within a window, the samples of
each window, the LRs, the gradient norms and the loss rows."""
from __future__ import annotations

from collections import Counter
from typing import Any

from ..launch import observed
from .compare import LOW_PRECISION_ROUNDING
from .runs import ScriptRun

SHORT_WINDOW = ("short_window_skipped", "short_window_extra")  # faults of the last window alone


def seen_in_loop(a: ScriptRun, t: ScriptRun, k: int, figures: dict[str, Any]) -> list[str]:
    """The faults the tracer saw in the accumulated run's calls: a zero_grad between two backward calls of a window
    that steps, a step per micro-batch, a scheduler stepped or a gradient clipped more than once a window. Each
    optimizer's steps are its own windows. Where each was made in the script goes into the figures (`<verdict>_at`)."""
    faults = []
    sites = a.trace.sites if a.trace else []
    if a.steps:
        at(figures, "backward", a.steps[0].site("B", sites))  # where the loss is backwarded: a mistake of the loss
    # Per micro-batch, a zero_grad leaves fewer than k backward calls to the step, in a window of k or more; one that
    # drops the backward calls of a window that never stepped, before a full window, is a skipped window.
    zeroed = next((s for s in a.steps if s.dropped and s.stepped < min(k, s.micro_batches)), None)
    if zeroed:
        figures["zero_grad_step"] = zeroed.step
        at(figures, "zero_grad_per_micro_batch", zeroed.site("Z", sites, zeroed.events[:zeroed.events.find("B")]
                                                             .count("Z")))
        faults.append("zero_grad_per_micro_batch")
    if len(a.steps) >= 1.5 * len(t.steps):
        at(figures, "step_per_micro_batch", a.steps[0].site("S", sites))
        faults.append("step_per_micro_batch")
    scheduled = next((s for s in a.steps if s.repeated("L")), None)
    if scheduled and "step_per_micro_batch" not in faults:
        figures.setdefault("lr_step", scheduled.step)
        figures.setdefault("lr_a", scheduled.lrs[0] if scheduled.lrs else float("nan"))
        figures.setdefault("lr_t", t.steps[min(scheduled.step, len(t.steps)) - 1].lrs[0] if t.steps[0].lrs else
                           float("nan"))
        at(figures, "schedule_per_micro_batch", scheduled.site("L", sites))
        faults.append("schedule_per_micro_batch")
    clipped = next((s for s in a.steps if s.repeated("C")), None)
    if clipped and "step_per_micro_batch" not in faults:
        figures["clip_step"] = clipped.step
        at(figures, "clip_per_micro_batch", clipped.site("C", sites))
        faults.append("clip_per_micro_batch")
    return faults


def skipped_windows(a: ScriptRun, k: int, figures: dict[str, Any]) -> list[int]:
    """The steps before which the accumulated run left a window unstepped: its backward calls dropped by the next
    zero_grad before a full window, or carried into the next window (more than k of them, no zero_grad between),
    and a last one backwarded after the run's last step. Each is a window the true batch stepped and this run did
    not (an epoch's short window, whichever epoch it ends)."""
    sites = a.trace.sites if a.trace else []
    skips = []
    typical = max(k, Counter(s.micro_batches for s in a.steps).most_common(1)[0][0]) if a.steps else k
    for s in a.steps:
        if s.dropped and s.stepped >= k:
            skips.append(s.step)
            at(figures, "short_window_skipped", s.site("Z", sites, s.events.count("Z") - 1),
               "zero_grad() at {} drops it")
        elif s.micro_batches > typical and "Z" not in s.events[s.events.find("B"):]:  # (two views: 2k a window)
            skips.append(s.step)
            at(figures, "short_window_skipped", s.site("S", sites), "step() at {} is not called for it")
    if a.trace and "B" in a.trace.dangling:
        skips.append(len(a.steps) + 1)
        at(figures, "short_window_skipped", a.steps[-1].site("S", sites),
           "step() at {} is not called for the run's last window")
    return skips


def refutes(verdict: str, a: ScriptRun, t: ScriptRun, k: int, figures: dict[str, Any]) -> bool:
    """Whether what the tracer recorded of the two runs (their first epochs' runs) rules the verdict out."""
    steps = a.steps
    if verdict == "step_per_micro_batch":  # needs windows of fewer micro-batches than k
        return not any(s.micro_batches < k for s in steps)
    if verdict == "schedule_per_micro_batch":  # needs a scheduler stepped twice in a window, or LRs that part
        return not any(s.repeated("L") for s in steps) and "lr_step" not in figures
    if verdict == "clip_per_micro_batch":
        return not any(s.repeated("C") for s in steps)
    if verdict == "short_window_skipped":  # needs fewer steps, or windows seen left unstepped
        return len(steps) >= len(t.steps) and "skipped_windows" not in figures
    if verdict == "short_window_extra":
        return len(steps) <= len(t.steps)
    if verdict == "short_window_divided_by_k":  # needs a window of fewer micro-batches, seen or at the epoch's end
        return all(s.micro_batches == k for s in steps) and not (a.trace and "B" in a.trace.dangling) and \
            len(steps) == len(t.steps) and sum(sum(s.samples) for s in steps) == sum(sum(s.samples) for s in t.steps) \
            and all(sum(s.samples) == sum(steps[0].samples) for s in steps)
    if verdict == "random_forward":
        return not (drew(a.trace, "forward") or a.trace.random_late)
    if verdict == "random_step":
        return not drew(a.trace, "step")
    return False


GENERATORS = {"torch": "torch's default generator", "random": "Python's random",
              "numpy": "NumPy's global generator"}
OWN_CODE = {"random": "random.uniform", "numpy": "np.random.uniform"}


def drew(trace, where: str) -> bool:
    """Whether a default generator moved there in the first windows: "forward" (a model's training forward) or
    "step" (between the forwards: an augmentation, a batch drawn there)."""
    return bool(trace and where in trace.random_draws)


def generators(trace, where: str) -> list[str]:
    """The generators that moved there, by name (a trace written before they were named: torch's)."""
    return trace.random_generators.get(where) or ["torch"]


def random_figures(trace) -> dict[str, str]:
    """What drew in the training forward, for random_forward's and random_across_ranks' sentences: the generators,
    and the modules random by kind or what else drew ("a functional draw in the forward: no module random by
    kind"). Where no watched generator moved in the forward, the modules random by kind in training say only
    that it may have drawn (later than the first windows, or from a generator of their own)."""
    modules = ", ".join(trace.random_modules + [f"{m} from a later step" for m in trace.random_late])
    if not drew(trace, "forward"):
        return {"random_modules": modules, "random_generators": "none watched",
                "random_drew": f"(or may have: modules random by kind were in training, {modules}, though no "
                               f"generator the audit watches moved in the first windows, where it watches them; "
                               f"they may draw later, or from a generator of their own)",
                "random_fields": ", ".join(trace.random_fields) or "none"}
    names = generators(trace, "forward")
    own = [f"a draw in the forward's own code, such as a LayerDrop by {OWN_CODE[n]}" for n in names if n in OWN_CODE]
    if not modules and "torch" in names:
        own.insert(0, "a functional draw in the forward, such as F.dropout or torch.rand")
    what = ", and ".join([modules] * bool(modules) + own) + ("" if modules else ": no module random by kind")
    return {"random_modules": modules or "none by kind", "random_generators": ", ".join(names),
            "random_drew": f"from {' and '.join(GENERATORS.get(n, n) for n in names)} ({what})",
            "random_fields": ", ".join(trace.random_fields) or "none"}


def at(figures: dict[str, Any], verdict: str, site: str | None, phrase: str = "{}") -> None:
    """Where the script made the call a verdict concerns, the first time it is seen."""
    if site:
        figures.setdefault(f"{verdict}_at", phrase.format(site))


def data_parting(a: ScriptRun, t: ScriptRun, upto: int | None = None) -> int | None:
    """The first window (step) whose samples differ between the runs, over the steps both made (and up to `upto`);
    None where none."""
    return next((s.step for s, u in zip(a.steps[:upto], t.steps) if not observed.same_data(s, u)), None)


def lr_parting(a: ScriptRun, t: ScriptRun) -> int | None:
    """The first step at which the LRs that both runs printed differ; None where they agree or were not printed."""
    if not a.lrs or len(a.lrs) != len(a.losses) or len(t.lrs) != len(t.losses):
        return None
    return next((step for step, (x, y) in enumerate(zip(a.lrs, t.lrs), 1)
                 if abs(x - y) > 1e-9 * max(abs(x), abs(y))), None)


def norm_parting(a: ScriptRun, t: ScriptRun, dtype: str, upto: int | None = None) -> int | None:
    """The first step whose window gradients, before any clipping, differ in norm between runs whose weights
    agree: clip_grad_norm_ cuts both to one length, and Adam's update hides a gradient's scale, so the weights
    alone would read exact. Below float64, weights that agree within the tolerance (1e-5 in float32) may give
    gradients a little further apart at a later step, so only a difference beyond what rounding makes between
    two batch shapes counts (the mistakes this finds differ by factors: 4, 2/3)."""
    within = 1e-6 if dtype == "float64" else LOW_PRECISION_ROUNDING
    return next((s.step for s, u in zip(a.steps, t.steps) if s.grad_norm is not None and u.grad_norm is not None
                 and abs(s.grad_norm - u.grad_norm) > within * abs(u.grad_norm) and s.step <= (upto or s.step)), None)


def rows_part(a: ScriptRun, t: ScriptRun, tol: float) -> int | None:
    """The first step whose loss rows differ; None where they agree throughout."""
    return next((step for step, (x, y) in enumerate(zip(a.losses, t.losses), 1)
                 if abs(x - y) > tol * max(abs(x), abs(y))), None)
