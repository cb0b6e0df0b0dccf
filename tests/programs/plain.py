"""Plain training loops of the kinds users write, over tensors indexed by hand (no DataLoader): correct ones that
a checker must not call wrong, and mistakes it must name. One --case each; the loop is correct unless the case
says otherwise.

    python plain.py --batch-size 8 --accum 4 --lr 0.1 --seed 0 --case sequential [--epochs 2] [--n 240]

Cases, and [the verdict `batchsweep audit` must give]:
    plain        the correct loop: SGD, each micro-batch's summed loss over the window's count [exact]
    sequential   a LinearLR warmup then a cosine, through SequentialLR, stepped once a window [exact]
    chained      an ExponentialLR and a StepLR through ChainedScheduler [exact]
    two_schedulers  an ExponentialLR and a StepLR, both stepped on one line once a window [exact]
    counter      a float buffer that counts training forwards (an EMA's or a warmup's counter) [exact]
    spectral     torch.nn.utils.spectral_norm on the first layer (its _u, _v move at each forward)
                 [stateful_forward]
    probe        head(encoder(x)), the encoder frozen and in train mode, an L2 penalty on the head added to
                 every micro-batch's loss [weight_penalty_per_micro_batch]
    lr_tensor    the LR held in a tensor, halved by a scheduler each window [exact]
    two_phase    a second optimizer (and schedule) from step 4 on, as two-phase fine-tuning; the first one must
                 be freed (exit status 3 where something still holds it) [exact]
    grad_noise   Gaussian noise added to the gradients before each step, drawn from the global generator
                 [exact: both runs draw alike]
    gan          a generator and a discriminator, each with its own optimizer, D's real and fake losses
                 backwarded apart (k micro-batches of each per window)
    dropout      --dropout P on --drops hidden layers [exact; 2 layers: random_forward]
    unused_dropout  a dropout layer the forward never calls [exact, no note: nothing drew]
    head_dropout head(net(x)), the head a model of its own with two functional dropouts [random_forward]
    layerdrop    each hidden layer skipped at a training forward where random.uniform(0, 1) < 0.5 (--rng numpy:
                 np.random.uniform; --rng generator: a np.random.default_rng object of its own, which the tracer
                 does not watch), as some transformers models write LayerDrop [random_forward; generator:
                 zero_grad_unseen]
    late_dropout --drops 2 --dropout 0, each dropout's p raised to 0.1 after step 4 [random_forward, named from
                 the modules listed at the run's end]
    attention    nn.MultiheadAttention(dropout=0.1), whose dropout is a float, no Dropout module [random_forward]
    random_batches  each micro-batch drawn by torch.randint from the global generator in the step, as minimal GPT
                 trainers draw them; with --drops 2 the forward's masks move that generator between the draws
                 [random_forward]
    target_noise noise added to the one-hot targets in the step, after the forward (a squared loss) [random_step]
    teacher      a distillation teacher with two dropouts left in training mode, called under no_grad after the
                 student's forward [random_step]
    augment      each micro-batch's inputs scaled by a factor drawn for the batch in the step, before the forward
                 (a batch-level augmentation, as mixup's λ is drawn) [data_differs]
    skip_tokens  a token loss, each micro-batch's token mean over k, the epoch's short window backwarded but
                 never stepped (the next window's zero_grad drops it) [short_window_skipped,
                 mean_of_micro_batch_means]
    short_mean   each micro-batch's sample mean over k, the epoch's short window too [short_window_divided_by_k]
                 (skip_tokens with --drops 2: two dropouts beside it [short_window_skipped, random_forward])
    spawn        the plain loop under DDP on 2 gloo ranks started by torch.multiprocessing.spawn, the ranks
                 passed as arguments (PyTorch's tutorial pattern), no_sync() but at a window's last micro-batch

--undivided yes: the mistake of each micro-batch's mean loss never divided by k, beside any case
[loss_not_divided].
--compile function|module compiles the model (fullgraph, Dynamo's eager backend): torch.compile(model), or
model.compile() in place.

It prints nothing unless --rows yes ({"step": s, "loss": l} per step, text otherwise with --text yes).
"""
import argparse
import contextlib
import gc
import json
import os
import random
import sys
import weakref

import numpy as np
import torch
from torch import nn

VOCAB, WIDTH, HIDDEN = 12, 8, 16


