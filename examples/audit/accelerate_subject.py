"""Accelerate's accumulation, as `batchsweep audit` checks it (docs/audit.md): a small GPT-2 built from a config
(random weights, no download, no dropout) in float64 with plain SGD and a linear decay of the learning rate,
on sequences of 4 to 16 tokens padded per batch (labels -100 on the padding), so that micro-batches hold
different numbers of tokens. Two loops, chosen by --loss:

- `mean`: the loop of Accelerate's guide, `with accelerator.accumulate(model):` around the model's own loss
  (each micro-batch's mean over its tokens), which `accelerator.backward` divides by k;
- `window`: the guide's loop for samples of variable size: each window's micro-batches taken together,
  their summed token loss divided by the window's count of tokens (times k, which `backward` divides away).

With --same-length every sequence has 10 tokens, so that micro-batches hold equal counts.

    batchsweep audit --study examples/audit/accelerate.toml --physical-batch 4 --accum-steps 4
    batchsweep audit --study examples/audit/accelerate_window.toml --physical-batch 4 --accum-steps 4
"""
import argparse
import json
import os

import torch
from accelerate import Accelerator
from torch.nn.functional import cross_entropy
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

VOCAB = 32


def sequences(n: int, same_length: bool) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, 17, (1,), generator=g))
        length = 10 if same_length else length
        start = int(torch.randint(1, VOCAB, (1,), generator=g))
        rows.append([(start + 3 * i) % (VOCAB - 1) + 1 for i in range(length)])  # a rule worth learning
    return rows


def collate(rows: list[list[int]]) -> dict:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def token_loss(model, batch) -> torch.Tensor:
    """The summed loss of the batch's next-token predictions that count (labels not -100)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), reduction="sum")


def windows(loader, k: int):
    """The epoch's windows: k micro-batches each, the last one fewer where the epoch does not divide."""
    window = []
    for batch in loader:
        window.append(batch)
        if len(window) == k:
            yield window
            window = []
    if window:
        yield window


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--accum", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--loss", choices=["mean", "window"], default="mean")
    p.add_argument("--same-length", action="store_true", help="every sequence 10 tokens: equal micro-batches")
    args = p.parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.accum, cpu=True)
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).double()
    loader = torch.utils.data.DataLoader(sequences(200, args.same_length), batch_size=args.batch_size, shuffle=True,
                                         collate_fn=collate, generator=torch.Generator().manual_seed(args.seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, -(-len(loader) // args.accum) * args.epochs)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    step = 0

    def stepped(loss: float, lr: float) -> bool:
        nonlocal step
        step += 1
        print(json.dumps({"step": step, "loss": loss, "lr": lr}), flush=True)
        return step == args.max_steps

    for _ in range(args.epochs):
        if args.loss == "mean":
            for batch in loader:
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    lr = scheduler.get_last_lr()[0]  # the LR of this step, before the schedule moves on
                    optimizer.step()  # (Accelerate skips the step, the schedule and zero_grad until the window ends)
                    scheduler.step()
                    optimizer.zero_grad()
                if accelerator.sync_gradients and stepped(loss.item(), lr):
                    break
        else:
            for window in windows(loader, args.accum):
                count = sum(int((b["labels"][:, 1:] != -100).sum()) for b in window)
                shown = 0.0
                for batch in window:
                    loss = token_loss(model, batch) / count
                    accelerator.backward(loss * args.accum)
                    shown += loss.item()
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                if stepped(shown, lr):
                    break
        if step == args.max_steps:
            break
    torch.save(accelerator.unwrap_model(model).state_dict(), os.environ["BATCHSWEEP_STATE"])


if __name__ == "__main__":
    main()
