"""Command line of `python trainers/train.py`: flags generated from TrainConfig's fields."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from .config import FIELDS, BatchsweepError, TrainConfig, parse_value


def add_config_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per TrainConfig field (`physical_batch` -> `--physical-batch`), type-checked, default None."""
    for name, f in FIELDS.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=f"default {f.default}")
        else:
            parser.add_argument(flag, type=str, default=None, metavar=type(f.default).__name__.upper(),
                                help=f"default {f.default}")


def config_from_args(args: argparse.Namespace, base: TrainConfig | None = None) -> TrainConfig:
    """The given flags on top of `base`; each value is parsed to its field's type."""
    changes = {}
    for name in FIELDS:
        value = getattr(args, name, None)
        if value is not None:
            changes[name] = value if isinstance(value, bool) else parse_value(name, value)
    return dataclasses.replace(base or TrainConfig(), **changes)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def summary_table(result) -> str:
    c, m = result.config, result.metrics
    rows = [
        ("status", result.status),
        ("model / dataset", f"{c.model} / {c.dataset}"),
        ("device", result.device_name),
        ("b x k = B", f"{c.physical_batch} x {c.accum_steps} = {c.effective_batch}"),
        ("lr", f"{c.lr:.4g} ({c.lr_rule} rule, base {c.base_lr:g} at {c.base_batch})"),
        ("bn momentum", f"{c.bn_momentum:.4g} ({c.bn_momentum_rule})"),
        ("epochs / steps", f"{len(result.history)} / {int(m['steps'])}"),
        ("train loss", f"{m['train_loss']:.4f}"),
        ("val loss", f"{m['val_loss']:.4f}"),
        ("val acc", "n/a" if math.isnan(m["val_acc"]) else f"{m['val_acc']:.2%}"),
        ("samples/s", f"{m['samples_per_s']:,.0f}"),
        (f"peak memory ({result.memory_source})", format_bytes(m["peak_memory_bytes"])),
        ("noise scale", f"{m['noise_scale']:.0f}" + (" (unreliable: the finite-set correction dominates)"
                                                      if m.get("noise_scale_reliable") == 0 else "")
         if "noise_scale" in m else
         "n/a (needs accum_steps >= 2)" if c.accum_steps == 1 else "n/a (not measurable yet)"),
        ("health", result.health + (f" (from epoch {result.health_epoch})" if result.health_epoch else "")),
        *([("resumed", f"after epoch {result.resumed_after} (from its checkpoint)")] if result.resumed_after else []),
        ("wall time", f"{m['wall_time_s']:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run_script(main) -> None:
    """Run a benchmark script's `main()`: bad input (a BatchsweepError) is one line and exit status 2."""
    try:
        main()
    except BatchsweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


def epoch_progress(total: int):
    """A bar over epochs: returns (callback, close)."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="epoch", file=sys.stderr, dynamic_ncols=True)

    def on_epoch(row: dict) -> None:
        bar.set_postfix(loss=f"{row['train_loss']:.3f}", val_acc=f"{row['val_acc']:.3f}")
        bar.update(1)

    return on_epoch, bar.close


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainers/train.py", description=
                                     "Train one configuration with exact gradient accumulation.")
    add_config_flags(parser)
    parser.add_argument("--json", metavar="PATH", help="write the result (config, metrics, history) as JSON")
    parser.add_argument("--checkpoint-dir", metavar="DIR", help="save the run at the end of its epochs into DIR; "
                        "the same command again resumes after the last finished epoch")
    parser.add_argument("--checkpoint-every", type=int, default=1, metavar="N",
                        help="checkpoint every N epochs (0: by time only); the last epoch is always saved")
    parser.add_argument("--checkpoint-minutes", type=float, default=0.0, metavar="M",
                        help="also checkpoint at the end of an epoch once M minutes passed since the last one")
    args = parser.parse_args(argv)
    from .checkpoint import Checkpointing
    from .loop import train

    checkpoint = None
    try:
        config = config_from_args(args)
        checkpoint = Checkpointing(args.checkpoint_dir, args.checkpoint_every, args.checkpoint_minutes) \
            if args.checkpoint_dir else None
        if checkpoint and checkpoint.path.exists():
            print(f"resuming from {checkpoint.path}", file=sys.stderr)
        on_epoch, close = epoch_progress(config.epochs)
        try:
            result = train(config, on_epoch=on_epoch, checkpoint=checkpoint)
        finally:
            close()
    except BatchsweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: " + (f"{checkpoint.path} holds the last finished epoch; run the same command again to "
                                 f"resume" if checkpoint and checkpoint.path.exists() else
                                 "nothing was saved (--checkpoint-dir DIR saves every epoch)"), file=sys.stderr)
        return 130
    for note in result.warnings:
        print(f"warning: {note}", file=sys.stderr)
    print(summary_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=2)
    return 0 if result.status == "ok" else 1
