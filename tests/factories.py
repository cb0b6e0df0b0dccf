"""Model and dataset factories that tests pass to the trainer as `tests.factories:NAME`."""
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset


def linreg(seed=0, **_):
    """The classic accumulation check: y = -2 x1 + 3.4 x2 + 4.2 plus a little noise."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(1200, 2, generator=g)
    y = x @ torch.tensor([-2.0, 3.4]) + 4.2 + 0.1 * torch.randn(1200, generator=g)
    return TensorDataset(x[:1000], y[:1000, None]), TensorDataset(x[1000:], y[1000:, None])


def zero_linear(input_shape, num_classes, **_):
    model = nn.Linear(input_shape[0], num_classes)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    return model


def _blobs(train: int, test: int, data_seed: int):
    """Points in 4-D around one centre per class, 3 classes taking turns."""
    g = torch.Generator().manual_seed(data_seed)
    y = torch.arange(train + test) % 3
    x = torch.randn(train + test, 4, generator=g) + y[:, None].float()
    return TensorDataset(x[:train], y[:train]), TensorDataset(x[train:], y[train:])


def blobs(seed=0, **_):
    """90 train and 30 test points in 3 classes: 3 windows of 30 at b=10, k=3."""
    return _blobs(90, 30, 7)


class GradProbe(nn.Module):
    """Records, at every training forward, whether the weight's gradient is empty."""

    def __init__(self, input_shape, num_classes, **_):
        super().__init__()
        self.linear = nn.Linear(input_shape[0], num_classes)
        self.grad_was_empty = []

    def forward(self, x):
        if self.training:
            self.grad_was_empty.append(self.linear.weight.grad is None)
        return self.linear(x)


def half_frozen(input_shape, num_classes, **_):
    model = nn.Sequential(nn.Flatten(), nn.Linear(input_shape[-1] * input_shape[0], 32), nn.ReLU(),
                          nn.Linear(32, num_classes))
    model[1].requires_grad_(False)
    return model


def not_a_model(**_):
    return "not a module"


def not_a_dataset(**_):
    return [1, 2, 3]


def byte_images(**_):
    """8x8 RGB images as bytes, not yet scaled to floats."""
    x, y = torch.randint(0, 256, (40, 3, 8, 8), dtype=torch.uint8), torch.arange(40) % 2
    return TensorDataset(x[:32], y[:32]), TensorDataset(x[32:], y[32:])


def broken_model(**_):
    raise RuntimeError("factory exploded")


def blobs1k(seed=0, **_):
    """1,024 train and 256 test points in 3 classes: big enough for every accum_lr point (B <= 512)."""
    return _blobs(1024, 256, 11)


LOADS: list[int] = []  # the seeds counted_blobs was called with, in this process


def counted_blobs(seed=0, **_):
    """blobs1k, counting its calls: a user's factory may tokenize for minutes, so a command loads it once."""
    LOADS.append(seed)
    return blobs1k(seed)


class OutOfMemory(nn.Module):
    """Raises what a CUDA allocator raises when the batch does not fit, on any device."""

    def __init__(self, input_shape, num_classes, **_):
        super().__init__()
        self.linear = nn.Linear(input_shape[0], num_classes)

    def forward(self, x):
        if self.training:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.linear(x)


