"""The audit across ranks (`--nproc N`): the script at (b, k) and at (b*k, 1) on N ranks, whose difference is a
mistake of the accumulation (diagnose.py, on rank 0), and at (b*k*N, 1) on one rank, whose difference from (b*k, 1)
on N ranks is one of the reduction across ranks; and each rank's weights against rank 0's, which DDP keeps equal."""
from __future__ import annotations

from typing import Any

from .compare import LOW_PRECISION_ROUNDING, gradients, live_batchnorm, rel, update, weights
from .runs import AuditError, Auditor, ScriptRun
from .traces import drew, lr_parting, norm_parting, random_figures
from .verdicts import VERDICTS, Finding

# |ratio / N − 1| (or |ratio · N − 1|) below this, at cosine above 0.999: the update is N (or 1/N) times the global
# batch's, as a loss scaled by the world size makes it.
WORLD_WITHIN = 0.02


def parted(a: ScriptRun) -> tuple[int, float] | None:
    """(the rank, its relative weight difference from rank 0) of the rank furthest from rank 0; None for one rank,
    or where ranks hold other tensors than rank 0 (shards of a model, not DDP's replicas)."""
    shapes = {key: t.shape for key, t in a.state.items()}
    if any({key: t.shape for key, t in state.items()} != shapes for state in a.others.values()):
        return None
    diffs = {rank: rel_weights(state, a.state) for rank, state in a.others.items()}
    return max(diffs.items(), key=lambda item: item[1]) if diffs else None


def rel_weights(state: dict, reference: dict) -> float:
    wa, wt = weights(state), weights(reference)
    return float((wa - wt).norm() / wt.norm().clamp_min(1e-300))


def unsynced(auditor: Auditor, b: int, k: int, steps: int, tol: float, dtype: str) -> Finding | None:
    """`grads_not_synced` where the accumulated run's ranks part: every rank steps with the same all-reduced gradient
    from the same start, so ranks whose weights part never all-reduced some micro-batch's gradient. Named alone:
    rank 0's weights then lack the other ranks' share of a window, and what they show is no mistake of its own."""
    ea = auditor.run("accumulated", b, k, steps)
    if len(ea.rank_traces) != auditor.nproc:
        raise AuditError(f"--nproc {auditor.nproc}: the tracer saw {len(ea.rank_traces) or 'no'} rank"
                         f"{'' if len(ea.rank_traces) == 1 else 's'} step: pass {{world_size}} to a launcher that "
                         f"starts that many ranks, each in a process group or with RANK set (torchrun does both)")
    worst = parted(ea)
    if worst is None or worst[1] <= tol:
        return None
    figures: dict[str, Any] = {"dtype": dtype, "tolerance": tol, "steps_accumulated": len(ea.steps),
                               "rank_parted": worst[0], "rank_rel_diff": worst[1], "nproc": auditor.nproc}
    u = first_apart(lambda steps: (parted(auditor.run("accumulated", b, k, steps)) or (0, 0.0))[1] <= tol,
                    len(ea.steps), unreduced(ea))
    figures["rank_first_parting"] = u
    if ea.steps[u - 1].micro_batches < k:  # a short window: a sync switched on by counting to k never comes
        figures["rank_parting_window"] = ea.steps[u - 1].micro_batches
    et = auditor.run("true batch", b * k, 1, steps)
    synced = parted(et)
    compared = [(f"rank {worst[0]} against rank 0, accumulated, after {len(ea.steps)} steps", worst[1])]
    if synced is not None and synced[1] > tol:  # no all-reduce at all: ranks that train apart, by design or not
        figures["true_batch_rank_rel_diff"] = synced[1]
        compared.append((f"rank {synced[0]} against rank 0, true batch, after {len(et.steps)} steps", synced[1]))
        return Finding(["ranks_train_apart"], figures, compared)
    return Finding(["grads_not_synced"], figures, compared)


def reduction_first(auditor: Auditor, b: int, k: int, steps: int, tol: float, dtype: str) -> Finding | None:
    """A mistake of the reduction across ranks, named alone, where each rank holds other samples at (b, k) than at
    (b*k, 1) (micro-batches dealt to the ranks in turn, as Accelerate deals them) and the two runs part: that
    mistake weights each rank's samples otherwise in the two, so the accumulation cannot be judged before it is
    fixed, and the runs that would diagnose it are not made. None where it does not apply."""
    ea, et = auditor.run("accumulated", b, k, steps), auditor.run("true batch", b * k, 1, steps)
    window, differ, n = dealt(ea, et), rel(ea, et), auditor.nproc
    if not window or differ <= tol:
        return None
    eg = auditor.run("one rank", b * k * n, 1, steps, nproc=1)
    f: dict[str, Any] = {"dtype": dtype, "tolerance": tol, "steps_accumulated": len(ea.steps),
                         "steps_true_batch": len(et.steps), "nproc": n, "steps_one_rank": len(eg.steps)}
    verdict = reduction(auditor, et, eg, b * k, steps, tol, f)
    if verdict not in MISTAKES:
        return None
    compared = [(f"(b, k) against (b*k, 1) on {n} ranks", differ),
                (f"(b*k, 1) on {n} ranks against (b*k*{n}, 1) on one rank", rel(et, eg))]
    return Finding([verdict], f, compared, [
        f"(b, k) and (b*k, 1) on {n} ranks differ too, but each rank holds other samples at (b, k) than at (b*k, 1) "
        f"from window {window} on (the windows as a whole are the same), so a mistake of the reduction across ranks "
        f"weights them otherwise in the two runs: fix {verdict} and audit again to check the accumulation"])