def data(n: int, tokens: bool):
    g = torch.Generator().manual_seed(1234)
    if not tokens:
        y = torch.arange(n) % 3
        return torch.randn(n, 6, generator=g) + y[:, None], y
    x = torch.randint(0, VOCAB, (n, WIDTH), generator=g)
    lengths = torch.randint(2, WIDTH + 1, (n,), generator=g)
    return x, torch.where(torch.arange(WIDTH) < lengths[:, None], (x + 1) % VOCAB, -100)


class Counted(nn.Module):
    """A layer with a float buffer counting its training forwards, as EMA and warmup modules keep one."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        if self.training:
            self.seen += 1
        return self.linear(x)


def model_for(args) -> nn.Module:
    if args.case == "skip_tokens":
        drops = [nn.Dropout(args.dropout) for _ in range(args.drops)]
        return nn.Sequential(nn.Embedding(VOCAB, HIDDEN), nn.Tanh(), *drops, nn.Linear(HIDDEN, VOCAB))
    if args.case == "attention":
        return Attention()
    first = nn.Linear(6, HIDDEN)
    if args.case == "spectral":
        first = nn.utils.spectral_norm(first)
    layers = [first, nn.Tanh()]
    for i in range(args.drops):
        layers += [nn.Dropout(args.dropout), nn.Linear(HIDDEN, HIDDEN), nn.Tanh()] if i else [nn.Dropout(args.dropout)]
    if args.case == "layerdrop":
        return LayerDrop(args.rng)
    if args.case == "own_generator":
        own = torch.Generator().manual_seed(args.seed)
        return nn.Sequential(first, nn.Tanh(), OwnDrop(own), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), OwnDrop(own),
                             nn.Linear(HIDDEN, 3))
    if args.case == "counter":
        layers += [Counted(HIDDEN), nn.Tanh()]
    net = nn.Sequential(*layers, nn.Linear(HIDDEN, 3))
    return Unused(net) if args.case == "unused_dropout" else net


class Head(nn.Module):
    """A second model the loop calls apart, with two functional dropouts (masks drawn in another order at (b, k))."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, h):
        h = torch.nn.functional.dropout(self.a(h), 0.1, training=self.training)
        return self.b(torch.nn.functional.dropout(h, 0.1, training=self.training))


class LayerDrop(nn.Module):
    """Hidden layers each skipped at a training forward with probability 1/2, drawn from Python's random or NumPy's
    global generator: a micro-batch's forward draws its own, k a window at (b, k) against one at (b*k, 1)."""

    def __init__(self, rng: str):
        super().__init__()
        self.first, self.last = nn.Linear(6, HIDDEN), nn.Linear(HIDDEN, 3)
        self.hidden = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.uniform = {"random": random.uniform, "numpy": np.random.uniform,
                        "generator": np.random.default_rng(0).uniform}[rng]

    def forward(self, x):
        h = torch.tanh(self.first(x))
        for layer in self.hidden:
            if not self.training or self.uniform(0, 1) >= 0.5:
                h = torch.tanh(layer(h))
        return self.last(h)


class OwnDrop(nn.Module):
    """Dropout drawn from one torch.Generator of the script's own for the whole run (not a default generator)."""

    def __init__(self, generator: torch.Generator, p: float = 0.1):
        super().__init__()
        self.generator, self.p = generator, p

    def forward(self, h):
        if not self.training:
            return h
        return h * torch.bernoulli(torch.full_like(h, 1 - self.p), generator=self.generator) / (1 - self.p)


class Attention(nn.Module):
    """Self-attention over the 6 features as tokens, its attention weights dropped by nn.MultiheadAttention itself."""

    def __init__(self):
        super().__init__()
        self.embed, self.out = nn.Linear(1, HIDDEN), nn.Linear(HIDDEN, 3)
        self.attention = nn.MultiheadAttention(HIDDEN, 2, dropout=0.1, batch_first=True)

    def forward(self, x):
        h = self.embed(x[..., None])
        return self.out(self.attention(h, h, h)[0].mean(1))