def cifar_tiny(seed=0, **_):
    """64 train and 32 test random images shaped like CIFAR-10."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(96, 3, 32, 32, generator=g), torch.randint(0, 10, (96,), generator=g)
    return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])


class ForgetsALayer(nn.Sequential):
    """Its own optimizer groups leave the first layer out: a classic silent bug."""

    def param_groups(self):
        return [{"params": list(self[2].parameters())}]


def forgets_a_layer(input_shape, num_classes, **_):
    return ForgetsALayer(nn.Linear(input_shape[-1], 32), nn.ReLU(), nn.Linear(32, num_classes), nn.Flatten())


class UnusedLayer(nn.Module):
    def __init__(self, input_shape, num_classes, **_):
        super().__init__()
        self.used = nn.Sequential(nn.Flatten(), nn.Linear(input_shape[-1], 16), nn.ReLU(), nn.Linear(16, num_classes))
        self.unused = nn.Linear(4, 4)  # built but never called in forward

    def forward(self, x):
        return self.used(x)


def unused_layer(input_shape, num_classes, **_):
    return UnusedLayer(input_shape, num_classes)


def tokens(seed=0, train=50, **_):
    """50 train and 10 test sequences of 3 to 16 tokens (vocabulary 20) padded to 16, targets -100 at the
    padding: micro-batches hold unequal token counts, and at B = 16 the last window holds 2 sequences."""
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(3, 17, (train + 10,), generator=g)
    x = torch.randint(1, 20, (train + 10, 16), generator=g)
    y = torch.roll(x, -1, 1)
    pad = torch.arange(16)[None, :] >= lengths[:, None]
    x[pad], y[pad] = 0, -100
    y[torch.arange(train + 10), lengths - 1] = -100  # the last token of a sequence predicts nothing
    return TensorDataset(x[:train], y[:train]), TensorDataset(x[train:], y[train:])


def tokens53(seed=0, **_):
    """At B = 12 on 2 ranks the last window holds 5 sequences: shards of 3 and 2, at b = 2 two micro-batches
    on one rank and one on the other."""
    return tokens(train=53)


class Rows(torch.utils.data.Dataset):
    """A TensorDataset's rows as a plain Dataset: read through the DataLoader path."""

    def __init__(self, tensors: TensorDataset):
        self.tensors = tensors

    def __len__(self):
        return len(self.tensors)

    def __getitem__(self, i):
        return self.tensors[i]


def tokens49(seed=0, **_):
    return tokens(train=49)


def tokens49_read(seed=0, **_):
    """Through the DataLoader path, where each rank counts its own shard's tokens; at B = 12 on 2 ranks the
    last window holds one sequence, and one rank's shard of it is empty."""
    train_set, test_set = tokens(train=49)
    return Rows(train_set), test_set


def two_terms(output, target):
    """Token cross-entropy and, per sequence, a penalty on the mean logit: two terms with different counts."""
    counted = target != -100
    ce = nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1), ignore_index=-100,
                                     reduction="sum")
    return {"tokens": (ce, counted.sum()), "logit_mean": (output.mean((1, 2)).pow(2).sum(), len(target))}


two_terms.counts = lambda target: {"tokens": (target != -100).sum(), "logit_mean": len(target)}


def two_terms_without_counts(output, target):
    """two_terms without its counts(): its terms count different items, which one division cannot normalize."""
    return two_terms(output, target)


def tokens_without_counts(output, target):
    """Counts tokens but does not say so in advance: normalized by its own count after the window."""
    counted = target != -100
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1),
                                       reduction="sum"), counted.sum()


class Jittered(torch.utils.data.Dataset):
    """40 series of 2 channels x 12 outside the package, augmented per sample with torch's RNG (or Python's,
    or numpy's: `rng`): channel 0 is shifted circularly by a random amount, flipped with probability 1/2 and
    jittered; channel 1 holds the sample's index, untouched, so that a probe can read which samples a
    micro-batch held."""

    def __init__(self, n=40, offset=0, rng="torch"):
        g = torch.Generator().manual_seed(3 + offset)
        self.base, self.targets = torch.randn(n, 12, generator=g), torch.arange(n) % 3
        self.base += self.targets[:, None].double().float()
        self.offset, self.rng = offset, rng

    def __len__(self):
        return len(self.base)

    def _draws(self):
        """A shift, whether to flip, and 12 jitters."""
        if self.rng == "python":
            return random.randrange(12), random.random() < 0.5, torch.tensor([random.gauss(0, 1) for _ in range(12)])
        if self.rng == "numpy":
            return int(np.random.randint(12)), np.random.rand() < 0.5, torch.from_numpy(np.random.randn(12)).float()
        return int(torch.randint(0, 12, ())), torch.rand(()) < 0.5, torch.randn(12)

    def __getitem__(self, i):
        shift, flip, jitter = self._draws()
        signal = self.base[i].roll(shift)
        if flip:
            signal = signal.flip(0)
        signal = signal + 0.05 * jitter
        return torch.stack([signal, torch.full((12,), float(i + self.offset))]), self.targets[i]


def jittered(seed=0, **_):
    return Jittered(), Jittered(12, offset=1000)


def jittered41(seed=0, **_):
    """An odd number of samples: under 2 ranks the last window splits unequally."""
    return Jittered(41), Jittered(12, offset=1000)


def jittered_python(seed=0, **_):
    return Jittered(rng="python"), Jittered(12, offset=1000)


def jittered_numpy(seed=0, **_):
    return Jittered(rng="numpy"), Jittered(12, offset=1000)