def across(auditor: Auditor, finding: Finding, b: int, k: int, steps: int) -> None:
    """(b*k, 1) on N ranks against (b*k*N, 1) on one rank: their verdict, added to the finding's (in place of
    `exact`); nothing where they agree."""
    f, n = finding.figures, auditor.nproc
    tol = f["tolerance"]
    et = auditor.run("true batch", b * k, 1, steps)
    eg = auditor.run("one rank", b * k * n, 1, steps, nproc=1)
    f.update(nproc=n, steps_one_rank=len(eg.steps))
    finding.compared.append((f"(b*k, 1) on {n} ranks against (b*k*{n}, 1) on one rank", rel(et, eg)))
    verdict = reduction(auditor, et, eg, b * k, steps, tol, f)
    ea = auditor.run("accumulated", b, k, steps)
    window = dealt(ea, et)
    accumulation = [v for v in finding.verdicts if v != "exact"]
    if verdict in MISTAKES and accumulation and window:
        finding.notes.append(
            f"(b, k) and (b*k, 1) on {n} ranks differ too ({', '.join(accumulation)}), but each rank holds other "
            f"samples at (b, k) than at (b*k, 1) from window {window} on (the windows as a whole are the same), so "
            f"a mistake of the reduction across ranks weights them otherwise in the two runs: fix {verdict} and "
            f"audit again to check the accumulation")
        accumulation = []
    if verdict:  # (`exact` stays beside a comparison that cannot be made: the accumulation was checked)
        kept = [v for v in finding.verdicts if v == "exact" and VERDICTS[verdict][0] != 1]
        finding.verdicts = kept + accumulation + [verdict]
    worst = parted(ea)
    if worst:
        finding.notes.append(f"on {n} ranks every rank's weights agree with rank 0's after the accumulated run (rank "
                             f"{worst[0]}: {worst[1]:.3g}), so every micro-batch's gradient was all-reduced" +
                             ("" if verdict else f", and (b*k, 1) on {n} ranks equals (b*k*{n}, 1) on one rank"))


def reduction(auditor: Auditor, et: ScriptRun, eg: ScriptRun, B: int, steps: int, tol: float,
              f: dict[str, Any]) -> str | None:
    """The verdict of the reduction across ranks, or None where N ranks equal one. What stops a comparison comes
    first: other samples, another LR, randomness or BatchNorm, each of which parts the runs whatever the loss does.
    Weights that agree are not enough: clip_grad_norm_ cuts both windows' gradients to one length (and Adam's
    update hides a gradient's scale), so a loss divided by N once too often leaves the weights equal while the
    windows' gradients, before any clipping, differ N-fold; where their norms part, those gradients decide."""
    n = auditor.nproc
    window = apart(et, eg)
    if window:
        f["rank_data_window"] = window
        return "ranks_data_differ"
    hidden = norm_parting(et, eg, f["dtype"]) if rel(et, eg) <= tol else None
    if rel(et, eg) <= tol and not hidden:
        return None
    lr_step = lr_parting(et, eg)
    if lr_step:
        f.update(lr_step=lr_step, lr_a=et.lrs[lr_step - 1], lr_t=eg.lrs[lr_step - 1])
        return "lr_differs_by_world"
    trace = et.trace
    if drew(trace, "forward"):  # (a module random by kind that never drew is no randomness)
        f.update(random_figures(trace))
        return "random_across_ranks"
    if live_batchnorm(et, eg):
        return "batchnorm_across_ranks"
    hint = norm_parting(et, eg, f["dtype"])
    grads = gradients(et, eg, 1) if hint == 1 else None  # (every run keeps window 1's: no run to make for it)
    u = 1 if grads else hidden or first_apart(lambda steps: rel(auditor.run("true batch", B, 1, steps), auditor.run(
        "one rank", B * n, 1, steps, nproc=1)) <= tol, len(eg.steps), hint)
    counts = [sum(r.steps[u - 1].samples) if r.steps[u - 1].tokens is None else r.steps[u - 1].tokens
              for r in et.rank_traces.values() if len(r.steps) >= u]
    f.update(rank_first_differing_update=u, rank_counts=", ".join(map(str, counts)))
    if grads is None:  # the update u, from the weights before it, and its windows' gradients
        a, t = auditor.run("true batch", B, 1, u), auditor.run("one rank", B * n, 1, u, nproc=1)
        base = auditor.run("one rank", B * n, 1, u - 1, nproc=1) if u > 1 else auditor.start()
        measured = update(base, a, t, None, tol)
        f.update(rank_update_ratio=measured.ratio, rank_update_cosine=measured.cosine,
                 rank_update_difference=measured.difference)
        grads = gradients(a, t, u)  # before any clipping and before the optimizer: the scale the weights may hide
    if grads is not None:
        f.update(rank_gradient_ratio=grads.ratio, rank_gradient_cosine=grads.cosine,
                 rank_gradient_difference=grads.difference)
        measured = grads
    if hidden:  # the weights agree: the clip's threshold that hid the scale (0: none seen, the optimizer did)
        f["rank_weights_agree"] = et.steps[u - 1].clip or 0.0
    if f["dtype"] != "float64" and measured.difference < LOW_PRECISION_ROUNDING:
        return "rounding_across_ranks"
    if measured.cosine > 0.999 and min(abs(measured.ratio / n - 1), abs(measured.ratio * n - 1)) < WORLD_WITHIN:
        return "loss_scaled_by_world"
    if len(set(counts)) > 1 and measured.cosine < 1 - 1e-6:
        return "mean_of_rank_means"
    return "unexplained_across_ranks"


