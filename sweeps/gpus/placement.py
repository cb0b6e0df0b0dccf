"""Trials on GPUs: which GPU each worker trains on, and the memory promised on each GPU, so that the trials that
share one never promise more than it has.

Each worker process sees one GPU (CUDA_VISIBLE_DEVICES, set before it starts), round-robin over the visible ones.
Before a trial trains, its peak memory is predicted (sweeps/gpus/planner.py: the fit of a batch_memory study in the
tracking store, else a quick probe, one for all the workers of a GPU) and the trial waits, in the order the
trials of that GPU asked, until the GPU has room for it. A trial that runs out of memory while it shared the
GPU runs again alone; only then is it an out-of-memory trial.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

from batchsweep.trainers import TrainConfig, interrupt, pid_alive

T = TypeVar("T")

# What a worker process holds on its GPU outside the caching allocator: the CUDA context and the kernels it
# loaded (lazily, so more models load more). Measured 769 MiB on an H200 (torch 2.11, CUDA 13) after cnn1d and
# resnet18 in bf16 (benchmarks/gpu_figures.py, docs/benchmarks.md): a third kept above that.
CONTEXT_BYTES = 2 ** 30
# A prediction is a linear fit of the allocator's peak: kept a quarter above it for the allocator's fragments.
MARGIN = 1.25
# Room for the fits the workers' probes measured, shared as JSON (a few hundred shapes); when it is full, each
# worker probes the shapes that do not fit for itself.
PROBED_BYTES = 2 ** 16


@dataclass(frozen=True)
class Gpu:
    """A GPU as this machine numbers it (its entry of CUDA_VISIBLE_DEVICES, if that is set)."""

    index: str
    name: str
    total_bytes: int
    uuid: str = ""  # CUDA's, which NVML knows it by (its own numbering ignores CUDA_VISIBLE_DEVICES)
    free_bytes: int | None = None  # free when the invocation started, by NVML (others' memory is not ours to place)

    @property
    def offered(self) -> int:
        return self.total_bytes if self.free_bytes is None else min(self.total_bytes, self.free_bytes)


def visible_gpus() -> list[Gpu]:
    """The GPUs this process may use; none without CUDA."""
    if not torch.cuda.is_available():
        return []
    ids = [i.strip() for i in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if i.strip()]
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        uuid = str(props.uuid)
        gpus.append(Gpu(ids[i] if i < len(ids) else str(i), props.name, props.total_memory, uuid, free_now(uuid)))
    return gpus


def free_now(uuid: str) -> int | None:
    """The GPU's free memory now, as NVML counts it (what every process on it holds is not free), or None."""
    handle = nvml_handle(uuid)
    if handle is None:
        return None
    import pynvml

    try:
        return pynvml.nvmlDeviceGetMemoryInfo(handle).free
    except pynvml.NVMLError:
        return None


# With --system-metrics, MLflow samples CPU, memory, disk, network (and GPU) this often during a trial; its
# environment variable MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL overrides it.
SYSTEM_METRICS_INTERVAL_S = 1.0


def system_metrics(run_id: str, uri: str, gpu_uuid: str = "", also: list[str] = ()):
    """Start MLflow's own system-metrics monitor for one run (a thread); call .finish() when the trial ends.
    With `gpu_uuid` (a worker placed on a GPU), its GPU metrics are those of that GPU alone. `also`: more runs that
    get the same samples (the members of a fused group: one monitor, whatever their number). A run that holds
    samples already (a member whose group then trained it alone) goes on after their last step."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
    from mlflow.utils.autologging_utils import BatchMetricsLogger

    class EachRun(BatchMetricsLogger):
        """MLflow's batching, each batch logged to every run."""

        def _timed_log_batch(self):
            for each in (run_id, *also):
                self.run_id = each
                super()._timed_log_batch()

    monitor = SystemMetricsMonitor(run_id, sampling_interval=SYSTEM_METRICS_INTERVAL_S, tracking_uri=uri,
                                   resume_logging=True)
    if also:
        monitor.mlflow_logger = EachRun(run_id, tracking_uri=uri)
    if gpu_uuid:
        own_gpu(monitor, gpu_uuid)
    monitor.start()
    return monitor


def own_gpu(monitor, uuid: str) -> None:
    """Narrow MLflow's NVIDIA monitor, when it started, to the GPU of CUDA's `uuid`: it reads every GPU of the
    machine through NVML, which ignores CUDA_VISIBLE_DEVICES. Its metrics are then `system/gpu_0_*`, the GPU
    as the trial's process numbers it. One that NVML does not know by that UUID keeps MLflow's every GPU."""
    from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

    for gpus in getattr(monitor, "monitors", []):
        if isinstance(gpus, GPUMonitor):  # (it exists only where pynvml imported and found a GPU)
            handle = nvml_handle(uuid)
            if handle is not None:
                gpus.gpu_handles = [handle]


