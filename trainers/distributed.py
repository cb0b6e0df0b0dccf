"""Data-parallel training under torchrun: one process per rank, each training on its shard of every window of
the same global order, DistributedDataParallel with the gradients all-reduced once per window (`no_sync` on
every micro-batch but the last), as nanoGPT, Accelerate and Lightning do.

Each rank's loss is divided by the item count of the whole window (over every rank) and multiplied by the
number of ranks, and DDP averages the ranks' gradients: exactly the gradient of the window's mean (exact in
floating point for a power-of-two world). Averaging, not summing, also keeps an all-reduce of a gradient
that was already all-reduced (the control without `no_sync`) right."""
from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import TrainConfig
from .errors import ConfigError

NO_CONTEXT = nullcontext()  # (reusable: none is built per micro-batch)


def launched_ranks() -> int:
    """The number of processes torchrun started (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """This process's rank under torchrun (0 outside it)."""
    return int(os.environ.get("RANK", "0"))


def check_launch(config: TrainConfig) -> None:
    """What data parallelism needs from the launch: as many processes as world_size, GPUs for --sync-bn."""
    if launched_ranks() != config.world_size:
        raise ConfigError(f"world_size is {config.world_size} but {launched_ranks()} processes run: start "
                          f"`torchrun --nproc-per-node {config.world_size} trainers/train.py ...`, or set "
                          f"world_size to the number of processes")
    if config.sync_bn and (config.device == "cpu" or not torch.cuda.is_available()):
        raise ConfigError("--sync-bn needs GPUs (SyncBatchNorm does not run on the CPU): leave it off, and "
                          "each rank's BatchNorm normalizes its own micro-batch")


@dataclass
class AllReduces:
    """What the gradient all-reduces moved: calls (one per DDP bucket per synchronized backward) and bytes."""

    calls: int = 0
    bytes: int = 0


def _counted(counter, bucket):  # (no annotations: DDP checks them, and this module's are strings)
    """DDP's communication hook: its default all-reduce (the mean over ranks), counted."""
    buffer = bucket.buffer()
    counter.calls += 1
    counter.bytes += buffer.numel() * buffer.element_size()
    buffer.div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


class OneProcess:
    """What the loop asks of data parallelism, for one process: nothing to synchronize (a Parallel under
    torchrun). The loop calls the same methods either way."""

    world, rank = 1, 0
    ddp = None
    all_reduces = AllReduces()  # (none: stays at zero)

    def micro(self, last: bool):
        """Around a micro-batch's forward and backward."""
        return NO_CONTEXT

    def backward(self, share: torch.Tensor) -> None:
        """A micro-batch's share of its window's objective, backward."""
        share.backward()

    def sum_counts(self, counts: Any, device: torch.device) -> Any:
        return counts

    def every_rank(self, value: Any) -> list:
        return [value]

    def rank0(self, value: Any) -> Any:
        return value

    def close(self, finished: bool) -> None:
        pass


ONE_PROCESS = OneProcess()


class Parallel(OneProcess):
    """This process's rank among `world` and what data parallelism adds to the loop."""

    def __init__(self, config: TrainConfig, device: torch.device):
        check_launch(config)
        self.world = config.world_size
        self.owns_group = not dist.is_initialized()
        if self.owns_group:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        self.rank = dist.get_rank()
        # Every rank has arrived (and so finished whatever it ran before in this process, a checkpoint's write
        # included) before any reads a checkpoint.
        dist.barrier()
        self.sync_bn = config.sync_bn
        self.all_reduces = AllReduces()
        self.ddp: nn.parallel.DistributedDataParallel | None = None

    def wrap(self, model: nn.Module, device: torch.device, no_sync: bool = True) -> nn.Module:
        """The model as DDP; `no_sync=False` all-reduces after every micro-batch (the control that shows what
        synchronizing once per window saves)."""
        if self.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        self.ddp.register_comm_hook(self.all_reduces, _counted)
        self.no_sync = no_sync
        return self.ddp

    def micro(self, last: bool):
        """Around a micro-batch's forward and backward (DDP reads it in both): the gradients stay local until the
        window's last."""
        return NO_CONTEXT if last or not self.no_sync else self.ddp.no_sync()

    def backward(self, share: torch.Tensor) -> None:
        """DDP averages the ranks' gradients: the mean of `world` times each rank's share is their sum."""
        (share * self.world).backward()

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(values)
        return values

    def sum_counts(self, counts: Any, device: torch.device) -> Any:
        """A window's item counts (a number, a tensor, or a dict of them) summed over the ranks."""
        if isinstance(counts, dict):
            return {name: self.sum_counts(c, device) for name, c in counts.items()}
        return self.all_sum(torch.as_tensor(counts, device=device, dtype=torch.int64).clone())

    def every_rank(self, value: Any) -> list:
        """`value` from every rank, in rank order (a checkpoint keeps each rank's RNG states)."""
        values = [None] * self.world
        dist.all_gather_object(values, value)
        return values

    def rank0(self, value: Any) -> Any:
        """Rank 0's `value`, on every rank (a decision that must be the same everywhere)."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self, finished: bool) -> None:
        if self.owns_group and dist.is_initialized():
            if finished:  # torn down together: a rank whose peer has gone first can abort in gloo's threads
                dist.barrier()  # (after an error the peers may never arrive: torchrun ends them instead)
            dist.destroy_process_group()


def setup(config: TrainConfig, device: torch.device) -> OneProcess:
    """A Parallel for world_size > 1; ONE_PROCESS for one process (and refused when torchrun started several)."""
    if config.world_size == 1 and launched_ranks() == 1:
        return ONE_PROCESS
    return Parallel(config, device)


def local_device(device: torch.device) -> torch.device:
    """Under torchrun on GPUs, each rank takes the GPU of its local rank."""
    if device.type == "cuda" and device.index is None and launched_ranks() > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return device
