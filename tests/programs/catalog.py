"""The catalog of accumulation mistakes, one switch each, on a per-sample loss or a per-token loss with padding:
what `batchsweep audit` must name. A plain PyTorch loop, as people write them.

    python catalog.py --batch-size 8 --accum 4 --lr 0.1 --seed 0 --epochs 1 --max-steps 0 \\
        [--mistake none|zero_grad|not_divided|short_window|skip_short_window|drop_last|mean_of_means|
                   step_per_micro|batchnorm|unseeded|schedule_per_micro|lr_times_k|clip_per_micro|
                   penalty_per_micro] \\
        [--loss sample|token] [--dtype float64|float32] [--optimizer sgd|adam] [--momentum M]
        [--weight-decay WD] [--decay all|matrices] [--autocast no|bf16|fp16] [--loss-scale S] [--clip NORM]
        [--frozen-bn yes|no] [--class-weights yes|no] [--warmup STEPS] [--print-lr yes|no]
        [--schedule exponential|cosine] [--clip-api norm|total]

It prints {"step": s, "loss": l, "lr": the step's LR} per optimizer step and saves model.state_dict() to
$BATCHSWEEP_STATE at the end. With SGD the LR decays by 0.9 a step; with --schedule cosine (either optimizer)
it follows a cosine to 0 over the run's {epochs} of windows, as schedules built from a total number of steps
do. The training set (240 samples) is 7 windows of 32 and a short one of 16: at b = 8, k = 4 the last window
holds 2 micro-batches.
"""
import argparse
import json
import math
import os
import sys

import torch
from torch import nn

N, VOCAB, WIDTH = 240, 12, 10
CLASS_WEIGHTS = (1.0, 2.0, 4.0)  # --class-weights: a per-sample loss weighted by class, as for imbalanced classes
PENALTY = 1e-3  # --mistake penalty_per_micro: λ of an L2 penalty in the loss


def data(seed: int, tokens: bool):
    g = torch.Generator().manual_seed(seed)
    if not tokens:
        y = torch.arange(N) % 3
        return torch.randn(N, 6, generator=g) + y[:, None], y
    # Sequences of 2..WIDTH tokens, padded with -100 labels: micro-batches hold different numbers of tokens.
    x = torch.randint(0, VOCAB, (N, WIDTH), generator=g)
    lengths = torch.randint(2, WIDTH + 1, (N,), generator=g)
    y = torch.where(torch.arange(WIDTH) < lengths[:, None], (x + 1) % VOCAB, -100)
    return x, y


def model_for(tokens: bool, batchnorm: bool) -> nn.Module:
    if tokens:
        return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Tanh(), nn.Linear(16, VOCAB))
    norm = [nn.BatchNorm1d(16)] if batchnorm else []
    return nn.Sequential(nn.Linear(6, 16), *norm, nn.Tanh(), nn.Linear(16, 3))


def loss_sum(model, x, y, tokens: bool, autocast: str, weighted: bool):
    """(sum of the per-item losses, counted(y)); under autocast, the model's forward in bf16 or fp16."""
    with torch.autocast("cpu", torch.float16 if autocast == "fp16" else torch.bfloat16, enabled=autocast != "no"):
        out = model(x)
    out = out.to(torch.get_default_dtype())  # (the loss in the weights' dtype, as autocast leaves it to the script)
    if tokens:
        out, y = out.reshape(-1, VOCAB), y.reshape(-1)
    weight = torch.tensor(CLASS_WEIGHTS) if weighted else None
    return nn.functional.cross_entropy(out, y, weight, reduction="sum", ignore_index=-100), counted(y, weighted)


def counted(y, weighted: bool) -> float:
    """The items of y that count: labels that are not padding, or with class weights their weights' sum (what
    CrossEntropyLoss(weight=...) divides by in its mean)."""
    return float(torch.tensor(CLASS_WEIGHTS)[y].sum()) if weighted else int((y != -100).sum())