def nvml_handle(uuid: str):
    """NVML's handle of the GPU of this CUDA UUID (torch gives it without NVML's "GPU-"), or None where NVML
    cannot say: no NVIDIA driver library, or a device it does not know by that UUID."""
    try:
        import pynvml

        pynvml.nvmlInit()  # (NVML counts its inits: one more is harmless)
    except Exception:  # noqa: BLE001 (pynvml's errors, or none installed: no NVML)
        return None
    for name in (uuid, f"GPU-{uuid}", f"MIG-{uuid}"):
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(name)
        except pynvml.NVMLError:
            pass
    return None


@dataclass
class Lease:
    """Memory held on one GPU for one trial."""

    slot: int
    ran_beside: bool  # another trial was running on the GPU when this one started
    started: int  # the GPU's count of trials started, this one included
    shared: bool = False  # set on release: another trial ran on the GPU at some time during this one


IDLE, WAITING, RUNNING = 0, 1, 2


class Ledger:
    """What the workers of one machine hold on its GPUs, in shared arrays under one lock: a slot per worker (its
    GPU, its state, the bytes it holds or waits for, its turn, its process). Trials start on a GPU in the order
    they asked for it, so a large trial is not passed over forever by small ones; one that needs more than the GPU
    has starts when the GPU is empty, and so does one that must run alone. A worker that died (killed, out of
    host memory) loses its slot, so the others do not wait for it forever. It also keeps the memory fits the
    workers' probes measured, so that one probe serves every worker of a GPU."""

    def __init__(self, capacities: list[int], gpu_of: list[int], context=None):
        context = context or multiprocessing.get_context("spawn")
        self.capacities, self.gpu_of = list(capacities), list(gpu_of)
        self._lock = context.Condition()
        slots, gpus = len(gpu_of), len(capacities)
        self._state, self._need, self._turn, self._pid = (context.Array("q", slots, lock=False) for _ in range(4))
        # Per GPU: trials started (to tell whether a trial shared the GPU), and the most bytes ever held at once
        # (what the tests check against the capacity); the next turn, for all GPUs.
        self._started, self._peak = (context.Array("q", gpus, lock=False) for _ in range(2))
        self._next_turn = context.Value("q", 0, lock=False)
        self._probed = context.Array("c", PROBED_BYTES, lock=False)

    def hold(self, slot: int, need: int, alone: bool = False) -> Lease:
        """Wait for this trial's turn and for room on the slot's GPU, then hold `need` bytes there. Ctrl-C still
        reaches a waiting worker, and gives its turn up."""
        gpu = self.gpu_of[slot]
        with self._lock:
            self._state[slot], self._need[slot], self._pid[slot] = WAITING, need, os.getpid()
            self._turn[slot] = self._next_turn.value
            self._next_turn.value += 1
            try:
                while not self._may_start(slot, alone):
                    self._lock.wait(timeout=1.0)  # also: a worker that died is noticed within a second
                    interrupt.check()
            except BaseException:
                self._state[slot] = IDLE
                self._lock.notify_all()
                raise
            lease = Lease(slot, ran_beside=bool(self._slots(gpu, RUNNING)), started=self._started[gpu] + 1)
            self._state[slot] = RUNNING
            self._started[gpu] += 1
            self._peak[gpu] = max(self._peak[gpu], self.held(gpu))
            self._lock.notify_all()  # the next in turn may fit beside this one
            return lease

    def _may_start(self, slot: int, alone: bool) -> bool:
        gpu = self.gpu_of[slot]
        if any(self._turn[s] < self._turn[slot] for s in self._slots(gpu, WAITING)):
            return False
        running = self._slots(gpu, RUNNING)
        return not running or (not alone and self.held(gpu) + self._need[slot] <= self.capacities[gpu])

    def _slots(self, gpu: int, state: int) -> list[int]:
        """The slots of live workers on the GPU in that state (a dead worker's slot is freed on the way)."""
        found = []
        for s, g in enumerate(self.gpu_of):
            if g == gpu and self._state[s] == state:
                if pid_alive(self._pid[s]):
                    found.append(s)
                else:
                    self._state[s] = IDLE
        return found

    def held(self, gpu: int) -> int:
        """The bytes held on the GPU by the trials running there (call it under the lock, or for a look)."""
        return sum(self._need[s] for s in self._slots(gpu, RUNNING))

    def release(self, lease: Lease) -> Lease:
        """Give the lease's memory back; the lease learns whether it shared the GPU."""
        gpu = self.gpu_of[lease.slot]
        with self._lock:
            self._state[lease.slot] = IDLE
            lease.shared = lease.ran_beside or self._started[gpu] > lease.started
            self._lock.notify_all()
        return lease

    def waiting(self, gpu: int) -> int:
        """Trials that asked for the GPU and have not started."""
        with self._lock:
            return len(self._slots(gpu, WAITING))

    def peak(self, gpu: int) -> int:
        with self._lock:
            return self._peak[gpu]

    def probed(self, key: str) -> dict | None:
        """The fit (planner.Fit's fields) a worker's probe measured for `key`, if one did."""
        with self._lock:
            return self._fits().get(key)

    def publish(self, key: str, fit: dict) -> None:
        """A probe's fit, for the other workers of its GPU."""
        with self._lock:
            text = json.dumps({**self._fits(), key: fit}).encode()
            if len(text) < PROBED_BYTES:
                self._probed.value = text

    def _fits(self) -> dict:
        text = self._probed.value
        return json.loads(text) if text else {}