def small_conv2d(input_shape, num_classes, **_):
    """A 2-D conv net with BatchNorm small enough for CIFAR-shaped tests on a CPU."""
    return nn.Sequential(nn.Conv2d(input_shape[0], 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(128, num_classes))


def a_number(output, target):
    """Returns a plain number, not (sum, count)."""
    return 1.0


class WithOwnLoss(nn.Module):
    """A classifier that brings its own loss: cross-entropy plus an L2 term on its logits, per sample."""

    def __init__(self, input_shape, num_classes, **_):
        super().__init__()
        self.linear = nn.Linear(input_shape[0], num_classes)

    def forward(self, x):
        return self.linear(x)

    def loss(self, output, target):
        return {"ce": (nn.functional.cross_entropy(output, target, reduction="sum"), len(target)),
                "l2": (output.pow(2).sum(), len(target))}



def checkpoint_landed() -> None:
    """Wait for the trainer's background checkpoint write, so that a process held or killed here leaves a whole
    last checkpoint."""
    import threading

    for thread in threading.enumerate():
        if thread.name == "checkpoint":
            thread.join()

class Killable(nn.Module):
    """A small conv net with BatchNorm and dropout (so that a resumed run needs the buffers and torch's RNG
    state) that kills its own process with SIGKILL at its n-th forward in train or eval mode, when
    BATCHSWEEP_TEST_KILL is `marker:mode:n` and the marker file exists (it is removed first: a rerun trains
    on)."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(input_shape[0], 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU(),
                                 nn.Dropout(0.2), nn.Flatten(), nn.Linear(8 * input_shape[1], num_classes))
        self.calls = {"train": 0, "eval": 0}

    def forward(self, x):
        import signal

        mode = "train" if self.training else "eval"
        self.calls[mode] += 1
        marker, _, rest = os.environ.get("BATCHSWEEP_TEST_KILL", "").partition(":")
        when_mode, _, n = rest.partition(":")
        if marker and when_mode == mode and self.calls[mode] == int(n) and os.path.exists(marker):
            os.unlink(marker)
            # The last epoch's checkpoint is written beside this epoch's training: let it land, so that the
            # resume point does not depend on the machine's load (a kill mid-write has a test of its own).
            checkpoint_landed()
            os.kill(os.getpid(), signal.SIGKILL)
        return self.net(x)


def killable(input_shape, num_classes, **_):
    return Killable(input_shape, num_classes)


class Holds(nn.Module):
    """A linear model that, at its n-th forward in eval mode, when BATCHSWEEP_TEST_HOLD is `marker:n` and the
    marker file exists, removes it, lets the last checkpoint land, writes its pid to `marker.held` and waits
    there until killed: a test kills the sweep, or this process, at a point it knows, not in a window of time.
    Removing the marker is the claim: of several processes that reach the point together, one holds."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.linear = nn.Linear(int(np.prod(input_shape)), num_classes)
        self.evals = 0

    def forward(self, x):
        import time

        marker, _, n = os.environ.get("BATCHSWEEP_TEST_HOLD", "").partition(":")
        self.evals += not self.training
        if marker and not self.training and self.evals == int(n) and self._claim(marker):
            checkpoint_landed()
            with open(f"{marker}.pid", "w") as f:
                f.write(str(os.getpid()))
            os.replace(f"{marker}.pid", f"{marker}.held")  # whole when it appears
            while True:
                time.sleep(1)
        return self.linear(x.flatten(1))

    @staticmethod
    def _claim(marker):
        try:
            os.unlink(marker)
            return True
        except FileNotFoundError:
            return False


def holds(input_shape, num_classes, **_):
    return Holds(input_shape, num_classes)


class HoldsEach(nn.Module):
    """A linear model whose every instance, at its n-th forward in eval mode while BATCHSWEEP_TEST_HOLD_EACH is
    `folder:n`, lets the last checkpoint land, writes `folder/<pid>.held` and waits there until a signal stops
    it: a test stops a study once each of its workers is inside a trial, at a point it knows. With
    `folder:n:stubborn` it swallows the stop, writes `folder/<pid>.stopping` and waits on, as a worker that is
    slow to record its trial would."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.linear = nn.Linear(int(np.prod(input_shape)), num_classes)
        self.evals = 0

    def forward(self, x):
        import time

        folder, _, rest = os.environ.get("BATCHSWEEP_TEST_HOLD_EACH", "").partition(":")
        n, _, stubborn = rest.partition(":")
        self.evals += not self.training
        if folder and not self.training and self.evals == int(n):
            checkpoint_landed()
            self._mark(folder, "held")
            while True:
                try:
                    time.sleep(0.05)
                except KeyboardInterrupt:
                    if not stubborn:
                        raise
                    self._mark(folder, "stopping")
        return self.linear(x.flatten(1))

    @staticmethod
    def _mark(folder: str, what: str) -> None:
        path = os.path.join(folder, f"{os.getpid()}.{what}")
        with open(f"{path}.tmp", "w"):
            pass
        os.replace(f"{path}.tmp", path)  # whole when it appears


def holds_each(input_shape, num_classes, **_):
    return HoldsEach(input_shape, num_classes)


class Branchy(nn.Module):
    """A forward whose control flow depends on the data: torch.export cannot trace it."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.linear = nn.Linear(input_shape[0], num_classes)

    def forward(self, x):
        return self.linear(x) if x.sum() > 0 else -self.linear(x)


def branchy(input_shape, num_classes, **_):
    return Branchy(input_shape, num_classes)


class FitsSixteen(nn.Module):
    """Runs out of memory, as a GPU would, when a training micro-batch holds more than 16 samples: after its
    first layer, so that the failed micro-batch leaves activations behind."""

    def __init__(self, input_shape, num_classes, **_):
        super().__init__()
        self.first = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 32), nn.ReLU())
        self.last = nn.Linear(32, num_classes)

    def forward(self, x):
        h = self.first(x)
        if torch.is_grad_enabled() and len(x) > 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.last(h)


