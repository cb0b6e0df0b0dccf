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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchsweep.trainers import FIELDS, BatchsweepError, ConfigError, TrainConfig, check_output, interrupt

from ..launch import observed, program
from ..commands import Parser
from ..stores.urls import check_tracking_uri, scrub

if TYPE_CHECKING:
    import torch

    from ..launch.observed import Step
    from ..stores.mlflow_store import Tracker

# Torch and MLflow (seconds) are imported where they are used, so that --help and bad flags answer at once.

# Relative weight difference that counts as equal: what summing in another order costs in each dtype.
EQUAL_WITHIN = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}
# An update's relative difference |Δa − Δt| / |Δt| that reduced-precision arithmetic makes by itself: the
# catalog's correct loop under bf16 autocast differs by 2e-3; a mean of micro-batch means on its tokens, by 2.5e-2.
LOW_PRECISION_ROUNDING = 1e-2
# |Δa| / |Δt| within this of 1: clip_grad_norm_ cut both updates to its threshold (its eps leaves 1e-6 at norms
# near 1), or Adam's first update, about the LR on every weight, hides the gradient's scale; a mistake of the
# loop beneath either shows only in the direction, or, where there is none, not at all. A small difference of
# another kind leaves the length within 1e-3 (an L2 penalty added to every micro-batch's loss: 8.2e-4).
CLIPPED = 1e-4
# An epoch's last LR below this share of its largest, in a schedule the study's epochs do not stretch: `exact` says
# that the last window was checked at that size (transformers' linear schedule over 13 steps ends at 1/13).
TAIL = 0.1
BUFFERS = ("running_mean", "running_var", "num_batches_tracked")  # BatchNorm's, not weights
REUSED = ("accumulated", "true batch")  # made once, whichever step of the audit asks for them again
# name: (exit status: 0 right, 1 a mistake, 2 cannot be audited; what it means and what to do)
VERDICTS = {
    "exact": (0, "(b, k) equals (b*k, 1) within the tolerance of {dtype}: the accumulation is exact."),
    "zero_grad_per_micro_batch": (1, "zero_grad() runs inside the micro-batch loop, so only the last micro-batch "
                                     "of each window reaches the step: zero the gradients once per window, "
                                     "after step()."),
    "loss_not_divided": (1, "each window's update is k times the true batch's: the micro-batch losses are added "
                            "up undivided. Divide each micro-batch's summed loss by the window's number of items "
                            "(or its mean loss by k). The windows' gradients, before any clipping and before the "
                            "optimizer, say it: Adam's update and clip_grad_norm_ hide the scale, the gradient does "
                            "not."),
    "short_window_divided_by_k": (1, "full windows agree, but the short last window of an epoch is scaled by (its "
                                     "micro-batches)/k: it is divided by k instead of by its own count. Divide "
                                     "by the number of items in each window (Lightning's accumulate_grad_batches, "
                                     "#19987, and Accelerate's accumulate() do this)."),
    "mean_of_micro_batch_means": (1, "windows whose micro-batches hold different numbers of counted items (tokens "
                                     "with padding, or a loss weighted by class, whose mean divides by the "
                                     "micro-batch's sum of weights) differ: the loss is a mean of micro-batch "
                                     "means. Sum the per-item losses and divide by the window's total count of "
                                     "items (its sum of weights). Where every micro-batch counts alike, look for a "
                                     "term that the loss adds once per micro-batch (a router's auxiliary loss, "
                                     "say): a window adds it k times, the true batch once; divide it by k."),
    "step_per_micro_batch": (1, "the optimizer steps once per micro-batch ({steps_accumulated} steps an epoch "
                                "against {steps_true_batch}): step() and zero_grad() belong after the last "
                                "micro-batch of a window."),
    "short_window_skipped": (1, "the accumulated run made {steps_accumulated} optimizer steps an epoch against "
                                "the true batch's {steps_true_batch}: the epoch's last window, shorter than k "
                                "micro-batches, never steps (a step only when (i + 1) % k == 0), so its samples "
                                "are lost, or their gradient is added to the next epoch's first window. Step after "
                                "the epoch's last micro-batch too, dividing by that window's own count of items."),
    "short_window_extra": (1, "the accumulated run made {steps_accumulated} optimizer steps an epoch against the "
                              "true batch's {steps_true_batch}: its micro-batches fill a short last window from "
                              "samples that the true batch drops (a loader with drop_last=True drops fewer samples "
                              "in batches of b than of b*k), so the two cannot agree. Keep the last batch "
                              "(drop_last=False), or drop the short window at (b, k) too."),
    "nothing_accumulated": (2, "an epoch at this --physical-batch is a single micro-batch (the run at (b, 1) made "
                               "one step): the accumulated run's one window held that micro-batch alone, and "
                               "equals the true batch whatever the loop does, so nothing was tested. Audit with a "
                               "--physical-batch of at most 1/k of the training set, so that a window holds k "
                               "micro-batches."),
    "batchnorm": (0, "the model has BatchNorm in training mode, and the first step differs: (b, k) normalizes "
                     "each micro-batch of b, which (b*k, 1) cannot equal, and updates its running statistics k "
                     "times a step. Compare against a ghost-batch twin (BatchNorm over chunks of b), or use "
                     "GroupNorm or LayerNorm where the two must agree."),
    "schedule_per_micro_batch": (1, "the learning-rate schedule does not follow the optimizer steps: at step "
                                    "{lr_step} the accumulated run's LR is {lr_a:.4g} against the true batch's "
                                    "{lr_t:.4g}. It counts micro-batches (a scheduler.step() per micro-batch, or a "
                                    "length of len(loader)): step it once per window, after optimizer.step(), "
                                    "over a length in windows."),
    "lr_differs": (1, "the script sets another learning rate at (b, k) than at (b*k, 1), {lr_a:.4g} against "
                      "{lr_t:.4g} from step {lr_step} on: it scales the LR it is given by k or b itself. Use the LR it "
                      "is given (a study's lr_rule scales it), and the audit compares like with like."),
    "weight_penalty_per_micro_batch": (1, "the accumulated update differs from the true batch's by "
                                          "{weight_penalty_share:.3g} of the {penalized}, a multiple of them: "
                                          "a penalty on the weights in the loss (λ‖w‖²) or a decay of them, "
                                          "applied once per micro-batch, which a window applies k times and the "
                                          "true batch once. Apply it once per window (or divide it by k), or leave "
                                          "it to the optimizer's weight_decay."),
    "update_scaled": (1, "the accumulated update has exactly the true batch's direction but {update_ratio:.7g} "
                         "times its length: the learning rate differs (a schedule stepped per micro-batch? print "
                         "\"lr\" in each row and the audit tells) or the loss is divided by another number than "
                         "the window's count of items."),
    "differs_under_clipping": (1, "the accumulated update has the true batch's length (|Δa| / |Δt| = "
                                  "{update_length_ratio:.7f}) but not its direction (cosine {update_cosine:.4g}): "
                                  "gradient clipping (clip_grad_norm_; transformers' max_grad_norm is 1.0 by "
                                  "default) cut both to its threshold, and what it cut differed. Clipping inside "
                                  "the micro-batch loop does this (each micro-batch's partial sum is cut: clip "
                                  "once per window, after its last backward() and before step()), and so does a "
                                  "mistake in how the loss is divided beneath the clip. Audit with clipping off: "
                                  "exact then, the clip is in the wrong place; otherwise the mistake of the loss "
                                  "is named."),
    "within_rounding": (2, "the runs part at update {first_differing_update} by {update_difference:.2g} of the true "
                           "batch's update: no more than reduced-precision arithmetic makes by itself between two "
                           "batch shapes (autocast to bf16 or fp16, and TF32, which GPUs use for convolutions by "
                           "default, keep about 3 significant digits), so in {dtype} a mistake cannot be told from "
                           "rounding. Audit in float64, or in float32 with autocast off and TF32 off "
                           "(torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False)."),
    "accumulated_step_skipped": (1, "the accumulated run's update {first_differing_update} left every weight as it "
                                    "was, where the true batch's moved them: its step was skipped, as a GradScaler "
                                    "(fp16) skips a step whose gradients overflowed. A correct loop's micro-batches, "
                                    "each a sum over fewer samples than the true batch's, overflow no sooner than it: "
                                    "these gradients were larger than the true batch's, as a loss not divided by k "
                                    "makes them. Audit with the GradScaler off (bf16 autocast, or float32), where the "
                                    "mistake is named."),
    "true_batch_step_skipped": (2, "the true batch's update {first_differing_update} left every weight as it was, "
                                   "where the accumulated run's moved them: a GradScaler (fp16) skips a step whose "
                                   "gradients overflowed, and the true batch's fp16 sums over b*k samples overflow "
                                   "sooner than a micro-batch's over b. That is no mistake of the loop, and the runs "
                                   "part there whatever the loop does: audit with the GradScaler off (bf16 "
                                   "autocast, or float32), or with a lower init_scale."),
    "clip_per_micro_batch": (1, "clip_grad_norm_ runs more than once a window (first at step {clip_step}): it cuts "
                                "each micro-batch's partial sum of the gradient, not the window's. Clip once per "
                                "window, after its last backward() and before step()."),
    "data_differs": (2, "the two runs' window {data_window} did not hold the same samples (their count or the sums "
                        "of their inputs differ), so (b, k) cannot be compared with (b*k, 1) there, whatever the "
                        "loop does; the script repeats itself at (b*k, 1), so this is no unseeded randomness in "
                        "general. Usually it is random draws before training whose number depends on b (an "
                        "evaluation over random batches of b samples, torch.randint(..., (b,))) that move the "
                        "generator the training data are drawn from. Draw the training batches from a generator "
                        "of their own, seeded from {{seed}}, or switch such an evaluation off for the audit."),
    "unexplained": (1, "the runs differ, and the difference matches none of the known mistakes: see the figures."),
    "not_reproducible": (2, "two runs of (b*k, 1) with the same values differ by {repeat_rel_diff:.3g}: the "
                            "script is not deterministic (an unseeded shuffle or augmentation, randomness drawn "
                            "from an unseeded generator, nondeterministic GPU kernels), so no difference between "
                            "(b, k) and (b*k, 1) can be told from it. Seed everything from {{seed}} (or call "
                            "torch.use_deterministic_algorithms(True)) and audit again."),
}