# The reduction's verdicts that name a mistake (not a comparison that cannot be made).
MISTAKES = ("loss_scaled_by_world", "mean_of_rank_means", "unexplained_across_ranks")


def dealt(ea: ScriptRun, et: ScriptRun) -> int | None:
    """The first window where some rank's own samples differ between (b, k) and (b*k, 1) on N ranks; None where
    every rank holds the same samples in both."""
    from ..launch.observed import same_data

    return min((i for rank, trace in ea.rank_traces.items() if rank in et.rank_traces
                for i, (s, u) in enumerate(zip(trace.steps, et.rank_traces[rank].steps), 1) if not same_data(s, u)),
               default=None)


def per_rank(run: ScriptRun) -> list[list[str]]:
    """What each rank of a run did, a row per rank (steps, micro-batches of the first window, samples and counted
    tokens over the run), where the ranks differ in any of it; none where they all did the same."""
    rows = [[str(rank), str(len(t.steps)), str(t.steps[0].micro_batches) if t.steps else "0",
             str(sum(sum(s.samples) for s in t.steps)),
             str(sum(s.tokens for s in t.steps)) if t.steps and None not in [s.tokens for s in t.steps] else "-"]
            for rank, t in run.rank_traces.items()]
    return rows if len({tuple(row[1:]) for row in rows}) > 1 else []


def unreduced(run: ScriptRun) -> int | None:
    """The first step whose window gradient (its norm before any clipping) differs between the ranks, as the
    tracer saw it: DDP's all-reduce leaves every rank the same one; None where they all agree or one has none."""
    norms = [[s.grad_norm for s in trace.steps] for trace in run.rank_traces.values()]
    for step, row in enumerate(zip(*norms), 1):
        if None in row:
            return None
        if max(row) - min(row) > 1e-9 * max(map(abs, row)):
            return step
    return None


def first_apart(agree, n: int, hint: int | None = None) -> int:
    """The first of n updates after which two runs part, where they part after n: the traces' hint first (the
    first window whose gradients differ): update 1 as it is (from one start, different gradients part the weights
    at once), a later one where a run before it agrees and one at it parts; then update 1 (a mistake of every
    window parts them there: two runs, not a bisection's), then by bisection."""
    if hint == 1 or hint and 1 < hint <= n and agree(hint - 1) and (hint == n or not agree(hint)):
        return hint
    if n == 1 or not agree(1):
        return 1
    low, high = 1, n  # they agree after `low` updates, part after `high`
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if agree(mid) else (low, mid)
    return high


def apart(et: ScriptRun, eg: ScriptRun) -> int | None:
    """The first window whose samples on N ranks together (their counts, and the sums and sums of squares of their
    inputs, added over the ranks) are not the one rank's; None where every window holds the same."""
    from ..launch.observed import SAME_DATA_WITHIN

    ranks = list(et.rank_traces.values())
    if len(eg.steps) != min((len(r.steps) for r in ranks), default=0):
        return min(len(eg.steps), *(len(r.steps) for r in ranks)) + 1
    for i, one in enumerate(eg.steps):
        windows = [r.steps[i] for r in ranks]
        if sum(sum(w.samples) for w in windows) != sum(one.samples):
            return i + 1
        if one.fingerprint is None or any(w.fingerprint is None for w in windows):
            continue
        summed = [sum(w.fingerprint[j] for w in windows) for j in range(2)]
        if any(abs(x - y) > SAME_DATA_WITHIN * max(abs(x), abs(y), 1e-300) for x, y in zip(summed, one.fingerprint)):
            return i + 1
    return None