class Unused(nn.Module):
    """A model that holds a dropout layer its forward never calls (left from an experiment)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net, self.unused = net, nn.Dropout(0.1)

    def forward(self, x):
        return self.net(x)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--accum", type=int, required=True)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--n", type=int, default=240, help="training samples (240: 7 windows of 32 and one of 16)")
    p.add_argument("--case", default="plain")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--drops", type=int, default=0, help="dropout layers (case dropout)")
    p.add_argument("--rng", default="random", choices=["random", "numpy", "generator"],
                   help="case layerdrop: whose generator")
    p.add_argument("--dtype", default="float64")
    p.add_argument("--rows", default="no", choices=["yes", "no"])
    p.add_argument("--text", default="no", choices=["yes", "no"], help="rows as text, not JSON")
    p.add_argument("--compile", default="no", choices=["no", "function", "module"])
    p.add_argument("--port", type=int, default=29517, help="spawn: the ranks' rendezvous on 127.0.0.1")
    p.add_argument("--undivided", default="no", choices=["yes", "no"])
    p.add_argument("--out", default="", help="a folder to save the weights into at the end, as out/ckpt.pt")
    args = p.parse_args()
    if args.case == "spawn":
        import torch.multiprocessing as mp

        mp.spawn(rank_main, args=(args,), nprocs=2)
        return 0
    return train(args)


def rank_main(rank: int, args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=2)
    try:
        train(args, rank)
    finally:
        gc.collect()  # DDP's reducer, in a cycle, freed while torch is whole: at exit it can abort the rank
        dist.destroy_process_group()


def train(args, rank: int | None = None) -> int:
    torch.set_default_dtype(getattr(torch, args.dtype))
    torch.set_num_threads(1)
    tokens = args.case == "skip_tokens"
    x, y = data(args.n, tokens)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    b, k = args.batch_size, args.accum
    if args.case == "gan":
        return gan(args, x)
    if args.case == "probe":
        encoder, head = nn.Sequential(nn.Linear(6, HIDDEN), nn.Tanh()), nn.Linear(HIDDEN, 3)
        encoder.requires_grad_(False)  # frozen, and left in train mode

        def model(v):
            return head(encoder(v))
        trained = head
    elif args.case == "head_dropout":
        net, head = model_for(args), Head()

        def model(v):
            return head(net(v))
        trained = nn.ModuleList([net, head])
    else:
        model = trained = model_for(args)
    if args.case == "teacher":  # frozen, and left in training mode: its dropouts draw
        args.teacher = nn.Sequential(nn.Linear(6, HIDDEN), nn.Tanh(), nn.Dropout(0.1), nn.Linear(HIDDEN, HIDDEN),
                                     nn.Tanh(), nn.Dropout(0.1), nn.Linear(HIDDEN, 3))
    if args.compile == "function":
        model = torch.compile(model, fullgraph=True, backend="eager")
    elif args.compile == "module":
        model.compile(fullgraph=True, backend="eager")
    if rank is not None:  # each rank its half of every window
        model = torch.nn.parallel.DistributedDataParallel(model)
    lr = torch.tensor(args.lr) if args.case == "lr_tensor" else args.lr
    opt = torch.optim.SGD(trained.parameters(), lr=lr)
    schedule = scheduler(args.case, opt)
    step = 0
    for epoch in range(args.epochs):
        order = torch.randperm(args.n, generator=torch.Generator().manual_seed(args.seed * 100 + epoch))
        windows = order.split(b * k * (1 if rank is None else 2))
        if args.case == "random_batches":  # (as many windows; each micro-batch drawn in the step, below)
            windows = [torch.zeros(len(w), dtype=torch.long) for w in windows]
        for i, window in enumerate(windows):
            if rank is not None:
                window = window.chunk(2)[rank] if len(window) > 1 else window
            micro = window.split(b)
            count = sum(int((y[m] != -100).sum()) for m in micro) if tokens else len(window)
            opt.zero_grad()
            shown = 0.0
            for j, m in enumerate(micro):
                if args.case == "random_batches":
                    m = torch.randint(args.n, (len(m),))
                sync = rank is None or j == len(micro) - 1
                with (model.no_sync() if not sync else contextlib.nullcontext()):
                    shown += backward(args, model, trained, x[m], y[m], count)
            if args.case == "skip_tokens" and len(micro) < k:
                continue  # the mistake: a step only for a full window; the next window's zero_grad drops this one
            if args.case == "grad_noise":
                for q in trained.parameters():
                    q.grad += 1e-3 * torch.randn_like(q.grad)
            opt.step()
            if args.case == "two_schedulers":
                schedule[0].step(); schedule[1].step()  # noqa: E702 (one line, as people write it)
            elif schedule is not None:
                schedule.step()
            step += 1
            if args.case == "late_dropout" and step == 4:
                for layer in trained.modules():
                    if isinstance(layer, nn.Dropout):
                        layer.p = 0.1
            if args.case == "two_phase" and step == 4:  # phase two: a new optimizer and schedule
                first = weakref.ref(opt)
                opt = torch.optim.SGD(trained.parameters(), lr=args.lr / 2, momentum=0.5)
                schedule = torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)
                gc.collect()
                if first() is not None:  # its state (Adam's moments, on a GPU) would stay in memory
                    print("the first optimizer is still held", file=sys.stderr)
                    return 3
            if args.rows == "yes":
                print(f"step {step}: loss {shown:.4f}" if args.text == "yes" else
                      json.dumps({"step": step, "loss": shown}), flush=True)
    if args.out:
        torch.save(trained.state_dict(), os.path.join(args.out, "ckpt.pt"))
    return 0


def backward(args, model, trained, x, y, count: int) -> float:
    """One micro-batch's forward and backward; its loss."""
    if args.case == "augment":  # one draw a micro-batch: k a window at (b, k), one at (b*k, 1)
        x = x * torch.empty(()).uniform_(0.9, 1.1)
    out = model(x)
    k = args.accum
    if args.case == "teacher":
        with torch.no_grad():
            y = nn.functional.softmax(args.teacher(x), -1)  # soft targets, its dropouts drawn in the step
    if args.case == "target_noise":
        target = nn.functional.one_hot(y, 3).to(out.dtype) + 0.1 * torch.randn(len(y), 3)
        loss = ((out - target) ** 2).sum() / count
    elif args.case == "skip_tokens":
        s = nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, reduction="sum")
        loss = s / int((y != -100).sum()) / k  # the mistake: a token mean per micro-batch, over k
    elif args.case == "short_mean":
        loss = nn.functional.cross_entropy(out, y) / k  # the mistake: over k in a short window too
    elif args.undivided == "yes":
        loss = nn.functional.cross_entropy(out, y)  # the mistake: each micro-batch's mean, never divided by k
    else:
        loss = nn.functional.cross_entropy(out, y, reduction="sum") / count
    if args.case == "probe":  # the mistake: the penalty in every micro-batch's loss
        loss = loss + 1e-3 * sum((q ** 2).sum() for q in trained.parameters())
    loss.backward()
    return loss.item()