class AuditError(BatchsweepError):
    """A script run of the audit that failed, or a study the audit cannot use."""


@dataclass
class ScriptRun:
    """One run of the script: where it stopped and what it left."""

    name: str
    b: int
    k: int
    max_steps: int
    lr: float
    epochs: int  # the {epochs} it was given: 1, or the study's where its schedule follows them
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)  # the optimizer steps the tracer saw, in order
    folder: Path | None = None  # what the tracer wrote: start.pt, state.pt, grad-<s>.pt

    @property
    def losses(self) -> list[float]:
        """Each step's loss: the sum of its backward() calls' losses (nan where a backward had no scalar)."""
        return [s.loss if s.loss is not None else float("nan") for s in self.steps]

    @property
    def lrs(self) -> list[float]:
        """Each step's LR (of the first param group); none where a group had no "lr"."""
        lrs = [s.lrs[0] if s.lrs else None for s in self.steps]
        return [] if None in lrs else lrs


class Auditor:
    """Runs the script with the study's values, one MLflow run each under the audit's parent run."""

    def __init__(self, study, config: TrainConfig, own: dict[str, Any], tracker: Tracker, parent: str,
                 folder: Path, epochs: int):
        self.study, self.config, self.own, self.tracker, self.parent, self.folder = (
            study, config, own, tracker, parent, folder)
        self.epochs = epochs  # the study's: what a schedule over {epochs} spans in its training
        self.bar = None  # _main's bar over the steps of the run being made (how many runs is not known ahead)
        self.runs: list[ScriptRun] = []

    def run(self, name: str, b: int, k: int, max_steps: int) -> ScriptRun:
        """The script at (b, k), stopped by the tracer after `max_steps` optimizer steps (0: an epoch, or the
        script's own length where its command takes no {epochs}); an accumulated or true-batch run made already
        with the config's epochs is not made again; a "repeat" run is made again on purpose."""
        done = next((r for r in self.runs if name == r.name and name in REUSED and (r.b, r.k) == (b, k) and
                     r.epochs == self.config.epochs and
                     (r.max_steps == max_steps or r.max_steps == 0 and len(r.steps) == max_steps)), None)
        if done:
            return done
        config = dataclasses.replace(self.config, physical_batch=b, accum_steps=k, max_steps=max_steps)
        values = {**config.to_dict(), **self.own}
        record = ScriptRun(name, b, k, max_steps, values["lr"], config.epochs, folder=self.folder / str(len(self.runs)))
        record.folder.mkdir()
        state = record.folder / "own.pt"  # where a script that saves its weights for batchsweep puts them (unread)
        over = f" of {config.epochs} epochs" if config.epochs > 1 else ""
        run_id = self.tracker.start_trial(self.parent, f"{name}: b{b} k{k} steps {max_steps}{over}",
                                          {"physical_batch": b, "accum_steps": k, "max_steps": max_steps,
                                           "epochs": config.epochs, "lr": values["lr"], "seed": config.seed},
                                          {"audit.role": name})
        env = {"BATCHSWEEP_STATE": str(state), **program.handoff(self.tracker.uri, run_id, self.tracker.experiment_id),
               **self.study.program.environment(values)}
        env.update(observed.environment(record.folder, stop=max_steps, save=True, grads=(max_steps or "last",),
                                        losses=True, data=True, pythonpath=env.get("PYTHONPATH")))
        output = program.Output()
        self.started(record)
        try:
            ended = program.run(self.study.program.argv(values), env, self.study.program.cwd, None, output,
                                lambda row: self.read(row))
        finally:
            self.tracker.client.log_text(run_id, scrub(output.text(), self.tracker.uri), "log.txt")
            self.bar.refresh()  # the run's last step, however soon the next run starts
        if ended.code != 0:
            self.tracker.end(run_id, "FAILED")
            raise AuditError(f"the {name} run failed: {scrub(program.failure(ended, output), self.tracker.uri)}")
        trace = observed.read(record.folder)
        if trace is None or not (record.folder / "state.pt").exists():
            self.tracker.end(run_id, "FAILED")
            raise AuditError(f"the {name} run: {observed.UNSEEN}" if trace is None else
                             f"the {name} run: the tracer saw optimizer steps but no module train (a model "
                             f"called in training mode with grad enabled), so it has no weights to compare")
        import torch

        record.steps = trace.steps
        self.bar.n = len(record.steps)  # the rows a script prints (if any) stop one short where the tracer stopped it
        self.bar.refresh()
        record.state = torch.load(record.folder / "state.pt", map_location="cpu", weights_only=True)
        self.tracker.finish(run_id, "FINISHED", metrics={"steps": float(len(record.steps))})
        self.runs.append(record)
        return record

    def started(self, record: ScriptRun) -> None:
        """One frame: the run's number, what it is, at step 0 of its max_steps (of an epoch: a count)."""
        from ..trials.driver import start_trial

        steps = f"to step {record.max_steps}" if record.max_steps else "an epoch"
        start_trial(self.bar, f"run {len(self.runs) + 1}: {record.name} b{record.b} k{record.k}, {steps}",
                    record.max_steps or None)

    def read(self, row: dict[str, float]) -> None:
        """A row the script printed: shown on the bar (what the audit compares comes from the tracer)."""
        from ..trials.driver import end_epoch

        if "loss" in row:
            end_epoch(self.bar, {"loss": f"{row['loss']:.4g}"})

    def start(self) -> ScriptRun:
        """The weights before the first update, as the tracer saved them in the first run (every run starts from
        them: the script is seeded alike, which the repeat run checks)."""
        import torch

        first = self.runs[0]
        return ScriptRun("start", first.b, first.k, 0, first.lr, first.epochs,
                         state=torch.load(first.folder / "start.pt", map_location="cpu", weights_only=True))


