"""Command line of `python trainers/train.py`: flags generated from TrainConfig's fields."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

from . import interrupt
from .config import FIELDS, BatchsweepError, ConfigError, TrainConfig, parse_value


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
    """The given flags on top of `base`; each value is parsed to its field's type. `--physical-batch auto` with
    `--effective-batch B` starts at b = B and shrinks on out-of-memory; `--effective-batch` with a number b sets
    k = B / (b * N). Under torchrun, world_size defaults to the number of processes."""
    from .distributed import launched_ranks

    base = base or TrainConfig()
    auto = getattr(args, "physical_batch", None) == "auto"
    target = getattr(args, "effective_batch", None)
    changes = {}
    for name in FIELDS:
        value = getattr(args, name, None)
        if value is not None and not (auto and name == "physical_batch"):
            changes[name] = value if isinstance(value, bool) else parse_value(name, value)
    if "world_size" not in changes and launched_ranks() > 1:
        changes["world_size"] = launched_ranks()
    if target is None:
        if auto:
            raise ConfigError("--physical-batch auto needs the target: add --effective-batch B (e.g. 256)")
        return dataclasses.replace(base, **changes)
    if not target.strip().isdigit() or int(target) < 1:
        raise ConfigError(f"--effective-batch takes a positive integer, got {target!r}")
    target = int(target)
    if "accum_steps" in changes:
        raise ConfigError("--effective-batch sets accum_steps (B / (b * world_size)): leave out --accum-steps")
    world = changes.get("world_size", base.world_size)
    if auto:
        changes.update(physical_batch=target, accum_steps=1, shrink_on_oom=True)
    else:
        b = changes.get("physical_batch", base.physical_batch)
        if target % (b * world):
            raise ConfigError(f"--effective-batch {target} is not a multiple of physical_batch x world_size "
                              f"({b} x {world}): choose a multiple, or --physical-batch auto")
        changes["accum_steps"] = target // (b * world)
    return dataclasses.replace(base, **changes)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def summary_table(result) -> str:
    from .models import batchnorm_layers

    c, m = result.config, result.metrics
    own = sorted(k for k in m if k.startswith("val_") and k not in ("val_loss", "val_acc"))  # top5, perplexity, yours
    rows = [
        ("status", result.status),
        ("model / dataset", f"{c.model} / {c.dataset}"),
        ("device", result.device_name),
        ("b x k = B", f"{c.physical_batch} x {c.accum_steps} = {c.effective_batch}" if c.world_size == 1 else
         f"{c.physical_batch} x {c.accum_steps} x {c.world_size} processes = {c.effective_batch}"),
        *([("shrunk on out-of-memory", f"b = {m['physical_batch_used']:.0f} after {m['oom_retries']:.0f} "
                                        f"retries")] if m.get("oom_retries") else []),
        *([("gradient all-reduces", f"{m['allreduce_calls']:.0f} in the last epoch, "
                                    f"{format_bytes(m['allreduce_bytes'])}")] if "allreduce_calls" in m else []),
        ("lr", f"{c.lr:.4g} ({c.lr_rule} rule, base {c.base_lr:g} at {c.base_batch})"),
        *([("bn momentum", f"{c.bn_momentum:.4g} ({c.bn_momentum_rule})")] if batchnorm_layers(result.model) else []),
        ("epochs / steps", f"{len(result.history)} / {int(m['steps'])}"),
        ("train loss", f"{m['train_loss']:.4f}"),
        ("val loss", f"{m['val_loss']:.4f}"),
        ("val acc", "n/a" if math.isnan(m["val_acc"]) else f"{m['val_acc']:.2%}"),
        *((f"val {k[4:]}", f"{m[k]:.2%}" if k == "val_top5" else f"{m[k]:.4g}") for k in own),
        ("samples/s", f"{m['samples_per_s']:,.0f}"),
        (f"peak memory ({result.memory_source})", format_bytes(m["peak_memory_bytes"])),
        ("noise scale", f"{m['noise_scale']:.0f}" + (" (unreliable: the finite-set correction dominates)"
                                                      if m.get("noise_scale_reliable") == 0 else "")
         if "noise_scale" in m else
         "n/a (not measured under torchrun)" if c.world_size > 1 else
         "n/a (needs accum_steps >= 2)" if c.accum_steps == 1 else "n/a (not measurable yet)"),
        ("health", result.health + (f" (from epoch {result.health_epoch})" if result.health_epoch else "")),
        *([("resumed", f"after epoch {result.resumed_after} (from its checkpoint)")] if result.resumed_after else []),
        ("time", f"{m['wall_time_s']:.1f} s in its epochs, evaluations included"),  # (not imports nor the data)
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def check_output(flag: str, path: str | None) -> None:
    """An output file can be written where it is named: its folder is made now, and the file opened for appending
    (and removed again where it was not there)."""
    if path is None:
        return
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: its folder cannot be made ({exc.strerror or exc}): name a file in a "
                          f"folder you can write") from None
    if target.is_dir():
        raise ConfigError(f"{flag} {path} is a folder: name a file in a folder you can write")
    try:  # opened as the end will open it: root passes os.access() where the file system refuses the file
        existed = target.exists()
        with open(target, "a"):
            pass
        if not existed:
            target.unlink()
    except OSError as exc:
        raise ConfigError(f"{flag} {path} cannot be written ({exc.strerror or exc}): name a file in a folder you "
                          f"can write") from None


def run_script(main) -> None:
    """Run a benchmark script's `main()`: bad input (a BatchsweepError) is one line and exit status 2."""
    try:
        main()
    except BatchsweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