def scheduler(case: str, opt):
    steps = torch.optim.lr_scheduler
    if case == "sequential":  # a warmup over 3 windows, then a cosine over 10
        return steps.SequentialLR(opt, [steps.LinearLR(opt, 0.1, 1.0, total_iters=3),
                                        steps.CosineAnnealingLR(opt, T_max=10)], milestones=[3])
    if case == "chained":
        return steps.ChainedScheduler([steps.ExponentialLR(opt, 0.95), steps.StepLR(opt, 3, 0.5)])
    if case == "two_schedulers":
        return steps.ExponentialLR(opt, 0.95), steps.StepLR(opt, 3, 0.5)
    if case == "lr_tensor":
        return steps.ExponentialLR(opt, 0.5)
    return None


def gan(args, x) -> int:
    """D learns real (x) from fake (G's), G fools D: k micro-batches of each per window, D's two losses apart."""
    b, k = args.batch_size, args.accum
    g_net = nn.Sequential(nn.Linear(4, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 6))
    d_net = nn.Sequential(nn.Linear(6, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))
    opt_g, opt_d = torch.optim.SGD(g_net.parameters(), args.lr), torch.optim.SGD(d_net.parameters(), args.lr)
    bce = nn.functional.binary_cross_entropy_with_logits
    for epoch in range(args.epochs):
        order = torch.randperm(args.n, generator=torch.Generator().manual_seed(args.seed * 100 + epoch))
        for window in order.split(b * k):
            opt_d.zero_grad()
            for m in window.split(b):
                real = d_net(x[m])
                (bce(real, torch.ones_like(real), reduction="sum") / len(window)).backward()
                fake = d_net(g_net(torch.randn(len(m), 4)).detach())
                (bce(fake, torch.zeros_like(fake), reduction="sum") / len(window)).backward()
            opt_d.step()
            opt_g.zero_grad()
            for m in window.split(b):
                fake = d_net(g_net(torch.randn(len(m), 4)))
                (bce(fake, torch.ones_like(fake), reduction="sum") / len(window)).backward()
            opt_g.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