def fits_16(input_shape, num_classes, **_):
    return FitsSixteen(input_shape, num_classes)


class SwallowsCtrlC(nn.Linear):
    """A model whose third training forward receives Ctrl-C inside code that catches the KeyboardInterrupt and
    raises another error in its place, as some libraries do."""

    def __init__(self, input_shape, num_classes):
        super().__init__(input_shape[0], num_classes)
        self.calls = 0

    def forward(self, x):
        import signal

        self.calls += self.training
        if self.training and self.calls == 3:
            try:
                # raise_signal: handled by the entry point's handler before it returns, so the KeyboardInterrupt
                # comes out here, inside the try (os.kill may deliver it to another thread, and later).
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                raise RuntimeError("interrupted system call") from None
        return super().forward(x)


def swallows_ctrl_c(input_shape, num_classes, **_):
    return SwallowsCtrlC(input_shape, num_classes)


# A transformers-shaped workload without transformers: samples are mappings of varying length, batched by a
# padding collate function; the model takes keyword arguments and returns an object with `.logits`; the loss
# shifts the labels itself, as transformers' causal models do, and returns (sum, count) with nothing more.
class Sequences(torch.utils.data.Dataset):
    def __init__(self, ids: list):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def pad(samples):
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = s["input_ids"], s["labels"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def hf_shaped(seed=0, train=50, test=20, **_):
    """50 train and 20 test sequences of 3 to 16 tokens (vocabulary 20), with a repeating pattern to learn."""
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(3, 17, (train + test,), generator=g).tolist()
    ids = [(torch.arange(n) * int(torch.randint(1, 4, (), generator=g)) + int(torch.randint(0, 20, (), generator=g)))
           % 20 for n in lengths]
    return Sequences(ids[:train]), Sequences(ids[train:]), pad


@dataclass
class LMOutput:
    logits: torch.Tensor


class KeywordLM(nn.Module):
    """Called as model(input_ids=..., attention_mask=...); positions past the mask see nothing of it (causal)."""

    label_shift = 1  # position t predicts label t+1: how the built-in accuracy reads its logits

    def __init__(self, vocab=20, context=16):
        super().__init__()
        from batchsweep.trainers.lm import GPT

        self.gpt = GPT(vocab, context, width=32, layers=1, heads=2)

    def forward(self, input_ids, attention_mask=None):
        return LMOutput(logits=self.gpt(input_ids))


def keyword_lm(**_):
    return KeywordLM()


def shifted_ce(output, labels):
    """transformers' causal loss as (sum, count): logits at t against label t+1, padding not counted."""
    logits, targets = output.logits[:, :-1], labels[:, 1:]
    total = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                        ignore_index=-100, reduction="sum")
    return total, (targets != -100).sum()


