"""The gradient noise scale from what accumulation computes anyway (McCandlish et al. 2018).

Every optimizer step yields k micro-batch gradients (size b: each micro-batch's increment of the
accumulated gradient) and the window gradient (size B = b*k). From their squared norms,
    |G|^2  ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
    tr(S)  ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)
both smoothed by bias-corrected EMAs, then B_simple = tr(S) / |G|^2. No extra forward or backward.
"""
from __future__ import annotations

import torch
from torch import nn

EMA_DECAY = 0.9  # per measured window: about the last 10 count


class NoiseScale:
    def __init__(self, params: list[nn.Parameter], b: int, B: int, n_train: int):
        self.params, self.b, self.B, self.N = params, b, B, n_train
        self.prev = [p.detach().clone() for p in params]  # the accumulated gradient before a micro-batch
        device = params[0].device
        self.small_sq = torch.zeros((), device=device)  # sum of |G_b|^2 over the window's micro-batches
        self.count = 0
        self.ema = torch.zeros(2, device=device, dtype=torch.float64)  # |G|^2, tr(S)
        self.weight = 0.0  # for the EMA's bias correction

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(q) for p, q in zip(self.params, self.prev)]

    def before_micro(self) -> None:
        """Before every micro-batch's backward but the window's first: remember the gradient so far."""
        torch._foreach_copy_(self.prev, self._grads())

    def after_micro(self, first: bool, n_window: int, n: int) -> None:
        """After a micro-batch's backward: its increment is (n / n_window) times its own mean gradient."""
        grads = self._grads()
        increment = grads if first else torch._foreach_sub(grads, self.prev)
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(increment)))
        self.small_sq += (norm * (n_window / n)) ** 2
        self.count += 1

    def step(self, window_grad_norm: torch.Tensor) -> None:
        """After the window: combine its |G_B| with the micro-batches' mean |G_b|^2."""
        b, B = self.b, self.B
        small, big = self.small_sq / self.count, window_grad_norm ** 2
        estimate = torch.stack([(B * big - b * small) / (B - b), (small - big) / (1 / b - 1 / B)])
        self.ema.mul_(EMA_DECAY).add_(estimate.double(), alpha=1 - EMA_DECAY)
        self.weight = self.weight * EMA_DECAY + (1 - EMA_DECAY)
        self.small_sq.zero_()
        self.count = 0

    def value(self) -> float | None:
        """B_simple from the smoothed estimates, or None while |G|^2 is not measurable (not positive yet).

        Windows are drawn without replacement from N samples, which biases the two-batch |G|^2 low by
        tr(S)/(N-1): correct it, or the noise scale late in training comes out several times too large.
        """
        if not self.weight:
            return None
        g2, s = (self.ema / self.weight).tolist()
        g2, s = g2 + s / self.N, s * (self.N - 1) / self.N
        return s / g2 if g2 > 0 else None
