"""Lightning's own accumulation, as `batchsweep audit` checks it (docs/audit.md): an MLP trained with
Trainer(accumulate_grad_batches=k) in float64 on 1,000 points, a number that is not a multiple of b*k, so that
each epoch ends with a short window. Plain SGD, so that an update is the gradient it was given.

    batchsweep audit --study examples/audit/lightning.toml --physical-batch 8 --accum-steps 4
"""
import argparse
import json
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    def __init__(self, lr: float):
        super().__init__()
        self.lr, self.window = lr, []
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.window.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):
        # The window's loss as Lightning weighs it, one row per optimizer step, for the audit.
        print(json.dumps({"step": self.trainer.global_step + 1, "loss": sum(self.window) / len(self.window)}),
              flush=True)
        self.window = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--accum", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=0)
    args = p.parse_args()
    L.seed_everything(args.seed, verbose=False)
    g = torch.Generator().manual_seed(1234)
    y = torch.arange(1000) % 3
    x = torch.randn(1000, 8, generator=g, dtype=torch.float64) + nn.functional.one_hot(y, 8)
    train = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True,
                       generator=torch.Generator().manual_seed(args.seed))
    model = Classifier(args.lr)
    trainer = L.Trainer(max_epochs=args.epochs, max_steps=args.max_steps or -1, accumulate_grad_batches=args.accum,
                        accelerator="cpu", devices=1, precision="64-true", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, train)
    torch.save(model.state_dict(), os.environ["BATCHSWEEP_STATE"])


if __name__ == "__main__":
    main()
