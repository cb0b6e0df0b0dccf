"""Cost of the training-health statistics: the trainer with them against the trainer without them.

Same model, data and device in one process, interleaved repeats after a warm-up; prints the median
samples/s ratio (with / without) and, last, `overhead=<1 - ratio>`.

    python benchmarks/health_overhead.py [--accum-steps 1] [--physical-batch 32] [--device cuda]
"""
from __future__ import annotations

import argparse
import statistics

import trainers.loop as loop
from trainers import TrainConfig, train
from trainers.cli import add_config_flags, config_from_args
from trainers.health import StepStats


class NoStats(StepStats):
    """Takes nothing: what the trainer would cost without health statistics."""

    def before_step(self):
        return None

    def after_step(self) -> None:
        pass

    def epoch(self) -> dict[str, float]:
        return {"grad_norm": 1.0, "update_ratio": 1e-3, "dead_fraction": 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    config = config_from_args(args, TrainConfig(epochs=4, accum_steps=4))
    train(config)  # warm-up
    ratios = []
    for _ in range(args.repeats):
        loop.StepStats = StepStats
        with_stats = train(config).metrics["samples_per_s"]
        loop.StepStats = NoStats
        without = train(config).metrics["samples_per_s"]
        ratios.append(with_stats / without)
    loop.StepStats = StepStats
    ratio = statistics.median(ratios)
    print(f"model={config.model} b={config.physical_batch} k={config.accum_steps} "
          f"ratios={[round(r, 3) for r in ratios]}")
    print(f"with/without median {ratio:.3f}")
    print(f"overhead={1 - ratio:.3f}")


if __name__ == "__main__":
    main()
