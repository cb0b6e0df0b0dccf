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
    """Measures full windows only: after each micro-batch's backward, a flat copy of the accumulated gradient;
    the increment is its difference from the copy before, and the last copy is the window's gradient. One
    kernel for the copy where a foreach op runs one per tensor: for a sweep's small models on a CPU, a
    measurement costs what it launches more than what it reads (this costs under half of a copy, a subtraction
    and a norm per tensor). The arithmetic waits for `value()`, once per epoch."""

    def __init__(self, params: list[nn.Parameter], b: int, B: int, n_train: int):
        self.params, self.b, self.B, self.N = params, b, B, n_train
        self.previous: torch.Tensor | None = None  # the accumulated gradient after the last micro-batch
        self.small: list[torch.Tensor] = []  # per measured micro-batch, |increment|
        self.big: list[torch.Tensor] = []  # per measured window, |window gradient|
        self.ema = torch.zeros(2, device=params[0].device, dtype=torch.float64)  # |G|^2, tr(S)
        self.weight = 0.0  # for the EMA's bias correction

    def after_micro(self) -> None:
        """After every micro-batch's backward in a measured window."""
        current = torch.cat([(p.grad if p.grad is not None else p.new_zeros(p.shape)).reshape(-1)
                             for p in self.params])
        self.small.append(torch.linalg.vector_norm(current if self.previous is None else current - self.previous))
        self.previous = current

    def step(self) -> None:
        """After the window's last micro-batch."""
        self.big.append(torch.linalg.vector_norm(self.previous))
        self.previous = None

    def _fold(self) -> None:
        """Fold the measured windows into the EMAs, in order."""
        if not self.big:
            return
        b, B = self.b, self.B
        windows = len(self.big)
        big = torch.stack(self.big).double() ** 2
        # A micro-batch's increment is b/B of its own mean gradient.
        small = (torch.stack(self.small).double().view(windows, -1) * (B / b)).pow(2).mean(1)  # mean |G_b|^2
        estimates = torch.stack([(B * big - b * small) / (B - b), (small - big) / (1 / b - 1 / B)], 1)
        age = torch.arange(windows - 1, -1, -1, device=estimates.device, dtype=torch.float64)
        self.ema = self.ema * EMA_DECAY ** windows + (1 - EMA_DECAY) * (EMA_DECAY ** age) @ estimates
        self.weight = self.weight * EMA_DECAY ** windows + 1 - EMA_DECAY ** windows
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
        if not self.weight:
            return None
        measured, s = (self.ema / self.weight).tolist()
        g2, s = measured + s / self.N, s * (self.N - 1) / self.N
        if g2 <= 0:
            return None
        return s / g2, reliable(measured, s, self.N)


def reliable(measured_g2: float, trace: float, n: int) -> bool:
    """The rule: a noise scale is reliable while the measured |G|^2 is at least the finite-set correction
    tr(S)/N, i.e. while the correction at most doubles it. Beyond that, B_simple tends to N whatever the
    gradient is."""
    return measured_g2 >= trace / n