def shifted_ce_at(output, labels):
    """shifted_ce as one named term, under a name MLflow refuses."""
    return {"ce@1": shifted_ce(output, labels)}


def margin(output, target):
    """A metric of the user's own: the mean logit margin of the true class over the best other one."""
    logits = output if torch.is_tensor(output) else output.logits
    true = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    other = logits.scatter(-1, target.unsqueeze(-1), float("-inf")).max(-1).values
    return {"margin": ((true - other).sum(), len(target))}


class Held(torch.utils.data.Dataset):
    """Tensors behind a plain Dataset: read through a loader, never held by the trainer."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _mnist1d_split(data_dir, loader: bool):
    from batchsweep.trainers.data import mnist1d

    data = mnist1d(data_dir)
    # 500 training samples and a test set twice as large (the 1,000 test series)
    train = TensorDataset(data.x_train[:500], data.y_train[:500])
    test = Held(data.x_test, data.y_test) if loader else TensorDataset(data.x_test, data.y_test)
    return train, test


def big_test_in_memory(data_dir="data", **_):
    return _mnist1d_split(data_dir, loader=False)


def big_test_loader(data_dir="data", **_):
    return _mnist1d_split(data_dir, loader=True)


class KeywordLMFitsFour(KeywordLM):
    """Runs out of memory, as a GPU would, when a training micro-batch holds more than 4 sequences."""

    def forward(self, input_ids, attention_mask=None):
        if torch.is_grad_enabled() and len(input_ids) > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(input_ids, attention_mask)


def keyword_lm_fits_4(**_):
    return KeywordLMFitsFour()


def token_margin(output, labels):
    """The margin metric over the tokens a causal model predicts (logits at t against label t+1)."""
    logits, targets = output.logits[:, :-1], labels[:, 1:]
    counted = targets != -100
    safe = targets.clamp_min(0)
    true = logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    other = logits.scatter(-1, safe.unsqueeze(-1), float("-inf")).max(-1).values
    return {"token_margin": (((true - other) * counted).sum(), counted.sum())}


def clashing(output, target):
    return {"acc": (torch.zeros(()), 1)}


def recall_at(output, target):  # a name as retrieval writes it, which MLflow refuses
    return {"recall@5": (torch.zeros(()), 1)}


def four_parts(**_):
    train, test, collate = hf_shaped()
    return train, test, collate, None


def noise_truth(dataset: str, data_dir: str, seed: int = 0) -> float:
    """tr(Sigma) / |G|^2 of `mlp` at its initial weights (built as the trainer builds it for `seed`), from every
    training sample's own gradient: what a noise scale measured with the weights held still must come near."""
    import torch.nn.functional as F
    from torch.func import functional_call, grad, vmap

    from batchsweep.trainers.data import load_data
    from batchsweep.trainers.models import build_model

    data = load_data(dataset, data_dir, 0)
    torch.manual_seed(seed)
    model = build_model("mlp", data.input_shape, data.num_classes, "batch")
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x, y):
        return F.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, data.x_train, data.y_train)
    flat = torch.cat([g.reshape(len(data.x_train), -1) for g in per_sample.values()], 1)
    mean = flat.mean(0)
    return (((flat - mean) ** 2).sum() / (len(flat) - 1) / mean.pow(2).sum()).item()


def bn_mlp(input_shape, num_classes, **_):
    """A small MLP with BatchNorm: running statistics that each accumulated micro-batch moves."""
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 16), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.Linear(16, num_classes))


def bn_mlp_without_statistics(input_shape, num_classes, **_):
    """BatchNorm that normalizes by its batch's statistics in evaluation too (no running statistics)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 16),
                         nn.BatchNorm1d(16, track_running_stats=False), nn.ReLU(), nn.Linear(16, num_classes))


class Subclassed(nn.Sequential):
    """Layers in a subclass of nn.Sequential: a fused group stacks its forward through vmap, not as fused
    operators (trainers/stacked.py fuses nn.Sequential itself only)."""


def bn_mlp_through_vmap(input_shape, num_classes, **_):
    return Subclassed(*bn_mlp(input_shape, num_classes))


def dropout_mlp(input_shape, num_classes, **_):
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 16), nn.Dropout(0.1), nn.ReLU(),
                         nn.Linear(16, num_classes))


def blobs300(seed=0, **_):
    """300 train and 60 test points: 10 micro-batches of 32 an epoch, the last short (12)."""
    return _blobs(300, 60, 11)