# The fields that shape a trial's memory besides b: trials that differ only in others (k, the learning rate and
# its rules, BatchNorm's momentum, the seed, the epochs) share one prediction.
SHAPE = ("model", "dataset", "loss", "metrics", "label_key", "norm", "ghost_batch", "optimizer", "precision",
         "channels_last", "dtype", "device", "eval_batch", "data_dir")


@dataclass
class Placement:
    """A worker's GPU, the ledger it shares with the machine's other workers, and its predictions of a trial's
    peak memory. A [program]'s memory cannot be predicted before its script runs: its trials run alone."""

    slot: int  # the worker's slot in the ledger
    gpu: Gpu
    ledger: Ledger
    tracking_uri: str
    program: bool = False
    fits: dict = dataclasses.field(default_factory=dict)  # memory shape -> planner.Fit

    @property
    def capacity(self) -> int:
        return self.ledger.capacities[self.ledger.gpu_of[self.slot]]

    def need(self, config: TrainConfig, batch: int) -> tuple[int, bool]:
        """The bytes to hold for a trial whose largest physical batch is `batch`, and whether it must run alone."""
        capacity = self.capacity
        if self.program:
            return capacity, True
        shape = TrainConfig(**{name: getattr(config, name) for name in SHAPE})
        if shape not in self.fits:
            self.fits[shape] = self._fit(shape)
        return min(capacity, math.ceil(self.fits[shape].peak(batch) * MARGIN)), False

    def _fit(self, shape: TrainConfig):
        """The fit of a batch_memory study of this model and data in the store, else a probe of a few batches,
        which holds the GPU alone. One probe serves every worker of the GPU: the others, waiting for the GPU in
        turn, would each have paid for another, and its CUDA start-up, while no trial ran there."""
        from .planner import Fit, from_study, measure

        try:
            found = from_study(shape, self.tracking_uri, "cuda_allocator")
        except Exception:  # a store that cannot be read now: the probe answers
            found = None
        if found:
            return found
        key = f"{self.ledger.gpu_of[self.slot]}:{hashlib.sha256(repr(shape).encode()).hexdigest()}"

        def shared():
            found = self.ledger.probed(key)
            return Fit(**found) if found else None

        def probe():  # (holding the GPU alone: a probe that ran while this worker waited is taken as it is)
            fit = shared()
            if fit is None:
                fit = measure(shape)
                self.ledger.publish(key, dataclasses.asdict(fit))
            return fit

        return shared() or self._held(self.capacity, True, probe)

    def run(self, config: TrainConfig, batch: int, train: Callable[[], T], again: Callable[[], None],
            tags: dict, need: int | None = None) -> T:
        """Train where the GPU has room for a trial whose largest physical batch is `batch` (or for `need` bytes:
        a fused group's). A trial that runs out of memory while it shared the GPU trains again alone (after
        `again()`); only an out-of-memory alone passes on. `tags` receives the trial's placement: its GPU, the
        bytes held for it, whether it shared the GPU, and whether it ran again alone."""
        need, alone = self.need(config, batch) if need is None else (min(need, self.capacity), False)
        tags.update(gpu=self.gpu.index, gpu_memory_held_bytes=need)
        try:
            return self._held(need, alone, train, tags)
        except torch.OutOfMemoryError:
            if alone or not tags["shared_gpu"]:
                raise
        tags["retried_alone"] = True
        again()
        return self._held(need, True, train, tags)

    def _held(self, need: int, alone: bool, work: Callable[[], T], tags: dict | None = None) -> T:
        lease = self.ledger.hold(self.slot, need, alone)
        try:
            return work()
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # what the allocator cached is room for the next trial on this GPU
            shared = self.ledger.release(lease).shared
            if tags is not None:
                tags["shared_gpu"] = shared


def place(workers: int, gpus: list[Gpu], tracking_uri: str, program: bool) -> list[Placement]:
    """Each worker's placement, round-robin over the GPUs (worker i on gpus[i % len(gpus)]), with one ledger
    between them: a GPU's capacity is its memory (free of other processes' when the invocation started) less
    what its workers' processes hold besides tensors."""
    on = [i % len(gpus) for i in range(workers)]
    # (at least a byte: a GPU that its workers' contexts would fill runs one trial at a time)
    ledger = Ledger([max(gpu.offered - on.count(i) * CONTEXT_BYTES, 1) for i, gpu in enumerate(gpus)], on)
    return [Placement(slot, gpus[i], ledger, tracking_uri, program) for slot, i in enumerate(on)]
