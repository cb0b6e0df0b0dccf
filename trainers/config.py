"""TrainConfig: one training configuration, validated, with its derived values."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .errors import BatchsweepError, ConfigError  # noqa: F401  (re-exported: callers import them from here)

LR_RULES = ("none", "linear", "sqrt", "adam_sqrt", "adam_halflife")
ADAM_RULES = ("adam_sqrt", "adam_halflife")  # rules that move AdamW's betas too
WD_RULES = ("none", "timescale")
BN_RULES = ("default", "scaled", "matched")
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "cosine")
NORMS = ("batch", "group", "none")
PRECISIONS = ("fp32", "bf16")
# The values TrainConfig.derived() computes from the fields; the last four with AdamW only.
DERIVED = ("effective_batch", "lr", "bn_momentum", "beta1", "beta2", "eps", "decay")
DTYPES = ("float32", "float64")
DEVICES = ("auto", "cpu", "cuda")
MAX_COUNT = 2 ** 31 - 1  # batch sizes, steps, epochs: beyond this no run gets there, and torch's indices overflow
MAX_SEED = 2 ** 32 - 1  # the range every RNG in the stack accepts (numpy's is the narrowest)


def _choice(name: str, value: str, allowed: tuple[str, ...], extra: str = "") -> None:
    if value not in allowed:
        raise ConfigError(f"unknown {name} {value!r}: choose one of {', '.join(allowed)}{extra}")


def _at_least(name: str, value: float, low: float) -> None:
    if not value >= low:  # also rejects NaN
        raise ConfigError(f"{name} must be >= {low}, got {value}")


@dataclass(frozen=True)
class TrainConfig:
    """One configuration. Field names are the CLI flags (with dashes), MLflow params and report columns."""

    model: str = "cnn1d"  # registry name, package.module:factory, or hf:NAME|PATH (a transformers config)
    dataset: str = "mnist1d"  # registry name or package.module:factory
    loss: str = "auto"  # auto: the model's own `loss`, else cross-entropy or squared error; or package.module:fn
    metrics: str = ""  # package.module:fn, comma-separated: fn(output, target) -> {name: (sum, count)}, as val_<name>
    label_key: str = "labels"  # the target's entry in a sample that is a mapping (the rest are model arguments)
    norm: str = "batch"  # cnn1d only: batch | group | none
    physical_batch: int = 32  # b: samples per forward/backward
    accum_steps: int = 1  # k: micro-batches per optimizer step
    world_size: int = 1  # N: data-parallel processes (torchrun's); B = b * k * N
    sync_bn: bool = False  # with N > 1: SyncBatchNorm, normalizing over the ranks' micro-batches together (GPUs)
    shrink_on_oom: bool = False  # on out-of-memory, halve b and double k (B stays) and run the window again
    drop_last: bool = False  # drop the short last window of an epoch
    shuffle: bool = True  # one seeded permutation per epoch
    lr_rule: str = "none"  # none | linear | sqrt | adam_sqrt | adam_halflife (LR_RULES), relative to base_batch
    base_lr: float = 0.05
    base_batch: int = 32
    warmup_epochs: float = 0.0  # linear warmup (Goyal et al. 2017)
    schedule: str = "constant"  # after warmup: constant | cosine
    bn_momentum_rule: str = "default"  # default | scaled | matched
    bn_base_momentum: float = 0.1  # m: PyTorch's default BatchNorm momentum
    ghost_batch: int = 0  # >0: BatchNorm normalizes in chunks of this size (Ghost BN)
    optimizer: str = "sgd"  # sgd | adamw
    momentum: float = 0.9  # SGD momentum
    nesterov: bool = False
    adam_beta1: float = 0.9  # AdamW's betas and eps at base_batch (adam_sqrt, adam_halflife scale them with B)
    adam_beta2: float = 0.999
    halflife_beta1: bool = False  # adam_halflife keeps beta1's half-life in samples too (beta2's always)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0  # at base_batch and base_lr (wd_rule scales it with B)
    wd_rule: str = "none"  # none | timescale: AdamW's decay timescale 1/(lr * decay) kept fixed in epochs
    grad_clip: float = 0.0  # max global grad norm per step; 0 = off
    epochs: int = 10
    batch_warmup: str = ""  # B of the first epochs, comma-separated (e.g. "64,128"); the rest at b * k * N
    eval_every_steps: int = 0  # also evaluate every this many optimizer steps (step_val_* metrics)
    max_steps: int = 0  # stop after this many optimizer steps (0: run every epoch); for quick probes
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "fp32"  # fp32 | bf16 (autocast)
    channels_last: bool = False  # for 2-D conv nets
    dtype: str = "float32"  # parameter and input dtype; float64 for exactness checks
    eval_batch: int = 1024
    num_workers: int = 0  # DataLoader processes for datasets that are not tensors (persistent between epochs)
    pin_memory: bool = False  # page-locked batches and non-blocking copies to the GPU
    prefetch_factor: int = 2  # micro-batches each loader process keeps ready
    data_dir: str = "data"  # datasets and the MNIST-1D cache

    def __post_init__(self) -> None:
        # Here, not above: the commands' --help and bad flags answer before torch is imported.
        from .data import DATASETS
        from .hf import check as check_hf
        from .models import MODELS

        if self.model.startswith("hf:"):
            check_hf(self.model)
        elif ":" not in self.model:
            _choice("model", self.model, tuple(MODELS), ", or give package.module:factory or hf:NAME")
        if ":" not in self.dataset:
            _choice("dataset", self.dataset, tuple(DATASETS), ", or give package.module:factory")
        if self.loss != "auto" and ":" not in self.loss:
            raise ConfigError(f"unknown loss {self.loss!r}: use auto, or give package.module:fn")
        for spec in filter(None, (m.strip() for m in self.metrics.split(","))):
            if ":" not in spec:
                raise ConfigError(f"metrics {spec!r} is not an import path: give package.module:fn (comma-separated)")
        _choice("norm", self.norm, NORMS)
        _choice("lr_rule", self.lr_rule, LR_RULES)
        _choice("wd_rule", self.wd_rule, WD_RULES)
        _choice("bn_momentum_rule", self.bn_momentum_rule, BN_RULES)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("precision", self.precision, PRECISIONS)
        _choice("dtype", self.dtype, DTYPES)
        _choice("device", self.device, DEVICES)
        for name in ("physical_batch", "accum_steps", "world_size", "base_batch", "epochs", "eval_batch", "prefetch_factor"):
            _at_least(name, getattr(self, name), 1)
        for name in ("ghost_batch", "seed", "max_steps", "num_workers", "eval_every_steps"):
            _at_least(name, getattr(self, name), 0)
        for name in FIELDS:
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value}")
            if type(value) is int and value > (MAX_SEED if name == "seed" else MAX_COUNT):
                raise ConfigError(f"{name} must be at most {MAX_SEED if name == 'seed' else MAX_COUNT}, got {value}")
        for name in ("warmup_epochs", "weight_decay", "grad_clip", "momentum"):
            _at_least(name, getattr(self, name), 0.0)
        if not self.base_lr > 0:
            raise ConfigError(f"base_lr must be a positive number, got {self.base_lr}")
        if not math.isfinite(self.lr):
            raise ConfigError(f"the {self.lr_rule} rule scales base_lr {self.base_lr:g} to an infinite learning rate "
                              f"at B = {self.effective_batch}: lower --base-lr")
        if not self.momentum < 1:
            raise ConfigError(f"momentum must be below 1 (at 1 and above every step grows), got {self.momentum}")
        self._check_adam()
        if self.lr * self.decay >= 1:
            raise ConfigError(f"weight_decay {self.decay:g} times the learning rate {self.lr:.4g} is >= 1: each "
                              f"step would shrink the weights through zero; lower --weight-decay")
        if not 0 < self.bn_base_momentum <= 1:
            raise ConfigError(f"bn_base_momentum must be in (0, 1], got {self.bn_base_momentum}")
        if self.warmup_epochs > self.epochs:
            raise ConfigError(f"warmup_epochs ({self.warmup_epochs}) is longer than the run ({self.epochs} epochs): "
                              f"raise --epochs or lower warmup_epochs (e.g. --set warmup_epochs=0)")
        if self.shrink_on_oom and self.world_size > 1:
            raise ConfigError("--physical-batch auto (shrink on out-of-memory) runs one process: under torchrun give "
                              "--physical-batch and --accum-steps")
        if self.nesterov and (self.optimizer != "sgd" or self.momentum == 0):
            raise ConfigError("nesterov needs optimizer=sgd with momentum > 0")
        self._check_warmup()

    def _check_adam(self) -> None:
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.adam_eps > 0:
            raise ConfigError(f"adam_eps must be a positive number, got {self.adam_eps}")
        for rule, value in ((f"lr_rule={self.lr_rule}", self.lr_rule in ADAM_RULES),
                            ("wd_rule=timescale", self.wd_rule == "timescale")):
            if value and self.optimizer != "adamw":
                raise ConfigError(f"{rule} is a rule for AdamW: set optimizer=adamw, or use "
                                  f"{'lr_rule=sqrt' if rule.startswith('lr') else 'wd_rule=none'} with SGD")
        for name, base, scaled in (("adam_beta1", self.adam_beta1, self.beta1), ("adam_beta2", self.adam_beta2,
                                                                                 self.beta2)):
            if self.lr_rule == "adam_sqrt" and scaled < 0:
                raise ConfigError(
                    f"adam_sqrt at B = {self.effective_batch} (kappa = B / base_batch = {self.kappa:g}) scales 1 - "
                    f"{name} = {1 - base:g} to {self.kappa * (1 - base):g}: beyond 1 the rule does not hold "
                    f"(Malladi et al. 2022); raise {name} to at least 1 - 1/kappa = {1 - 1 / self.kappa:g}, or base_batch")
            if self.lr_rule == "adam_halflife" and scaled != base and not 0 < scaled < 1:
                raise ConfigError(
                    f"adam_halflife at B = {self.effective_batch} (kappa = B / base_batch = {self.kappa:g}) takes "
                    f"{name} = {base:g} to {name}^kappa = {scaled:g}, outside (0, 1) in floating point: "
                    f"{'raise' if scaled <= 0 else 'lower'} {name}, or give a base_batch nearer B")

    def _check_warmup(self) -> None:
        sizes = self.warmup_batches
        unit, world = self.physical_batch * self.world_size, self.world_size
        for before, size in zip((1, *sizes), sizes):
            if not before <= size <= self.effective_batch or (size % unit if size >= unit else size % world):
                raise ConfigError(
                    f"batch_warmup {self.batch_warmup!r}: each B must grow, up to B = {self.effective_batch}, and be "
                    f"a multiple of b * N = {unit} (or below it, a multiple of N = {world}); e.g. "
                    f"batch_warmup = \"{unit},{2 * unit}\" with b * k * N >= {2 * unit}")
        if len(sizes) >= self.epochs:
            raise ConfigError(f"batch_warmup lists {len(sizes)} epochs of a {self.epochs}-epoch run: list fewer, "
                              f"or raise --epochs")
        if sizes and self.shrink_on_oom:
            raise ConfigError("batch_warmup changes b or k by epoch; --physical-batch auto changes them on "
                              "out-of-memory: give --physical-batch")

    @property
    def warmup_batches(self) -> tuple[int, ...]:
        """batch_warmup's B for the first epochs."""
        try:
            return tuple(int(part) for part in self.batch_warmup.split(",") if part.strip())
        except ValueError:
            raise ConfigError(f"batch_warmup {self.batch_warmup!r} is not a list of batch sizes: write e.g. "
                              f"\"64,128\" (B of epochs 1 and 2)") from None

    def at_epoch(self, epoch: int) -> TrainConfig:
        """The configuration an epoch trains with: under batch_warmup, its B, reached by accumulation at b
        (k = B / (b * N)), or at a smaller b with k = 1 where B < b * N; the rules then follow that B."""
        sizes = self.warmup_batches
        if epoch > len(sizes):
            return self
        size, unit = sizes[epoch - 1], self.physical_batch * self.world_size
        k = max(size // unit, 1)
        return dataclasses.replace(self, physical_batch=size // (k * self.world_size), accum_steps=k,
                                   batch_warmup="")

    @property
    def kappa(self) -> float:
        """B / base_batch: how far the scaling rules move the base values."""
        return self.effective_batch / self.base_batch

    @property
    def beta1(self) -> float:
        """AdamW's beta1 used: adam_sqrt scales 1 - beta1 by kappa (Malladi et al. 2022); adam_halflife, where
        halflife_beta1 asks, keeps its half-life in samples: beta1 ** kappa (Marek et al. 2025)."""
        if self.lr_rule == "adam_halflife" and self.halflife_beta1:
            return self._halflife(self.adam_beta1)
        return 1 - self.kappa * (1 - self.adam_beta1) if self.lr_rule == "adam_sqrt" else self.adam_beta1

    @property
    def beta2(self) -> float:
        if self.lr_rule == "adam_halflife":
            return self._halflife(self.adam_beta2)
        return 1 - self.kappa * (1 - self.adam_beta2) if self.lr_rule == "adam_sqrt" else self.adam_beta2

    def _halflife(self, beta: float) -> float:
        """beta ** kappa: a step of B samples decays the average as kappa steps of base_batch did. At kappa = 1
        it is beta itself (no rounding through exp and log)."""
        return beta if self.kappa == 1 else beta ** self.kappa

    @property
    def eps(self) -> float:
        """AdamW's eps used: with adam_sqrt, eps / sqrt(kappa)."""
        return self.adam_eps / math.sqrt(self.kappa) if self.lr_rule == "adam_sqrt" else self.adam_eps

    @property
    def decay(self) -> float:
        """The weight decay used. timescale keeps AdamW's 1 / (lr * decay) steps fixed in epochs (Wang &
        Aitchison 2025): steps per epoch fall as 1 / B, so decay = weight_decay * (base_lr / lr) * kappa."""
        if self.wd_rule == "timescale":
            return self.weight_decay * self.base_lr / self.lr * self.kappa
        return self.weight_decay

    @property
    def effective_batch(self) -> int:
        """B = b * k * N: samples per optimizer step, over every process."""
        return self.physical_batch * self.accum_steps * self.world_size

    @property
    def lr(self) -> float:
        """The peak learning rate after the scaling rule."""
        ratio = self.kappa
        scale = {"none": 1.0, "linear": ratio}.get(self.lr_rule, math.sqrt(ratio))  # sqrt and both Adam rules
        return self.base_lr * scale

    @property
    def bn_momentum(self) -> float:
        """BatchNorm momentum used with k running-stat updates per optimizer step."""
        m, k = self.bn_base_momentum, self.accum_steps
        if self.bn_momentum_rule == "scaled":  # MosaicML composer's m / k
            return m / k
        if self.bn_momentum_rule == "matched":  # k updates decay old stats by (1 - m), like one true-batch update
            return 1.0 - (1.0 - m) ** (1.0 / k)
        return m

    def derived(self) -> dict[str, Any]:
        names = DERIVED if self.optimizer == "adamw" else DERIVED[:3]  # AdamW: what it ran with, after the rules
        return {name: getattr(self, name) for name in names}

    def to_dict(self) -> dict[str, Any]:
        """Every field plus the derived values: the params a run is logged with."""
        return {**dataclasses.asdict(self), **self.derived()}


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def parse_value(name: str, text: str) -> Any:
    """Turn the text of a command-line value into the field's type, or raise ConfigError."""
    if name not in FIELDS:
        raise ConfigError(f"unknown setting {name!r}: known settings are {', '.join(FIELDS)}")
    kind = type(FIELDS[name].default)
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name} takes true or false, got {text!r}")
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{name} takes {'an integer' if kind is int else 'a number' if kind is float else 'text'}, got {text!r}") from None


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """'key=value' strings as field values, type-checked (the config is validated once, with all of them)."""
    changes = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"malformed setting {pair!r}: write key=value, e.g. --set weight_decay=5e-4")
        changes[key] = parse_value(key, value.strip())
    return changes
