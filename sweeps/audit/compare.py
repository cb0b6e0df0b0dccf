"""The comparisons of the two runs' weights and gradients: relative differences, and one update (or one window's
gradient) against the other's, with what momentum and weight decay add to both taken out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .runs import BATCHNORM, ScriptRun

if TYPE_CHECKING:
    import torch

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




def weights(state: dict[str, torch.Tensor], matrices_only: bool = False) -> torch.Tensor:
    """The floating-point tensors of a run's weights (the parameters its optimizer trains: ScriptRun.state), as one
    vector; `matrices_only`: the 1-D ones (biases, norms' scales) as zeros."""
    import torch

    parts = [t.detach().double().flatten() * (t.dim() >= 2 or not matrices_only) for key, t in sorted(state.items())
             if t.is_floating_point() and not key.endswith(BATCHNORM)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def rel(a: ScriptRun, t: ScriptRun) -> float:
    """‖a − t‖ / ‖t‖ over the weights."""
    wa, wt = weights(a.state), weights(t.state)
    return float((wa - wt).norm() / wt.norm().clamp_min(1e-300))


def tolerance(state: dict[str, torch.Tensor]) -> tuple[str, float]:
    """The weights' dtype and the relative difference that counts as equal in it."""
    dtype = next((str(t.dtype) for key, t in state.items() if t.is_floating_point() and not key.endswith(BATCHNORM)),
                 "torch.float32").removeprefix("torch.")
    return dtype, EQUAL_WITHIN.get(dtype, 1e-2)


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


def live_batchnorm(a: ScriptRun, t: ScriptRun) -> bool:
    """Whether BatchNorm normalized each run by its own batches: its statistics moved otherwise at (b, k), k
    updates from micro-batches, than at (b*k, 1). A frozen one (eval mode, or FrozenBatchNorm2d, as in
    fine-tuning) normalizes both alike, so a difference beside it (an undivided loss, say) is the loop's."""
    import torch

    return any(key.endswith(BATCHNORM) and key in a.buffers and not torch.equal(value, a.buffers[key])
               for key, value in t.buffers.items())


def buffers_differ(a: ScriptRun, t: ScriptRun, tol: float) -> list[str]:
    """The buffers other than BatchNorm's statistics that the runs left apart (a counter of forwards, spectral norm's
    vectors): they are no weights, so they are reported beside the verdict, not in it."""
    return [key for key, value in t.buffers.items() if value.is_floating_point() and key in a.buffers and
            not key.endswith(BATCHNORM) and float((a.buffers[key].double() - value.double()).norm()) >
            tol * max(float(value.double().norm()), 1e-300)]
