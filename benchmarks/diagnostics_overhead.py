"""Cost of the diagnostics: the trainer with them against the trainer without them.

`--what health` (grad_norm, update_ratio, dead_fraction), `noise` (the gradient noise scale) or `both`.
Same model, data and device in one process, interleaved repeats after a warm-up; prints the median
samples/s ratio (with / without) and, last, `overhead=<1 - ratio>`.

    python benchmarks/diagnostics_overhead.py [--what noise] [--accum-steps 4] [--device cuda]
"""
from __future__ import annotations

import argparse
import statistics

import torch

import trainers.loop as loop
from trainers import TrainConfig, train
from trainers.cli import add_config_flags, config_from_args
from trainers.health import StepStats
from trainers.noise import NoiseScale


class NoStats(StepStats):
    """Takes nothing but |G_B| (which the noise scale needs): the trainer without health statistics."""

    def before_step(self):
        grads = [p.grad for p in self.params if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))

    def after_step(self) -> None:
        pass

    def epoch(self) -> dict[str, float]:
        return {"grad_norm": 1.0, "update_ratio": 1e-3, "dead_fraction": 0.0}


class NoNoise(NoiseScale):
    """Measures nothing."""

    def before_micro(self) -> None:
        pass

    def after_micro(self, first: bool, n_window: int, n: int) -> None:
        pass

    def step(self, window_grad_norm) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--what", choices=("health", "noise", "both"), default="both")
    args = parser.parse_args()
    config = config_from_args(args, TrainConfig(epochs=4, accum_steps=4))
    train(config)  # warm-up
    ratios = []
    off = {"health": {"StepStats": NoStats}, "noise": {"NoiseScale": NoNoise}}
    switched = {**off["health"], **off["noise"]} if args.what == "both" else off[args.what]
    real = {"StepStats": StepStats, "NoiseScale": NoiseScale}
    for _ in range(args.repeats):
        for name, cls in real.items():
            setattr(loop, name, cls)
        with_them = train(config).metrics["samples_per_s"]
        for name, cls in switched.items():
            setattr(loop, name, cls)
        without = train(config).metrics["samples_per_s"]
        ratios.append(with_them / without)
    for name, cls in real.items():
        setattr(loop, name, cls)
    ratio = statistics.median(ratios)
    print(f"what={args.what} model={config.model} b={config.physical_batch} k={config.accum_steps} "
          f"ratios={[round(r, 3) for r in ratios]}")
    print(f"with/without median {ratio:.3f}")
    print(f"overhead={1 - ratio:.3f}")


if __name__ == "__main__":
    main()
