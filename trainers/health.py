"""Training health: gradient and update statistics per optimizer step, and a verdict per run."""
from __future__ import annotations

import math

import torch
from torch import nn

# Verdict thresholds, in one place.
EXPLODING_UPDATE_RATIO = 1.0  # an epoch whose steps moved the weights by more than their own norm, on average
DEAD_GRAD_FRACTION = 1e-8  # gradient norm collapsed to this fraction of its first-epoch value: nothing learns
# Half the trainable tensors got no gradient in an epoch. (All of them never happens with cross-entropy: the
# output bias keeps a gradient when every ReLU before it has died, as cnn1d at SGD lr 5 shows.)
DEAD_TENSORS = 0.5
CHANCE_MARGIN = 0.05  # accuracy within this of the majority-class share counts as chance
STALLED_LOSS_FALL = 0.01  # the training loss fell by less than 1% from the first epoch to the last ...
# ... or never got below the loss of a uniform guess, ln(classes): falling from a blow-up is not learning.


class StepStats:
    """Window-gradient norm, relative update size and which tensors got a gradient. A sampled step only takes
    per-tensor norms and a copy of the weights (four foreach ops, no synchronization); the rest of the
    arithmetic waits for the epoch's end, a handful of ops over all its sampled steps at once."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.weights = [p.detach() for p in params]
        self.before = [w.clone() for w in self.weights]  # the weights before each step, reused
        self.n = len(params)
        self.zero = torch.zeros((), device=params[0].device, dtype=params[0].dtype) if params else None
        self.ever_got_grad = torch.zeros(self.n, dtype=torch.bool)  # over the whole run
        self.grad_norms: list[torch.Tensor] = []  # per sampled step, n per-tensor gradient norms
        self.moves: list[torch.Tensor] = []  # per sampled step, n norms of the change, then n of the weights

    def before_step(self) -> None:
        """Call with the window's gradient in place, before clipping."""
        grads = [p.grad for p in self.params]
        present = [g for g in grads if g is not None]
        norms = iter(torch._foreach_norm(present) if present else ())
        self.grad_norms += [next(norms) if g is not None else self.zero for g in grads]  # none counts as zero
        torch._foreach_copy_(self.before, self.weights)

    def after_step(self) -> None:
        torch._foreach_sub_(self.before, self.weights)  # now the step's change, old - new
        self.moves += torch._foreach_norm(self.before + self.weights)

    def epoch(self) -> dict[str, float]:
        """The epoch's means over its sampled steps, and the fraction of trainable tensors that got no
        nonzero gradient in any of them."""
        if not self.grad_norms:
            return {}
        grads = torch.stack(self.grad_norms).view(-1, self.n)
        moved, size = torch.linalg.vector_norm(torch.stack(self.moves).view(-1, 2, self.n), dim=2).unbind(1)
        got_grad = (grads > 0).any(0).cpu()
        self.ever_got_grad |= got_grad
        self.grad_norms, self.moves = [], []
        return {"grad_norm": torch.linalg.vector_norm(grads, dim=1).mean().item(),
                "update_ratio": (moved / size.clamp_min(1e-30)).mean().item(),
                "dead_fraction": 1.0 - got_grad.float().mean().item()}


def coverage_warnings(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameters that cannot train: frozen, or trainable but in no optimizer group."""
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    left_out = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in in_optimizer]
    notes = []
    if frozen:
        notes.append(f"{len(frozen)} parameter tensors are frozen (requires_grad=False) and will not change: "
                     f"{', '.join(frozen[:8])}{' ...' if len(frozen) > 8 else ''}")
    if left_out:
        notes.append(f"{len(left_out)} trainable parameter tensors are in no optimizer group and will not change: "
                     f"{', '.join(left_out[:8])}{' ...' if len(left_out) > 8 else ''}")
    return notes


def never_updated(model: nn.Module, stats: StepStats) -> str | None:
    """A warning naming the optimizer's parameters that got no nonzero gradient during the whole run."""
    names = {id(p): n for n, p in model.named_parameters()}
    idle = [names.get(id(p), "?") for p, ok in zip(stats.params, stats.ever_got_grad.tolist()) if not ok]
    if not idle:
        return None
    return (f"{len(idle)} parameter tensors in the optimizer never received a gradient: "
            f"{', '.join(idle[:8])}{' ...' if len(idle) > 8 else ''}")


def verdict(status: str, history: list[dict[str, float]], chance: float | None,
            classes: int | None = None) -> tuple[str, int | None]:
    """(health, first epoch where it showed): ok, diverged, exploding, dead or stalled. `chance` is the
    majority-class accuracy, None for float targets."""
    if status == "diverged":
        return "diverged", int(history[-1]["epoch"])
    for row in history:
        if row.get("update_ratio", 0.0) > EXPLODING_UPDATE_RATIO:
            return "exploding", int(row["epoch"])
    at_chance = chance is not None and not history[-1]["val_acc"] > chance + CHANCE_MARGIN
    first = history[0].get("grad_norm", math.nan)
    for row in history:
        collapsed = row.get("grad_norm", math.nan) < DEAD_GRAD_FRACTION * first or \
            row.get("dead_fraction", 0.0) >= DEAD_TENSORS
        if collapsed and (at_chance or chance is None):
            return "dead", int(row["epoch"])
    last = history[-1]["train_loss"]
    learned = last < (1 - STALLED_LOSS_FALL) * history[0]["train_loss"] and (not classes or last < math.log(classes))
    if at_chance and not learned:
        return "stalled", int(history[0]["epoch"])
    return "ok", None