def weights(state: dict[str, torch.Tensor], matrices_only: bool = False) -> torch.Tensor:
    """The floating-point tensors of a state dict that are weights (not BatchNorm's statistics), as one vector;
    `matrices_only`: the 1-D ones (biases, norms' scales) as zeros."""
    import torch

    parts = [t.detach().double().flatten() * (t.dim() >= 2 or not matrices_only) for key, t in sorted(state.items())
             if t.is_floating_point() and not key.endswith(BUFFERS)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def rel(a: ScriptRun, t: ScriptRun) -> float:
    """‖a − t‖ / ‖t‖ over the weights."""
    wa, wt = weights(a.state), weights(t.state)
    return float((wa - wt).norm() / wt.norm().clamp_min(1e-300))


@dataclass
class Update:
    """The accumulated update Δa against the true batch's Δt, from the same weights."""

    ratio: float  # along Δt: Δa·Δt / |Δt|²
    cosine: float
    difference: float  # |Δa − Δt| / |Δt|
    length: float  # |Δa| / |Δt|
    magnitudes: float  # coordinate by coordinate, signs aside: ‖|Δa| − |Δt|‖ / |Δt|
    shares: dict[str, float] | None  # what both held besides this step's gradient, taken out
    gradient: bool = False  # of the windows' gradients before any clipping, not of the updates
    difference_vector: torch.Tensor | None = field(default=None, repr=False)  # Δa − Δt (or ga − gt)
    keys: list[str] | None = None  # of a gradient's vector: the parameters both runs had a gradient for, sorted

    def figures(self, of: str = "update") -> dict[str, float]:
        return {f"{of}_ratio": self.ratio, f"{of}_cosine": self.cosine, f"{of}_difference": self.difference,
                f"{of}_length_ratio": self.length, f"{of}_magnitude_difference": self.magnitudes,
                **{f"{name}_share": share for name, share in (self.shares or {}).items()}}

    @property
    def clipped(self) -> bool:
        """Cut to one length, as clip_grad_norm_ cuts both, where the difference is in the sizes of the weights'
        updates. Adam's first update (lr·g / (|g| + eps)) and Lion's every one (lr·sign) are about the LR on
        every weight whatever the gradient: one length too, but what differs is signs (the catalog's zero_grad
        on tokens under Adam: sizes 0.011 of the difference; clipped updates, 0.98 and more)."""
        return not self.gradient and abs(self.length - 1) < CLIPPED and self.magnitudes >= 0.5 * self.difference


def update(base: ScriptRun, a: ScriptRun, t: ScriptRun, prior: ScriptRun | None, tol: float) -> Update:
    """The accumulated update against the true batch's, both from `base`. SGD adds to both the same share of the
    update before (momentum: Δ = μ'·Δprior − lr·(g + wd·w)) and of the weights (weight decay), which hides a
    scaled gradient: with momentum 0.9 a short window's 1/4 read as 0.61 at cosine 0.91. Their difference
    holds neither, so where it is a multiple of this step's gradient, d = (r − 1)(Δt − μ'·Δprior + lr·wd·w)
    fits exactly and gives the shares, which are taken out of both; elsewhere nothing is (shares None).
    Without `prior`, only weight decay's share is fitted. Weight decay is fitted on every weight alike, or
    where that does not fit, apart on the matrices (tensors of two or more dimensions) and on the 1-D
    tensors, which nanoGPT, timm and transformers' Trainer leave undecayed."""
    start, matrices = weights(base.state), weights(base.state, matrices_only=True)
    da, dt = weights(a.state) - start, weights(t.state) - start
    momentum = {"momentum": start - weights(prior.state)} if prior is not None else {}
    for decay in ({"weight_decay": start}, {"weight_decay_2d": matrices, "weight_decay_1d": start - matrices}):
        held = {name: v for name, v in {**decay, **momentum}.items() if v.any()}
        shares = _shares(da - dt, dt, held, tol)
        if shares is not None:
            break
    for name, share in (shares or {}).items():
        da, dt = da - share * held[name], dt - share * held[name]
    return measure(da, dt, shares)


def measure(da: torch.Tensor, dt: torch.Tensor, shares: dict[str, float] | None,
            keys: list[str] | None = None) -> Update:
    length = dt.norm().clamp_min(1e-300)
    return Update(ratio=float(da @ dt / length ** 2), cosine=float(da @ dt / (da.norm() * length).clamp_min(1e-300)),
                  difference=float((da - dt).norm() / length), length=float(da.norm() / length),
                  magnitudes=float((da.abs() - dt.abs()).norm() / length), shares=shares,
                  gradient=keys is not None, difference_vector=da - dt, keys=keys)


def gradients(a: ScriptRun, t: ScriptRun, u: int) -> Update | None:
    """The accumulated window's gradient against the true batch's at update u, as the tracer saved them before
    any clipping and before the optimizer: None where a run has none (a step a GradScaler skipped)."""
    import torch

    paths = [run.folder / f"grad-{u}.pt" for run in (a, t)]
    if not all(p.exists() for p in paths):
        return None
    ga, gt = (torch.load(p, map_location="cpu", weights_only=True) for p in paths)
    keys = sorted(set(ga) & set(gt))
    if not keys:
        return None
    va, vt = (torch.cat([g[key].double().flatten() for key in keys]) for g in (ga, gt))
    return measure(va, vt, None, keys) if vt.any() else None


def weight_penalty(base: ScriptRun, measured: Update) -> dict[str, Any] | None:
    """Where Δa − Δt is a multiple of the weights (of every weight, or of the matrices only, as nanoGPT decays
    them), to 1e-6 of its square: the share, and of what. A penalty in every micro-batch's loss leaves this
    difference, (k − 1) times its gradient; a mistake of the data's gradient does not. Gradients are of the
    parameters in `measured.keys` alone, the weights taken in the same order."""
    d, state = measured.difference_vector, base.state
    if measured.keys is not None:
        if not set(measured.keys) <= set(state):
            return None
        state = {key: state[key] for key in measured.keys}
    for penalized, w in (("weights", weights(state)), ("matrices", weights(state, matrices_only=True))):
        share = float(d @ w / (w @ w).clamp_min(1e-300))
        if w.any() and float((d - share * w).norm() ** 2 / (d @ d).clamp_min(1e-300)) < 1e-6:
            return {"weight_penalty_share": share, "penalized": penalized}
    return None


def _shares(d: torch.Tensor, dt: torch.Tensor, held: dict[str, torch.Tensor],
            tol: float) -> dict[str, float] | None:
    """Each s where d = α·(dt − Σ s·held) holds to 1e-6 of |d|², that moves dt by more than the dtype's
    tolerance of it (plain SGD's fit gives 1e-6 in float32, 1e-15 in float64: rounding); None where d is not
    such a multiple."""
    import torch

    basis = torch.stack([dt, *held.values()], dim=1)
    coef = torch.linalg.lstsq(basis, d[:, None]).solution[:, 0]
    misfit = float((basis @ coef - d).norm() ** 2 / (d @ d).clamp_min(1e-300))
    alpha = float(coef[0])
    if misfit >= 1e-6 or abs(alpha) <= 1e-6:
        return None
    shares = {name: -float(c) / alpha for name, c in zip(held, coef[1:])}
    return {name: s for name, s in shares.items() if abs(s) * float(held[name].norm()) > tol * float(dt.norm())}


def classify(ratio: float, cos: float, k: int, first: bool, last: bool, clipped: bool = False) -> str:
    """The mistake whose signature one differing update has. zero_grad per micro-batch and an undivided loss
    change every window, so they part the runs at the first update: a later update is neither. `clipped`: both
    updates were cut to one length (Update.clipped). A turned update at the epoch's last update only is not named
    a mean of micro-batch means: Adam turns a short window divided by k so too (ratio 0.98, cosine 0.996)."""
    if first and cos > 0.999 and abs(ratio / k - 1) < 0.02:
        return "loss_not_divided"
    if last and cos > 0.99 and ratio < 0.98 and 1 <= round(ratio * k) < k and abs(ratio * k - round(ratio * k)) < 0.1:
        return "short_window_divided_by_k"
    if cos > 1 - 1e-6:  # the same gradient, scaled: a mean of means would also turn it
        return "update_scaled"
    if clipped:  # and turned
        return "differs_under_clipping"
    # (At the last update alone a short window under Adam turns so too: `unexplained`, whose sentence says where.)
    if cos > 0.98 and 0.5 < ratio < 2 and (first or not last):
        return "mean_of_micro_batch_means"
    if first and ratio < 0.75 and cos < 0.999:
        return "zero_grad_per_micro_batch"
    return "unexplained"


@dataclass
class Finding:
    verdicts: list[str]  # every fault found, in the order met (or the one verdict of a loop without any)
    figures: dict[str, Any]
    compared: list[tuple[str, float]]  # (what, relative weight difference)

    @property
    def verdict(self) -> str:
        return self.verdicts[0]

    @property
    def status(self) -> int:
        """The worst of the verdicts' exit statuses: 2 (cannot be audited) over 1 (a mistake) over 0."""
        return max(VERDICTS[v][0] for v in self.verdicts)


def tolerance(state: dict[str, torch.Tensor]) -> tuple[str, float]:
    """The weights' dtype and the relative difference that counts as equal in it."""
    dtype = next((str(t.dtype) for key, t in state.items() if t.is_floating_point() and not key.endswith(BUFFERS)),
                 "torch.float32").removeprefix("torch.")
    return dtype, EQUAL_WITHIN.get(dtype, 1e-2)


def audit(auditor: Auditor, b: int, k: int, steps: int) -> Finding:
    """The runs and the diagnosis; see the module's docstring. What the tracer saw comes first: the loop's calls
    (zero_grad, step, scheduler, clip within a window), the step counts, the samples of each window and the LRs;
    then the weights and each window's gradient. Every fault found is a verdict, in the order met."""
    B = b * k
    ea, et = auditor.run("accumulated", b, k, steps), auditor.run("true batch", B, 1, steps)
    dtype, tol = tolerance(et.state)
    na, nt = len(ea.steps), len(et.steps)
    counts = f"{nt}" if na == nt else f"{na} and {nt}"
    compared = [(f"after {counts} step{'' if counts == '1' else 's'}", rel(ea, et))]
    figures = {"dtype": dtype, "tolerance": tol, "steps_accumulated": na, "steps_true_batch": nt}
    seen = seen_in_loop(ea, et, k, figures)
    if "step_per_micro_batch" in seen or (na != nt and abs(na - nt) != 1):  # windows that do not line up
        return Finding(seen or ["unexplained"], figures, compared)
    if na != nt:  # (an update past the shorter run's last compared with none would read as a mistake in it)
        seen.append({-1: "short_window_skipped", 1: "short_window_extra"}[na - nt])
    parted = data_parting(ea, et)
    if parted:
        figures["data_window"] = parted
        again = auditor.run("repeat", B, 1, steps)
        verdict = "data_differs" if not data_parting(again, et) else "not_reproducible"
        if verdict == "not_reproducible":
            figures["repeat_rel_diff"] = rel(again, et)
        return Finding([*seen, verdict], figures, compared)
    lr_step = lr_parting(ea, et)
    if lr_step and na == nt:  # a constant factor is the script's own scaling; one that changes, a schedule out of step
        figures.update(lr_step=lr_step, lr_a=ea.lrs[lr_step - 1], lr_t=et.lrs[lr_step - 1])
        factors = {round(x / y, 9) for x, y in zip(ea.lrs, et.lrs) if y}
        scaled = "lr_differs" if len(factors) == 1 else "schedule_per_micro_batch"
        return Finding(list(dict.fromkeys([*seen, scaled])), figures, compared)
    if any(v not in SHORT_WINDOW for v in seen):  # a call in every window: what the weights show is its doing
        return Finding(seen, figures, compared)
    if na != nt:
        return Finding([*seen, *common_windows(auditor, ea, et, b, k, lr_step, tol, dtype, figures, compared)],
                       figures, compared)
    if compared[0][1] <= tol:
        # An epoch of one window may be one micro-batch (b at least the training set): nothing accumulated.
        if steps == 0 and nt == 1 and len(auditor.run("per micro-batch", b, 1, 0).steps) == 1:
            return Finding(["nothing_accumulated"], figures, compared)
        hidden = norm_parting(ea, et, dtype)
        if hidden:  # equal weights from gradients that differ: a clip, or Adam, hid it
            return Finding([by_gradient(auditor, b, k, hidden, et, tol, figures)], figures, compared)
        stretched = stretch(auditor, ea, et, tol, figures, compared)
        if stretched is None:
            return Finding(["exact"], figures, compared)
        ea, et = stretched  # they part within the study's schedule: the audit goes on in it
    return Finding([*seen, *weighed(auditor, ea, et, b, k, tol, dtype, figures, compared)], figures, compared)


SHORT_WINDOW = ("short_window_skipped", "short_window_extra")  # faults of the last window alone


def common_windows(auditor: Auditor, ea: ScriptRun, et: ScriptRun, b: int, k: int, lr_step: int | None, tol: float,
                   dtype: str, figures: dict[str, Any], compared: list) -> list[str]:
    """A fault besides a short window's, in the full windows both runs stepped. A schedule over the run's own number
    of steps parts the LRs where the counts differ (transformers before 4.46: 12 steps against 13): weights are
    compared only up to the step before the LRs part, and gradients up to that step, whose weights agreed."""
    n = min(len(ea.steps), len(et.steps))
    comparable = min(n, lr_step) if lr_step else n  # gradients: of weights made at the same LRs
    if lr_step:
        figures["lr_step"] = lr_step
        n = min(n, lr_step - 1)
    if n >= 1:
        a, t = auditor.run("accumulated", b, k, n), auditor.run("true batch", b * k, 1, n)
        compared.append((f"after the {n} step{'s' * (n != 1)} both made" + (" at the same LRs" if lr_step else ""),
                         rel(a, t)))
        if compared[-1][1] > tol:
            return weighed(auditor, a, t, b, k, tol, dtype, figures, compared)
    hidden = norm_parting(ea, et, dtype, comparable)
    return [by_gradient(auditor, b, k, hidden, et, tol, figures)] if hidden else []


def seen_in_loop(a: ScriptRun, t: ScriptRun, k: int, figures: dict[str, Any]) -> list[str]:
    """The faults the tracer saw in the accumulated run's calls, whatever the weights say: a zero_grad between
    two backward calls of a window, a step per micro-batch, a scheduler stepped or a gradient clipped more than
    once a window."""
    faults = []
    if any(s.optimizers > 1 for s in a.steps):  # (a GAN's: another optimizer's calls fall within these windows)
        return ["step_per_micro_batch"] if len(a.steps) >= 1.5 * len(t.steps) else []
    zeroed = next((s.step for s in a.steps if s.zero_grad_within()), None)
    if zeroed:
        figures["zero_grad_step"] = zeroed
        faults.append("zero_grad_per_micro_batch")
    if len(a.steps) >= 1.5 * len(t.steps):
        faults.append("step_per_micro_batch")
    scheduled = next((s for s in a.steps if s.events.count("L") > 1), None)
    if scheduled and "step_per_micro_batch" not in faults:
        figures.setdefault("lr_step", scheduled.step)
        figures.setdefault("lr_a", scheduled.lrs[0] if scheduled.lrs else float("nan"))
        figures.setdefault("lr_t", t.steps[min(scheduled.step, len(t.steps)) - 1].lrs[0] if t.steps[0].lrs else
                           float("nan"))
        faults.append("schedule_per_micro_batch")
    clipped = next((s.step for s in a.steps if s.events.count("C") > 1), None)
    if clipped and "step_per_micro_batch" not in faults:
        figures["clip_step"] = clipped
        faults.append("clip_per_micro_batch")
    return faults


def norm_parting(a: ScriptRun, t: ScriptRun, dtype: str, upto: int | None = None) -> int | None:
    """The first step whose window gradients, before any clipping, differ in norm between runs whose weights
    agree: clip_grad_norm_ cuts both to one length, and Adam's update hides a gradient's scale, so the weights
    alone would read exact. Below float64, weights that agree within the tolerance (1e-5 in float32) may give
    gradients a little further apart at a later step, so only a difference beyond what rounding makes between
    two batch shapes counts (the mistakes this finds differ by factors: 4, 2/3)."""
    within = 1e-6 if dtype == "float64" else LOW_PRECISION_ROUNDING
    return next((s.step for s, u in zip(a.steps, t.steps) if s.grad_norm is not None and u.grad_norm is not None
                 and abs(s.grad_norm - u.grad_norm) > within * abs(u.grad_norm) and s.step <= (upto or s.step)), None)


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


def data_parting(a: ScriptRun, t: ScriptRun) -> int | None:
    """The first window (step) whose samples differ between the runs, over the steps both made; None where none."""
    return next((s.step for s, u in zip(a.steps, t.steps) if not observed.same_data(s, u)), None)


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
    return [_named(auditor, measured, (base, a, t), et, u, k, tol, figures)]


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

    def named(first: bool) -> str:
        return classify(measured.ratio, measured.cosine, k, first=first, last=u == len(et.losses),
                        clipped=measured.clipped)

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


def live_batchnorm(a: ScriptRun, t: ScriptRun) -> bool:
    """Whether BatchNorm normalized each run by its own batches: its statistics moved otherwise at (b, k), k
    updates from micro-batches, than at (b*k, 1). A frozen one (eval mode, or FrozenBatchNorm2d, as in
    fine-tuning) normalizes both alike, so a difference beside it (an undivided loss, say) is the loop's."""
    import torch

    return any(key.endswith(BUFFERS) and not torch.equal(value, a.state[key]) for key, value in t.state.items())


def lr_parting(a: ScriptRun, t: ScriptRun) -> int | None:
    """The first step at which the LRs that both runs printed differ; None where they agree or were not printed."""
    if not a.lrs or len(a.lrs) != len(a.losses) or len(t.lrs) != len(t.losses):
        return None
    return next((step for step, (x, y) in enumerate(zip(a.lrs, t.lrs), 1)
                 if abs(x - y) > 1e-9 * max(abs(x), abs(y))), None)


def repeats(auditor: Auditor, t: ScriptRun, tol: float, figures: dict[str, Any], compared: list) -> bool:
    """Whether a second run of the true batch `t` gives its weights again (recorded in the comparisons): a script
    that differs from itself would pass any difference off as a mistake (an unseeded shuffle reads almost as
    zero_grad: r 0.78)."""
    again = rel(auditor.run("repeat", t.b, t.k, t.max_steps), t)
    figures["repeat_rel_diff"] = again
    n = len(t.losses)
    compared.append((f"between two true-batch runs of {n} step{'' if n == 1 else 's'}", again))
    return again <= tol


def rows_part(a: ScriptRun, t: ScriptRun, tol: float) -> int | None:
    """The first step whose loss rows differ; None where they agree throughout."""
    return next((step for step, (x, y) in enumerate(zip(a.losses, t.losses), 1)
                 if abs(x - y) > tol * max(abs(x), abs(y))), None)


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


def _sentence(verdict: str, figures: dict[str, Any]) -> str:
    """The verdict's sentence; for an unexplained difference at the epoch's last update only, where to look; for
    a scaled update of the true batch's length, or an unexplained one in the signs of its steps, what hides the
    scale. Where the windows' gradients were compared, the figures it cites are theirs."""
    f = dict(figures)
    gradient = "gradient_ratio" in f and verdict in GRADIENT_FIGURES
    if gradient:
        f.update({key: f[key.replace("update", "gradient")] for key in GRADIENT_FIGURES[verdict]})
    sentence = VERDICTS[verdict][1].format(**f)
    if gradient:
        sentence = sentence.replace("update", "gradient (before clipping)", 1)
    finding = Finding([verdict], f, [])
    if finding.verdict == "unexplained" and 1 < f.get("first_differing_update", 0) == f["steps_true_batch"]:
        sentence += (" Only the epoch's last update differs: look at its last window, the short one where the "
                     "epoch's micro-batches are not a multiple of k. Adam, and SGD with Nesterov's momentum, hide how "
                     "it was scaled: audit with SGD without Nesterov (its momentum and weight decay are taken out) "
                     "to have it named. Where the training set is not a multiple of b, that window also ends in a "
                     "short micro-batch, which a mean of micro-batch means (each one's mean loss over k, or over the "
                     "window's micro-batches) weights as a full one: that turns the update, under SGD too.")
    sizes = f["update_magnitude_difference"] / f["update_difference"] if "update_difference" in f else 1.0
    if finding.verdict == "unexplained" and sizes < 0.5:  # sign-like updates
        sentence += (f" The updates differ in the signs of the weights' steps more than in their sizes ({sizes:.2g} "
                     "of the difference): Adam's first update is about the LR on every weight whatever the gradient "
                     "(Lion's every update is), which hides the scale that names a mistake: audit with SGD to have "
                     "it named.")
    if finding.verdict == "exact" and f.get("last_lr_share", 1.0) < TAIL:
        sentence += (f" The epoch's last update ran at {f['last_lr_share']:.2g} of its largest LR, and the schedule "
                     "does not follow {epochs} (it decays per step, or over {max_steps}, as transformers' Trainer "
                     "builds it): a mistake of the epoch's last window moves the weights that much less there. "
                     "Audit with a constant LR (transformers: lr_scheduler_type=\"constant\") to check that window "
                     "at full size.")
    if finding.verdict == "update_scaled" and abs(f["update_ratio"] - 1) < CLIPPED and not gradient:
        sentence += (f" Both updates have the same length to within {abs(f['update_ratio'] - 1):.2g}: gradient "
                     "clipping (clip_grad_norm_; transformers' max_grad_norm is 1.0 by default) cuts both to its "
                     "threshold, and Adam's first update is about the LR on every weight whatever the gradient "
                     "(Lion's every update is), which hides how the loss was divided: audit with clipping off and "
                     "with SGD to have the mistake named.")
    return sentence


# The verdicts whose sentence cites the figures of the compared updates: the gradients' where they were compared.
GRADIENT_FIGURES = {"update_scaled": ("update_ratio",), "weight_penalty_per_micro_batch": (),
                    "differs_under_clipping": ("update_length_ratio", "update_cosine")}

# weight decay's shares in the figures: (of what, where it was on one kind of tensor only: what else)
DECAYED = {"weight_decay_share": ("weights", ""),
           "weight_decay_2d_share": ("matrices", "; none measurable on the 1-D tensors"),
           "weight_decay_1d_share": ("1-D tensors", "; none measurable on the matrices")}


def _taken_out(f: dict[str, Any]) -> str:
    parts = [f"{f['momentum_share']:.3g} of the update before (momentum)"] if "momentum_share" in f else []
    decayed = [key for key in DECAYED if key in f]
    if decayed:
        alone = DECAYED[decayed[0]][1] if len(decayed) == 1 else ""
        parts.append(f"{' and '.join(f'{-f[key]:.3g} of the {DECAYED[key][0]}' for key in decayed)} "
                     f"(weight decay{alone})")
    return f", once what both updates hold besides this step's gradient is taken out: {' and '.join(parts)}" \
        if parts else ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser("audit", description="Run your training script (the [program] of a study file) at (b, k) and at "
               "(b*k, 1) from the same start, and name every accumulation mistake that separates them. Exit status, "
               "the worst of the verdicts': 0 exact or batchnorm, 1 a mistake, 2 bad input, a script that differs from "
               "itself, windows that hold other samples, a difference within rounding, a step that a GradScaler "
               "skipped in the true batch alone, or a micro-batch that holds the whole epoch.",
               epilog="The script's command passes {physical_batch} and {accum_steps} on (and {seed}); batchsweep "
               "observes the script from inside its processes, with no edit to it (docs/audit.md).")
    p.add_argument("--study", required=True, help="a study file with a [program]")
    p.add_argument("--physical-batch", type=int, required=True, help="b: the micro-batch")
    p.add_argument("--accum-steps", type=int, required=True, help="k: micro-batches per step (at least 2)")
    p.add_argument("--steps", type=int, default=0, help="compare the first N optimizer steps (default: one epoch)")
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
    if args.physical_batch < 1 or args.accum_steps < 2 or args.steps < 0:
        raise ConfigError("--physical-batch must be at least 1, --accum-steps at least 2 and --steps at least 0")
    check_output("--json", args.json)  # before any run: a verdict that cannot be written would be lost
    point = {**study.fixed, **{f: v[0] for key, v in study.grid.items() for f, v in [(key, v)] if "+" not in key}}
    fields = {k: v for k, v in point.items() if k in FIELDS and k not in ("physical_batch", "accum_steps")}
    config = TrainConfig(**{**fields, "lr_rule": "none"})
    own = {k: v for k, v in point.items() if k not in FIELDS}
    tracker = Tracker(check_tracking_uri(args.tracking_uri or default_tracking_uri()), f"{study.name}-audit")
    tracker.close_orphans()  # the runs an earlier audit of this study left RUNNING when it was killed
    parent = tracker.start_parent(f"audit b{args.physical_batch} k{args.accum_steps}",
                                  {"physical_batch": args.physical_batch, "accum_steps": args.accum_steps,
                                   "steps": args.steps, **own}, {"study_file": study.source})
    # A command without {epochs} trains as long as the script does (or --steps): there is no epoch to stretch.
    epochs = config.epochs if "epochs" in study.program.placeholders() else 1
    return Auditor(study, dataclasses.replace(config, epochs=1), own, tracker, parent, folder, epochs)


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
    sentences = [_sentence(v, f) for v in finding.verdicts]
    print(format_table(["run", "b", "k", "epochs", "max steps", "steps run"],
                       [[r.name, str(r.b), str(r.k), str(r.epochs), str(r.max_steps) if r.max_steps else "epoch",
                         str(len(r.losses))] for r in auditor.runs]))
    print()
    for what, diff in finding.compared:
        print(f"relative weight difference {what}: {diff:.3g} (equal within {f['tolerance']:g}, {f['dtype']})")
    if "first_differing_update" in f:
        print(f"first update where they part: {f['first_differing_update']} of {f['steps_true_batch']}" + (
            f"; the accumulated update is {f['update_ratio']:.4g} x the true batch's along it, at cosine "
            f"{f['update_cosine']:.4f}, and differs from it by {f['update_difference']:.3g} of its length"
            f"{_taken_out(f)}" if "update_ratio" in f else ""))
    if "gradient_ratio" in f:
        print(f"the windows' gradients there, before any clipping: the accumulated one is {f['gradient_ratio']:.4g} x "
              f"the true batch's along it, at cosine {f['gradient_cosine']:.4f}")
    for verdict, sentence in zip(finding.verdicts, sentences):
        print(f"verdict: {verdict}")
        print(sentence[0].upper() + sentence[1:])
    auditor.tracker.describe(auditor.parent,
                             " ".join(f"verdict: {v}. {s}" for v, s in zip(finding.verdicts, sentences)))
    auditor.tracker.finish(auditor.parent, "FINISHED", metrics={k: v for k, v in f.items()
                                                                 if isinstance(v, (int, float))},
                           tags={"verdict": finding.verdict, "verdicts": ",".join(finding.verdicts)})
    if args.json:
        Path(args.json).write_text(json.dumps({"verdict": finding.verdict, "verdicts": finding.verdicts,
                                               "sentence": sentences[0], "sentences": sentences, **f,
                                               "runs": len(auditor.runs), "compared": dict(finding.compared)},
                                              indent=2) + "\n")
    return finding.status
