"""A loop written the way minimal GPT trainers are, as `batchsweep audit` checks it unmodified (docs/audit.md):
random batches drawn by torch.randint, no epochs (a number of iterations), a loss estimate over random batches
before training, AdamW, clip_grad_norm_ at 1.0, and the loss divided by the number of micro-batches. Nothing in
it is written for batchsweep: it prints its own log lines and saves nothing.

    python gpt_subject.py --batch-size 4 --accum 4 [--seed 0] [--max-iters 20] [--eval yes|no] [--divide yes|no]
        [--lr 1e-3] [--sync before|after]

Under torchrun it trains with DDP (gloo) as minimal GPT trainers do: each rank seeded 1337 + its rank, and
`model.require_backward_grad_sync` switched on at a window's last micro-batch, before its forward, or with
--sync after, after it (build-nanogpt #30: DDP read the flag in the forward, so that micro-batch never
all-reduces).

The model is a small causal transformer on a synthetic token stream (no download), in float64.
"""
import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn

VOCAB, BLOCK, WIDTH = 32, 16, 32


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.zeros(BLOCK, WIDTH))
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx, targets=None):
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], dtype=torch.float64)
        logits = self.head(self.blocks(self.embed(idx) + self.position[:idx.shape[1]], mask=mask, is_causal=True))
        loss = None if targets is None else nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--accum", type=int, default=4, help="gradient_accumulation_steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-iters", type=int, default=20)
    p.add_argument("--eval", default="yes", choices=["yes", "no"], help="estimate the loss before training")
    p.add_argument("--divide", default="yes", choices=["yes", "no"], help="divide each loss by --accum")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--sync", default="before", choices=["before", "after"],
                   help="under torchrun: switch DDP's gradient sync before the forward, or after it (the mistake)")
    args = p.parse_args()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    ddp = "RANK" in os.environ
    if ddp:
        dist.init_process_group("gloo")
    torch.manual_seed(1337 + args.seed + (dist.get_rank() if ddp else 0))
    stream = (torch.arange(20000) * 7 + torch.randint(0, 3, (20000,))) % VOCAB  # a pattern worth learning
    model = TinyGPT()
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)  # (rank 0's weights, broadcast)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def get_batch():
        ix = torch.randint(len(stream) - BLOCK - 1, (args.batch_size,))
        x = torch.stack([stream[i:i + BLOCK] for i in ix])
        return x, torch.stack([stream[i + 1:i + 1 + BLOCK] for i in ix])

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        losses = [model(*get_batch())[1].item() for _ in range(10)]
        model.train()
        return sum(losses) / len(losses)

    x, y = get_batch()
    for it in range(args.max_iters + 1):
        if it == 0 and args.eval == "yes":
            print(f"step {it}: loss {estimate_loss():.4f}")
        if it == args.max_iters:
            break
        for micro_step in range(args.accum):
            if ddp and args.sync == "before":
                model.require_backward_grad_sync = micro_step == args.accum - 1
            _, loss = model(x, y)
            if ddp and args.sync == "after":
                model.require_backward_grad_sync = micro_step == args.accum - 1
            if args.divide == "yes":
                loss = loss / args.accum
            x, y = get_batch()  # the next batch while this one's backward runs
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"iter {it}: loss {loss.item() * (args.accum if args.divide == 'yes' else 1):.4f}")
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.collect()  # DDP's reducer, in a cycle, freed while torch is whole: at exit it can abort the rank
