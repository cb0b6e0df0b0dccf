"""The memory planner: the largest physical batch that fits a memory budget, and the accumulation steps
that reach a target batch. Peak memory = fixed + per_sample * b, fitted from a `batch_memory` study of the
same model, dataset and memory source, or from a quick probe of a few batch sizes when there is none."""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass

import numpy as np
import torch

from batchsweep.trainers import MAX_COUNT, ConfigError, TrainConfig, format_bytes, load, resolve_device, train

from ..stores.mlflow_store import quote
from ..stores.urls import redact, sqlite_path

UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}
PROBE_BATCHES = (8, 32, 128)
PROBE_STEPS = 3
MAX_BUDGET = 2 ** 60  # an exbibyte: more than any machine has


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if not match or (match.group(2) or "").upper() not in UNITS:
        raise ConfigError(f"memory budget {text!r} is not a size: write e.g. 6GiB, 512MiB or 2e9")
    size = float(match.group(1)) * UNITS[(match.group(2) or "").upper()]
    if not (math.isfinite(size) and 1 <= size <= MAX_BUDGET):
        raise ConfigError(f"memory budget {text!r} is out of range: give between 1 byte and 1 EiB, e.g. 6GiB")
    return int(size)


@dataclass
class Fit:
    fixed: float  # bytes that do not grow with b: weights, gradients, optimizer state, (CUDA) the dataset
    per_sample: float  # bytes per sample of the physical batch
    source: str  # where the points came from
    memory_source: str  # saved_tensors or cuda_allocator
    points: list[tuple[int, float]]
    ceiling: int | None = None  # the smallest b that ran out of memory in a run of the store: plans stay below

    def peak(self, b: int) -> float:
        return self.fixed + self.per_sample * b


def fit(points: list[tuple[int, float]], source: str, memory_source: str) -> Fit:
    b, peak = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
    per_sample, fixed = np.polyfit(b, peak, 1)
    return Fit(float(fixed), float(per_sample), source, memory_source, points)


def from_study(config: TrainConfig, tracking_uri: str, memory_source: str) -> Fit | None:
    """The finished runs of a batch_memory study with this model, dataset and memory source, if any."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name("batch_memory")
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id], max_results=1000, filter_string=(
        f"attributes.status = 'FINISHED' and params.model = {quote(config.model)} and params.dataset = "
        f"{quote(config.dataset)} and tags.memory_source = {quote(memory_source)}"))
    # A run whose micro-batches shrank on out-of-memory measured the b it trained at.
    points = sorted((int(r.data.params.get("physical_batch_used", r.data.params["physical_batch"])),
                     r.data.metrics["peak_memory_bytes"]) for r in runs if "peak_memory_bytes" in r.data.metrics)
    if len({b for b, _ in points}) < 2:
        return None
    fitted = fit(points, f"batch_memory study in {redact(tracking_uri)} ({len(points)} runs)", memory_source)
    # What ran out of memory in any study of this model and data on this kind of device.
    experiments = [e.experiment_id for e in client.search_experiments()]
    failed = client.search_runs(experiments, max_results=1000, filter_string=(
        f"metrics.oom_physical_batch > 0 and params.model = {quote(config.model)} and params.dataset = "
        f"{quote(config.dataset)} and tags.memory_source = {quote(memory_source)}"))
    sizes = [int(r.data.metrics["oom_physical_batch"]) for r in failed]
    fitted.ceiling = min(sizes) if sizes else None
    return fitted


def measure(config: TrainConfig, data=None) -> Fit:
    """Measure a few physical batches for a few steps each (none larger than the training set), on the config's
    data loaded once (or on `data`, what `batchsweep.trainers.load(config)` gave)."""
    data = data or load(config)
    n = data.n_train
    batches = sorted({min(b, n) for b in PROBE_BATCHES})
    if len(batches) < 2:
        raise ConfigError(f"the training set of {config.dataset} holds {n} samples: too few to measure memory at "
                          f"two batch sizes")
    points, memory_source = [], "?"
    for b in batches:
        result = train(dataclasses.replace(config, physical_batch=b, accum_steps=1, epochs=1, max_steps=PROBE_STEPS),
                       data=data)
        points.append((b, result.metrics["peak_memory_bytes"]))
        memory_source = result.memory_source
        del result  # it holds the model, which on a GPU would count in the next probe's peak
    return fit(points, f"probe of b = {', '.join(map(str, batches))} ({PROBE_STEPS} steps each)", memory_source)


@functools.lru_cache(maxsize=None)
def start_batch(config: TrainConfig, target: int, tracking_uri: str) -> int:
    """Where `physical_batch = "auto"` starts: on a GPU, the plan for its whole memory from a batch_memory study of
    this model and data (below any b that ran out of memory), as a divisor of the target; b = B otherwise."""
    device = resolve_device(config.device)
    store = sqlite_path(tracking_uri)  # (no store yet: nothing to learn from, and none is created here)
    if device.type != "cuda" or (store is not None and not store.exists()):
        return target
    fitted = from_study(config, tracking_uri, "cuda_allocator")
    if fitted is None:
        return target
    b = plan(fitted, target, torch.cuda.get_device_properties(device).total_memory).physical_batch
    return max(d for d in _divisors(target) if d <= b)


def _divisors(n: int) -> list[int]:
    """Every divisor of n, in sqrt(n) steps."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in small]


@dataclass
class MemoryPlan:
    physical_batch: int
    accum_steps: int
    note: str | None

    @property
    def effective_batch(self) -> int:
        return self.physical_batch * self.accum_steps


def check_target(target: int) -> None:
    if not 1 <= target <= MAX_COUNT:  # (the divisor search takes sqrt(target) steps)
        raise ConfigError(f"--target-batch must be between 1 and {MAX_COUNT}, got {target}")


def plan(model: Fit, target: int, budget: int) -> MemoryPlan:
    """The largest b within the budget that divides the target; the nearest b*k with a note otherwise."""
    check_target(target)
    largest = int((budget - model.fixed) // model.per_sample) if model.per_sample > 0 else target
    if model.ceiling:
        largest = min(largest, model.ceiling - 1)
    if largest < 1:
        raise ConfigError(f"even b = 1 needs about {format_bytes(model.peak(1))}, more than the budget of "
                          f"{format_bytes(budget)}: raise --memory-budget or use a smaller model")
    largest = min(largest, target)
    divisor = max(d for d in _divisors(target) if d <= largest)
    if divisor * 2 > largest:  # within a factor 2 of the largest that fits: keep b*k exactly the target
        return MemoryPlan(divisor, target // divisor, None)
    k = max(1, round(target / largest))
    return MemoryPlan(largest, k, f"no divisor of {target} near the largest batch that fits ({largest}): "
                            f"B = {largest * k} instead of {target}")
