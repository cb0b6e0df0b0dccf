"""The tracer's reading of tensors and models: a model's input, an LR, the generators' states, what in the models
draws random numbers, and sums of squares per device read as Python floats only when a row is written."""
from __future__ import annotations

import sys


def first_tensor(args, kwargs):
    """The model's input: its first tensor argument, or its first tensor keyword (input_ids, x, ...)."""
    import torch

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def value(lr):
    """An LR as it is now: one held in a tensor, which a scheduler changes in place, copied (on its device)."""
    return lr.detach().clone() if hasattr(lr, "detach") else lr


RANDOM_FIELDS = ("dropout", "pdrop", "layerdrop")  # (wav2vec2's layerdrop, BART's encoder_layerdrop: LayerDrop)


def randomness(models: list) -> tuple[list[str], list[str]]:
    """(the models' modules in training mode that draw random numbers, named with their p: dropout of any kind,
    and any module whose `p`, `dropout` or `drop_prob` is a probability above 0, as torchvision's StochasticDepth,
    nn.MultiheadAttention(dropout=...) and timm's DropPath hold it; the dropout fields above 0 that a transformers
    model's config names: resid_pdrop, layerdrop, ...)."""
    modules = [f"{name or 'model'}: {type(sub).__name__}({key}={chance})"
               for i, model in enumerate(models) for name, sub in model.named_modules(
                   prefix=f"{i}" if len(models) > 1 else "")
               if sub.training for key, chance in [drawn(sub)] if key]
    configs = [getattr(model, "config", None) for model in models]
    fields = sorted({f"{key}={value}" for config in configs if hasattr(config, "to_dict")
                     for key, value in config.to_dict().items() if any(word in key for word in RANDOM_FIELDS)
                     and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0})
    return modules, fields


def drawn(module) -> tuple[str | None, float]:
    """The attribute that makes a module random by kind, and its probability; (None, 0) where none is above 0."""
    for key in ("p", "dropout", "drop_prob"):
        chance = getattr(module, key, None)
        if isinstance(chance, (int, float)) and not isinstance(chance, bool) and 0 < chance <= 1:
            return key, chance
    return None, 0


def generator_states(cuda) -> dict:
    """The default generators' states, by name: torch's (the CPU's, and the GPU's where the model trains on one),
    Python's `random` and, where the script imported NumPy, its global one (a LayerDrop by random.uniform or
    np.random.uniform draws from those). Read over the first windows only: a few microseconds each."""
    import random

    import torch

    states = [torch.random.get_rng_state()]
    if cuda is not None:
        states.append(torch.cuda.get_rng_state(cuda))
    found = {"torch": tuple(bytes(state.numpy()) for state in states), "random": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, *rest = numpy.random.get_state(legacy=True)
        found["numpy"] = (kind, keys.tobytes(), *rest)
    return found


def grad_norm(optimizer):
    """The 2-norm of the gradients the optimizer is about to apply (read when written)."""
    import torch

    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return None
    with torch.no_grad():
        return Squares(squares([g.detach() for g in grads]), root=True)


class Squares(list):
    """Sums of squares, one 0-d float64 tensor per device, added up as Python floats when the row is written: a
    model spread over devices (device_map="auto", an offloaded embedding) has gradients on each, and no tensor of
    one device is stacked with another's inside the script's backward() or step(). `root`: the 2-norm."""

    def __init__(self, parts, root: bool = False):
        super().__init__(parts)
        self.root = root

    def read(self) -> float:
        total = sum(float(part) for part in self)
        return total ** 0.5 if self.root else total


def squares(tensors) -> Squares:
    """The tensors' total sum of squares, per device: one foreach norm over each device's tensors (a foreach norm
    over tensors of several devices is not one: torch 2.14 returned 2e+36 for a CPU tensor of ones beside a meta
    tensor)."""
    import torch

    by_device: dict = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    return Squares(torch.stack(torch._foreach_norm(group)).double().pow(2).sum() for group in by_device.values())


def plain(value):
    """A row's value as JSON takes it: tensors read here, once per FLUSH_EVERY steps."""
    if isinstance(value, Squares):
        return value.read()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value
