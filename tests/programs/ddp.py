"""Accumulation under DistributedDataParallel, as people write it: the catalog of the mistakes that ranks add, one
--case each, on gloo (CPU). Launched by torchrun; each rank takes every N-th sample of the epoch's permutation (as
DistributedSampler does), so N ranks at (b, k) hold together the samples that one rank holds at (b*k*N, 1).

    torchrun --standalone --nproc-per-node 2 ddp.py --batch-size 8 --accum 4 --seed 0 --case plain [--loss token]
        [--deal sample|micro] [--clip NORM] [--static-graph yes|no] [--dtype float64|float32]

Cases, and [the verdict `batchsweep audit --nproc 2` must give]:
    plain            no_sync() but at a window's last micro-batch; the loss over the window's count of items,
                     counted across the ranks, times N (DDP averages the ranks' gradients) [exact]
    sync_everywhere  no_sync() around backward() alone, which is a no-op: every micro-batch all-reduces (slower,
                     but the same gradient) [exact]
    sync_after_forward  model.require_backward_grad_sync set after the forward instead of before it (DDP reads it
                     in forward): the window's last micro-batch is never all-reduced [grads_not_synced]
    rank_mean        each rank divides by its own count (a per-rank token mean, average_tokens_across_devices
                     off): equal to the true mean only where the ranks' counts are equal [mean_of_rank_means on
                     tokens; exact per sample, where every rank counts alike]
    world_times      the loss multiplied by the world size on top of DDP's mean [loss_scaled_by_world]
    global_mean      the loss over the window's count on all ranks, not multiplied by N: DDP's mean makes the
                     update 1/N of the global batch's (TRL #6024's kind) [loss_scaled_by_world, with --clip too]
    sync_at_k        the sync switched on at micro-batch k (i == k - 1, before the forward), as nanoGPT-style
                     loops over islice(loader, k) write it: the epoch's short last window never reaches it, so
                     its gradients are never all-reduced [grads_not_synced, with advice for that window]

The token model is called with labels=... (as transformers' models are), so the tracer counts each rank's tokens.
--deal micro deals micro-batches to the ranks in turn, as Accelerate's prepared loaders do (the Trainer's).
--clip NORM clips the window's gradient (clip_grad_norm_, once, before step()). --static-graph yes wraps the model
in DDP(static_graph=True), which PyTorch #187732 reports to stop all-reducing after the first iteration where
no_sync() is used.
"""
import argparse
import gc
import contextlib

import torch
import torch.distributed as dist
from torch import nn

from catalog import N, VOCAB, data  # the catalog's data: 240 samples, or sequences padded with -100 labels


class Tokens(nn.Module):
    """A per-token model called with labels, as a transformers model is (it returns the logits only)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Tanh(), nn.Linear(16, VOCAB))

    def forward(self, input_ids, labels=None):
        return self.net(input_ids)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--accum", type=int, required=True)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--case", default="plain",
                   choices=["plain", "sync_everywhere", "sync_after_forward", "rank_mean", "world_times",
                            "global_mean", "sync_at_k"])
    p.add_argument("--loss", default="sample", choices=["sample", "token"])
    p.add_argument("--deal", default="sample", choices=["sample", "micro"],
                   help="micro: each rank takes every N-th micro-batch (a rank's samples at (b, k) then differ from "
                        "its samples at (b*k, 1), the windows as a whole do not)")
    p.add_argument("--clip", type=float, default=0.0, help="clip_grad_norm_ to this, once a window (0: none)")
    p.add_argument("--static-graph", default="no", choices=["yes", "no", "bootstrap"])
    p.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    p.add_argument("--bn", default="no", choices=["yes", "no"], help="BatchNorm1d after the first layer (training mode)")
    args = p.parse_args()
    torch.set_default_dtype(getattr(torch, args.dtype))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = args.loss == "token"
    x, y = data(1234, tokens)
    torch.manual_seed(args.seed)
    model = nn.parallel.DistributedDataParallel(
        Tokens() if tokens else nn.Sequential(nn.Linear(6, 16), *[nn.BatchNorm1d(16)] * (args.bn == "yes"),
                                              nn.Tanh(), nn.Linear(16, 3)),
        static_graph=args.static_graph != "no")
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    b, k = args.batch_size, args.accum
    order = torch.randperm(N, generator=torch.Generator().manual_seed(args.seed))
    if args.deal == "micro":  # Accelerate's way: micro-batches of b dealt to the ranks in turn
        mine = order.split(b)[rank::world]
        windows = [mine[i:i + k] for i in range(0, len(mine), k)]
    else:  # every N-th sample, as DistributedSampler takes them, in windows of b*k
        share = order[rank::world]
        windows = [share[i:i + b * k].split(b) for i in range(0, len(share), b * k)]
    for micro in windows:
        count = torch.tensor(float(sum(int((y[m] != -100).sum()) for m in micro)))
        own = float(count)
        dist.all_reduce(count)  # the window's items on every rank
        opt.zero_grad()
        for i, m in enumerate(micro):
            last = i == len(micro) - 1
            if args.case == "sync_at_k":  # the mistake: a short window has no micro-batch k
                model.require_backward_grad_sync = i == k - 1
                out = model(x[m], labels=y[m]) if tokens else model(x[m])
                quiet = contextlib.nullcontext()
            elif args.case == "sync_after_forward":
                out = model(x[m], labels=y[m]) if tokens else model(x[m])
                model.require_backward_grad_sync = last  # the mistake: DDP read the flag in the forward above
                quiet = contextlib.nullcontext()
            else:  # (--static-graph bootstrap: the run's first micro-batch synced, as LoongForge #163 keeps it)
                sync = last or args.static_graph == "bootstrap" and micro is windows[0] and i == 0
                quiet = model.no_sync() if not sync and args.case != "sync_everywhere" else contextlib.nullcontext()
                with quiet:
                    out = model(x[m], labels=y[m]) if tokens else model(x[m])
                quiet = model.no_sync() if not last and args.case == "sync_everywhere" else contextlib.nullcontext()
            s = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y[m].reshape(-1), reduction="sum",
                                            ignore_index=-100)
            if args.case == "rank_mean":
                loss = s / own  # the mistake: this rank's own count, as if it held the whole window
            elif args.case == "world_times":
                loss = s / float(count) * world * world  # the mistake: times N once more
            elif args.case == "global_mean":
                loss = s / float(count)  # the mistake: DDP's mean divides by N once more
            else:
                loss = s / float(count) * world  # DDP divides the ranks' sum by N
            with quiet:  # (sync_everywhere: no_sync() around backward() alone, a no-op)
                loss.backward()
        if args.clip:
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.collect()  # DDP's reducer, in a cycle, freed while torch is whole: at exit it can abort the rank
