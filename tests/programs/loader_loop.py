"""A user's own loop over a DataLoader, on the same model and data as batchsweep's trainer (`mlp` on
tests.factories:blobs1k): what a [program] study's noise scale is checked against.

    python loader_loop.py --batch-size 4 --accum 16 --lr 1e-9 --seed 0 --epochs 6 [--ignore-accum]
"""
import argparse
import json

import torch
from torch.utils.data import DataLoader, TensorDataset

from batchsweep.trainers.data import load_data
from batchsweep.trainers.models import build_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--accum", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--ignore-accum", action="store_true", help="take --accum and step per micro-batch anyway")
    args = p.parse_args()
    k = 1 if args.ignore_accum else args.accum
    torch.set_num_threads(1)
    data = load_data("tests.factories:blobs1k", "", 0)  # as the trainer loads it
    torch.manual_seed(args.seed)
    model = build_model("mlp", data.input_shape, data.num_classes, "batch")
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    loader = DataLoader(TensorDataset(data.x_train, data.y_train), batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(args.seed))
    for epoch in range(1, args.epochs + 1):
        for i, (x, y) in enumerate(loader):
            loss = torch.nn.functional.cross_entropy(model(x), y) / k
            loss.backward()
            if (i + 1) % k == 0 or i + 1 == len(loader):
                opt.step()
                opt.zero_grad()
        with torch.no_grad():
            acc = (model(data.x_test).argmax(1) == data.y_test).float().mean().item()
        print(json.dumps({"epoch": epoch, "val_acc": acc}), flush=True)


if __name__ == "__main__":
    main()