class SGD(torch.optim.Optimizer):
    """SGD, as torch.optim.SGD steps, with momentum and weight decay as it keeps them (buffer = momentum * buffer
    + gradient + weight_decay * weights), and an exponential decay of its LR, as ExponentialLR(gamma=0.9)
    schedules it, written into its param group as a scheduler does. Weight decay on the matrices only leaves
    biases undecayed, as nanoGPT's param groups do."""

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, decay: str = "all",
                 warmup: int = 0, total: int = 0):
        super().__init__(params, {"lr": lr})
        self.params = self.param_groups[0]["params"]
        self.decayed, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.decay, self.warmup, self.steps, self.base, self.total = decay, warmup, 0, lr, total
        self.buffers = [torch.zeros_like(p) for p in self.params]
        self.param_groups[0]["lr"] = self.lr

    @property
    def lr(self) -> float:
        """With warmup, times steps / warmup until then: 0 at the first step, as transformers' linear schedule."""
        return self.decayed * min(1.0, self.steps / self.warmup) if self.warmup else self.decayed

    def schedule(self) -> None:
        self.steps += 1
        self.decayed = self.base * cosine(self.steps, self.total) if self.total else self.decayed * 0.9
        self.param_groups[0]["lr"] = self.lr

    @torch.no_grad()
    def step(self) -> None:
        lr = self.param_groups[0]["lr"]
        for p, buffer in zip(self.params, self.buffers):
            decay = self.weight_decay if self.decay == "all" or p.dim() >= 2 else 0.0
            buffer.mul_(self.momentum).add_(p.grad + decay * p)
            p -= lr * buffer


def cosine(step: int, total: int) -> float:
    return 0.5 * (1 + math.cos(math.pi * step / total))


