"""The gradient noise scale from what accumulation computes anyway (McCandlish et al. 2018).

Every measured optimizer step yields k micro-batch gradients (size b: each micro-batch's increment of
the accumulated gradient, times k) and the window gradient (size B = b*k). From their squared norms,
    |G|^2  ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
    tr(S)  ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)
both smoothed by bias-corrected EMAs, then B_simple = tr(S) / |G|^2. No extra forward or backward.
"""
from __future__ import annotations

import torch
from torch import nn

EMA_DECAY = 0.9  # per measured window: about the last 10 count


class NoiseScale:
    """Measures full windows only. One flat buffer holds the accumulated gradient as of the micro-batch
    before; after each backward it becomes that micro-batch's increment, negated (one foreach subtraction of
    the gradients), its norm is taken, and the gradients are copied back in (one foreach copy). The last copy
    is the window's gradient. So one flat copy of the gradient is held (not a copy per micro-batch beside the
    one before), and a measured micro-batch dispatches three operations whatever the number of tensors. The
    buffer lives within a measured window only: a run's peak can be at its evaluation, and a copy of the
    gradient held there would be a peak that k = 1 does not have. The arithmetic waits for `value()`, once
    per epoch."""

    def __init__(self, params: list[nn.Parameter], b: int, B: int, n_train: int):
        self.params, self.b, self.B, self.N = params, b, B, n_train
        self.dtype = params[0].dtype
        for p in params[1:]:
            self.dtype = torch.promote_types(self.dtype, p.dtype)
        self.sizes = [p.numel() for p in params]
        self.flat: torch.Tensor | None = None  # the measured window's accumulated gradient, within the window
        self.views: list[torch.Tensor] = []  # of `flat`, one per parameter
        self.small: list[torch.Tensor] = []  # per measured micro-batch, |increment|
        self.big: list[torch.Tensor] = []  # per measured window, |window gradient|
        self.ema = torch.zeros(2, device=params[0].device, dtype=torch.float64)  # |G|^2, tr(S)
        self.weight = 0.0  # for the EMA's bias correction

    def after_micro(self) -> None:
        """After every micro-batch's backward in a measured window."""
        first = self.flat is None
        if first:
            self.flat = torch.empty(sum(self.sizes), device=self.params[0].device, dtype=self.dtype)
            self.views = [v.view_as(p) for v, p in zip(self.flat.split(self.sizes), self.params)]
        present = [(v, p.grad) for v, p in zip(self.views, self.params) if p.grad is not None]
        views, grads = [v for v, _ in present], [g for _, g in present]
        if first:  # the first increment is the gradient itself (a tensor without one is zero)
            if len(views) < len(self.views):
                self.flat.zero_()
            if views:
                torch._foreach_copy_(views, grads)
            self.small.append(torch.linalg.vector_norm(self.flat))
            return
        if views:  # (none: no gradient yet in this window, and `flat` is zero)
            torch._foreach_sub_(views, grads)  # the accumulation before minus this one
        self.small.append(torch.linalg.vector_norm(self.flat))
        if views:
            torch._foreach_copy_(views, grads)

    def step(self) -> None:
        """After the window's last micro-batch."""
        self.big.append(torch.linalg.vector_norm(self.flat))
        self.flat, self.views = None, []

    def _fold(self) -> None:
        """Fold the measured windows into the EMAs, in order."""
        if not self.big:
            return
        windows = len(self.big)
        small = torch.stack(self.small).double().view(windows, -1).pow(2).mean(1)
        self.ema, self.weight = fold(self.ema, self.weight, small, torch.stack(self.big).double() ** 2, self.b, self.B)
        self.small, self.big = [], []

    def value(self) -> tuple[float, bool] | None:
        """(B_simple, reliable) from the smoothed estimates, or None while |G|^2 is not measurable (not
        positive yet).

        Windows are drawn without replacement from N samples, which biases the two-batch |G|^2 low by
        tr(S)/(N-1): correct it, or the noise scale late in training comes out several times too large.
        Late in training the measured |G|^2 falls towards that bias: where the correction tr(S)/N is larger
        than what was measured, the estimate says more about N than about a critical batch, and it is
        marked unreliable (see RELIABLE below).
        """
        self._fold()
        return value(self.ema, self.weight, self.N)


def fold(ema: torch.Tensor, weight: float, small: torch.Tensor, big: torch.Tensor, b: int,
         B: int) -> tuple[torch.Tensor, float]:
    """The EMAs of (|G|^2, tr(S)) after the windows given in order: `small`, each window's mean squared
    micro-batch increment, `big`, its squared gradient. An increment is b/B of its micro-batch's mean gradient
    where the loss is the window's mean; under any other common factor c the estimates scale by c^2 alike, and
    B_simple, their ratio, does not change."""
    small = small * (B / b) ** 2  # mean |G_b|^2
    estimates = torch.stack([(B * big - b * small) / (B - b), (small - big) / (1 / b - 1 / B)], 1)
    windows = len(big)
    age = torch.arange(windows - 1, -1, -1, device=estimates.device, dtype=torch.float64)
    ema = ema * EMA_DECAY ** windows + (1 - EMA_DECAY) * (EMA_DECAY ** age) @ estimates
    return ema, weight * EMA_DECAY ** windows + 1 - EMA_DECAY ** windows


def value(ema: torch.Tensor, weight: float, n: int) -> tuple[float, bool] | None:
    """(B_simple, reliable) from the EMAs, corrected for windows drawn without replacement from n samples (see
    NoiseScale.value); None while |G|^2 is not positive."""
    if not weight:
        return None
    measured, s = (ema / weight).tolist()
    g2, s = measured + s / n, s * (n - 1) / n
    if g2 <= 0:
        return None
    return s / g2, reliable(measured, s, n)


def reliable(measured_g2: float, trace: float, n: int) -> bool:
    """The rule: a noise scale is reliable while the measured |G|^2 is at least the finite-set correction
    tr(S)/N, i.e. while the correction at most doubles it. Beyond that, B_simple tends to N whatever the
    gradient is."""
    return measured_g2 >= trace / n
