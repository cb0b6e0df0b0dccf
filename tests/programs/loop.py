"""A user's own training script, as batchsweep's [program] tests run it: a plain PyTorch loop with gradient
accumulation that prints its metrics as JSON lines (or logs them through MLflow with --mlflow).

    python loop.py --batch-size 16 --accum 2 --lr 0.1 --seed 0 --epochs 3

For the outcome tests: --mode fail | oom | mlflow (logs through MLflow instead of printing), --handicap X
(subtracted from the accuracy it reports, so that a pruner has a trial to stop), and --hold FILE (after
epoch 1, unless FILE exists: start a child, write "PID CHILD_PID" to FILE + ".held" and sleep, so that a test
can kill the sweep while this trial runs and check that the script's process group is gone). Only the first
script to get there holds: under several workers a second one's child would outlive the test that kills the
first's.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch
from torch import nn


def first_to_hold(hold: str) -> bool:
    """Whether this script is the first to claim the hold (an exclusive create: one winner, whatever the timing)."""
    try:
        os.close(os.open(hold + ".claimed", os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def data(seed: int, n: int):
    """Points around one centre per class: 3 classes, 8 features."""
    g = torch.Generator().manual_seed(1000 + seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 8, generator=g) + 1.5 * torch.nn.functional.one_hot(y, 8).float()
    return x, y


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--accum", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--handicap", type=float, default=0.0)
    p.add_argument("--mode", default="ok", choices=["ok", "fail", "oom", "mlflow"])
    p.add_argument("--hold", default="")
    p.add_argument("--note", default="", help="printed to stderr as it is")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    if args.note:
        print(f"note: {args.note}", file=sys.stderr, flush=True)
    if args.mode == "fail":
        print("loading the data failed: no such file train.bin", file=sys.stderr)
        return 1
    if args.mode == "oom":  # as PyTorch raises it on a GPU that is full
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    x, y = data(args.seed, 480)
    vx, vy = data(args.seed + 100, 240)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    window = args.batch_size * args.accum
    run = None
    if args.mode == "mlflow":
        import mlflow

        run = mlflow.start_run()  # MLFLOW_RUN_ID from batchsweep: the trial's own run
    step = 0
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(x))
        for start in range(0, len(x), window):
            idx = order[start:start + window]
            opt.zero_grad()
            total = 0.0
            for micro in idx.split(args.batch_size):
                loss = nn.functional.cross_entropy(model(x[micro]), y[micro], reduction="sum") / len(idx)
                loss.backward()
                total += loss.item()
            opt.step()
            step += 1
            log(run, {"step": step, "loss": total, "lr": opt.param_groups[0]["lr"]})  # "lr": also a param's name
        with torch.no_grad():
            out = model(vx)
            acc = (out.argmax(1) == vy).float().mean().item() - args.handicap
            val_loss = nn.functional.cross_entropy(out, vy).item()
        row = {"epoch": epoch, "val_acc": acc, "val_loss": val_loss}
        if run is None:
            row["recall@1"] = acc  # a name as retrieval writes it, which MLflow refuses: logged as recall_1
        log(run, row)
        if args.hold and epoch == 1 and not os.path.exists(args.hold) and first_to_hold(args.hold):
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
            with open(args.hold + ".tmp", "w") as f:
                f.write(f"{os.getpid()} {child.pid}")
            os.replace(args.hold + ".tmp", args.hold + ".held")
            time.sleep(3600)
    if run is not None:
        import mlflow

        mlflow.end_run()
    print("done", os.getpid())
    return 0


def log(run, row: dict) -> None:
    if run is None:
        print(json.dumps(row), flush=True)
        return
    import mlflow

    at = row.pop("epoch", None) or row.pop("step")
    mlflow.log_metrics(row, step=int(at))


if __name__ == "__main__":
    sys.exit(main())
