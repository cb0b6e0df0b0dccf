"""A Lightning script as people write them, swept by batchsweep's [program] (study.toml here).

It logs through Lightning's own MLFlowLogger into the run that batchsweep opened for the trial (the
MLFLOW_TRACKING_URI and MLFLOW_RUN_ID it hands over), so no line of it prints metrics for batchsweep.
A small MLP learns 3 classes of points in 8 dimensions; the training set (1,000) is not a multiple of b*k.

    python train.py --batch-size 16 --accum 2 --lr 0.1 --seed 0 --epochs 3
"""
import argparse
import os

import lightning as L
import torch
from lightning.pytorch.loggers import MLFlowLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def blobs(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 8, generator=g) + 1.5 * nn.functional.one_hot(y, 8).float()
    return TensorDataset(x, y)


class Classifier(L.LightningModule):
    def __init__(self, lr: float):
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 3))

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, _):
        x, y = batch
        out = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(out, y), on_epoch=True)
        self.log("val_acc", (out.argmax(1) == y).float().mean(), on_epoch=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    L.seed_everything(args.seed, verbose=False)
    logger = MLFlowLogger(tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"), run_id=os.environ.get("MLFLOW_RUN_ID"))
    trainer = L.Trainer(max_epochs=args.epochs, accumulate_grad_batches=args.accum, accelerator="cpu", devices=1,
                        logger=logger, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=1, deterministic=True)
    train = DataLoader(blobs(1000, args.seed), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(blobs(600, 10_000), batch_size=600)
    trainer.fit(Classifier(args.lr), train, val)


if __name__ == "__main__":
    main()