def epoch_progress(total: int, jsonl: str | None = None):
    """A bar over epochs, and each row appended to `jsonl` when given: returns (callback, close)."""
    from tqdm import tqdm

    # A frame for every epoch (however fast), each with its own metrics: not epoch n - 1 with epoch n's.
    bar = tqdm(total=total, unit="epoch", file=sys.stderr, dynamic_ncols=True, mininterval=0, miniters=1)
    rows = open(jsonl, "a") if jsonl else None

    def on_epoch(row: dict) -> None:
        if rows:
            rows.write(json.dumps(row) + "\n")
            rows.flush()
        if "epoch" not in row:  # an evaluation within the epoch (eval_every_steps)
            return
        bar.set_postfix(loss=f"{row['train_loss']:.3f}", val_acc=f"{row['val_acc']:.3f}", refresh=False)
        bar.update(1)

    def close() -> None:
        bar.leave = bar.n > 0  # a bar that counted no epoch (a run that failed before its first) leaves no line
        bar.close()
        if rows:
            rows.close()

    return on_epoch, close


# Set by the installed `batchsweep` command for itself and the processes it starts, so that each names itself as
# the user started it (`batchsweep train`, not `python trainers/train.py`).
INVOKED = "BATCHSWEEP_COMMAND"


class OneLineParser(argparse.ArgumentParser):
    """A command's parser whose bad input is one line that names the problem and --help, not argparse's usage."""

    def error(self, message: str):
        self.exit(2, f"error: {message}: see {self.prog} --help\n")


def make_parser() -> argparse.ArgumentParser:
    prog = "batchsweep train" if os.environ.get(INVOKED) == "batchsweep" else "python trainers/train.py"
    parser = OneLineParser(prog=prog, description="Train one configuration with exact gradient accumulation.", epilog=
                           "An import path runs code: --model, --dataset and --loss package.module:name import that "
                           "module, which runs with your permissions. Name only code you trust (docs/security.md).")
    add_config_flags(parser)
    parser.add_argument("--effective-batch", metavar="B", help="samples per optimizer step: sets accum_steps, or with "
                        "--physical-batch auto the target that b shrinks under on out-of-memory")
    parser.add_argument("--json", metavar="PATH", help="write the result (config, metrics, history) as JSON")
    parser.add_argument("--epochs-jsonl", metavar="PATH", help="append each epoch's row to PATH as a JSON line, as "
                        "it ends (for whoever follows the run: a study's torchrun launcher)")
    parser.add_argument("--checkpoint-dir", metavar="DIR", help="save the run at the end of its epochs into DIR; "
                        "the same command again resumes after the last finished epoch ('none': no checkpoints)")
    parser.add_argument("--checkpoint-every", type=int, default=1, metavar="N",
                        help="checkpoint every N epochs (0: by time only); the last epoch is always saved")
    parser.add_argument("--checkpoint-minutes", type=float, default=0.0, metavar="M",
                        help="also checkpoint at the end of an epoch once M minutes passed since the last one")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    import torch  # after parsing: --help and bad flags answer before torch is imported

    from .build import preflight
    from .checkpoint import Checkpointing
    from .distributed import check_launch, launched_rank
    from .loop import train

    checkpoint, lead = None, launched_rank() == 0  # under torchrun, rank 0 alone reports
    try:
        config = config_from_args(args)
        check_launch(config)
        for flag, path in (("--json", args.json), ("--epochs-jsonl", args.epochs_jsonl)) if lead else ():
            check_output(flag, path)  # before training: a result that cannot be written would be lost (rank 0 writes)
        # Checked also without a folder: a bad value is a mistake, whether or not checkpoints are on.
        checkpoint = Checkpointing(args.checkpoint_dir or "none", args.checkpoint_every, args.checkpoint_minutes)
        checkpoint = checkpoint if args.checkpoint_dir not in (None, "none") else None  # 'none': off, as for a study
        if checkpoint and checkpoint.path.exists() and lead:
            print(f"resuming from {checkpoint.path}", file=sys.stderr)
        data = preflight(config)  # a device, import path or model that cannot work is said before the bar opens
        on_epoch, close = epoch_progress(config.epochs, args.epochs_jsonl) if lead else (None, lambda: None)
        try:
            result = train(config, on_epoch=on_epoch, checkpoint=checkpoint, data=data)
        finally:
            close()
    except BatchsweepError as exc:
        # Every rank says it: torchrun stops the others as soon as one exits, perhaps before rank 0 has spoken.
        print(f"error: {exc}", file=sys.stderr)
        if args.epochs_jsonl:  # what kind of error, for a launcher that cannot see this process's exit status
            try:
                with open(args.epochs_jsonl, "a") as rows:
                    # The problem without the command-line hint: the launcher chose the flags.
                    message = getattr(exc, "problem", str(exc))
                    rows.write(json.dumps({"error": type(exc).__name__, "message": message}) + "\n")
            except OSError:  # the path itself was the bad input: the line above says so
                pass
        return 2
    except torch.OutOfMemoryError:
        print("error: out of memory: lower --physical-batch, or give --physical-batch auto --effective-batch B to "
              "shrink it on out-of-memory", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        interrupt.handled()
        if lead:
            print("interrupted: " + (f"{checkpoint.path} holds the last finished epoch; run the same command again "
                                     f"to resume" if checkpoint and checkpoint.path.exists() else
                                     "nothing was saved (--checkpoint-dir DIR saves every epoch)"), file=sys.stderr)
        return 130
    if not lead:
        return 0 if result.status == "ok" else 1
    for note in result.warnings:
        print(f"warning: {note}", file=sys.stderr)
    print(summary_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=2)
    return 0 if result.status == "ok" else 1