def report(step: int, loss: float, lr: float, args) -> None:
    """The step's row as the script prints it: nothing under --self-report no."""
    if args.self_report == "yes":
        print(json.dumps({"step": step, "loss": loss, **({"lr": lr} if args.print_lr == "yes" else {})}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--accum", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--mistake", default="none")
    p.add_argument("--loss", default="sample", choices=["sample", "token"])
    p.add_argument("--dtype", default="float64")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--decay", default="all", choices=["all", "matrices"])
    p.add_argument("--autocast", default="no", choices=["no", "bf16", "fp16"],
                   help="fp16: with a GradScaler of initial scale --loss-scale, as PyTorch's AMP recipe")
    p.add_argument("--loss-scale", type=float, default=2.0 ** 16)
    p.add_argument("--clip", type=float, default=0.0, help="clip_grad_norm_ to NORM before each step (0: none)")
    p.add_argument("--clip-api", default="norm", choices=["norm", "total"],
                   help="total: get_total_norm, then clip_grads_with_norm_, as Accelerate clips (the Trainer's)")
    p.add_argument("--frozen-bn", default="no", choices=["yes", "no"], help="a BatchNorm in eval mode (fine-tuning)")
    p.add_argument("--class-weights", default="no", choices=["yes", "no"], help="per-sample loss only")
    p.add_argument("--warmup", type=int, default=0, help="SGD's LR rises from 0 over this many steps")
    p.add_argument("--print-lr", default="yes", choices=["yes", "no"])
    p.add_argument("--schedule", default="exponential", choices=["exponential", "cosine"])
    p.add_argument("--sampler", default="shuffle", choices=["shuffle", "random"],
                   help="random: each micro-batch drawn by torch.randint from the global generator, as minimal GPT "
                        "trainers draw theirs")
    p.add_argument("--self-report", default="yes", choices=["yes", "no"],
                   help="no: print no rows and save no weights (what batchsweep observes needs neither)")
    p.add_argument("--rows", default="step", choices=["step", "window"],
                   help="window: print one row per window, whatever steps (a row that is not a step)")
    p.add_argument("--estimate", default="no", choices=["yes", "no"],
                   help="before training, a loss estimate over 10 random batches of b (draws in proportion to b)")
    args = p.parse_args()
    args.tokens = args.loss == "token"
    mistakes = set(args.mistake.split(","))  # one or more, comma-separated
    weighted = args.class_weights == "yes"
    torch.set_default_dtype(getattr(torch, args.dtype))
    torch.set_num_threads(1)
    x, y = data(1234, args.tokens)
    torch.manual_seed(args.seed)
    model = model_for(args.tokens, "batchnorm" in mistakes or args.frozen_bn == "yes")
    if args.frozen_bn == "yes":
        model[1].eval()  # normalizes by its running statistics, which stay as they are
    lr = args.lr * args.accum if "lr_times_k" in mistakes else args.lr  # the mistake: the script scales it
    windows = args.epochs * -(-N // (args.batch_size * args.accum)) if args.schedule == "cosine" else 0
    if args.optimizer == "sgd":
        opt = SGD(model.parameters(), lr, args.momentum, args.weight_decay, args.decay, args.warmup, windows)
        schedule, lr_now = opt.schedule, lambda: opt.lr
    else:
        opt = torch.optim.Adam(model.parameters(), lr)
        steps = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine(s, windows) if windows else 1.0)
        schedule, lr_now = steps.step, lambda: steps.get_last_lr()[0]
    scaler = torch.amp.GradScaler("cpu", init_scale=args.loss_scale, enabled=args.autocast == "fp16")
    b, k, step = args.batch_size, args.accum, 0
    if args.estimate == "yes":  # a loss estimate before training, as minimal GPT trainers make at step 0
        model.eval()
        with torch.no_grad():
            for _ in range(10):
                model(x[torch.randint(N, (b,))])
        model.train()
    for epoch in range(args.epochs):
        shuffle = torch.Generator()
        if "unseeded" in mistakes:
            shuffle.seed()  # the mistake: an order that differs from run to run
        else:
            shuffle.manual_seed(args.seed * 1000 + epoch)
        order = torch.randperm(N, generator=shuffle)
        if args.sampler == "random":  # micro-batches of b drawn with replacement, one torch.randint each
            order = torch.cat([torch.randint(N, (b,)) for _ in range(-(-N // b))])[:N]
        if "drop_last" in mistakes:  # a loader's drop_last=True: the batches of b are full ones only
            order = order[:N - N % b]
        for start in range(0, len(order), b * k):
            window = order[start:start + b * k]
            micro = window.split(b)
            total = sum(counted(y[m], weighted) for m in micro)  # the window's items that count
            opt.zero_grad()
            shown = 0.0
            for m in micro:
                s, count = loss_sum(model, x[m], y[m], args.tokens, args.autocast, weighted)
                if "zero_grad" in mistakes:
                    opt.zero_grad()  # the mistake: only the last micro-batch's gradient reaches the step
                if "not_divided" in mistakes:
                    loss = s / count  # each micro-batch's mean, never divided by k
                elif "short_window" in mistakes:
                    loss = s / count / k  # each micro-batch's mean over k, also in a window of fewer
                elif "mean_of_means" in mistakes:
                    loss = s / count / len(micro)  # the mean of the micro-batches' means
                else:
                    loss = s / total  # the window's sum over the window's count: the true batch's mean
                if "penalty_per_micro" in mistakes:  # the mistake: added to every micro-batch, k times a window
                    loss = loss + PENALTY * sum((p ** 2).sum() for p in model.parameters())
                scaler.scale(loss).backward()
                if "clip_per_micro" in mistakes:  # the mistake: each partial sum is clipped (needs --clip)
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                shown += loss.item()
                if "schedule_per_micro" in mistakes:
                    schedule()  # the mistake: the schedule advances k times a window
                if "step_per_micro" in mistakes:
                    lr = lr_now()
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad()
                    schedule()
                    step += 1
                    if args.rows == "step":
                        report(step, shown, lr, args)
                        shown = 0.0
                    if step == args.max_steps:
                        break
            if "step_per_micro" in mistakes and args.rows == "window":
                report(start // (b * k) + 1, shown, lr, args)
            if "skip_short_window" in mistakes and len(micro) < k:
                continue  # the mistake: a step only when (i + 1) % k == 0, so the short last window has none
            if "step_per_micro" not in mistakes:
                if args.clip and "clip_per_micro" not in mistakes:
                    scaler.unscale_(opt)  # clip the true gradient, not the scaled one (a no-op without fp16)
                    if args.clip_api == "total":
                        total = nn.utils.get_total_norm([q.grad for q in model.parameters() if q.grad is not None])
                        nn.utils.clip_grads_with_norm_(model.parameters(), args.clip, total)
                    else:
                        nn.utils.clip_grad_norm_(model.parameters(), args.clip)
                lr = lr_now()
                scaler.step(opt)  # opt.step(), unless the GradScaler found inf or NaN in the gradients
                scaler.update()
                if "schedule_per_micro" not in mistakes:
                    schedule()
                step += 1
                report(step, shown, lr, args)
            if step == args.max_steps:
                break
        if step == args.max_steps:
            break
    if os.environ.get("BATCHSWEEP_STATE") and args.self_report == "yes":
        torch.save(model.state_dict(), os.environ["BATCHSWEEP_STATE"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
