"""The members' forward as fused operators (trainers/stacked.py) is what vmap over functional_call gives: the
outputs, every parameter's gradient and the running statistics, in float64, over every layer it fuses; a model
it cannot fuse is left to vmap."""
import pytest
import torch
from torch import nn

from batchsweep.trainers.stacked import fused_forward

from .factories import Subclassed

# Each with its input: convolutions with groups, stride and no bias; GroupNorm; BatchNorm with and without affine
# weights, running statistics, on the members' shared input; pooling; a Linear over a middle dim and on the shared
# input; Flatten with and without its defaults.
NETS = {
    "conv1d": ((8, 2, 8), lambda: nn.Sequential(
        nn.Conv1d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.GELU(), nn.Conv1d(4, 6, 3, 2, 1, groups=2,
                                                                              bias=False),
        nn.BatchNorm1d(6), nn.Tanh(), nn.MaxPool1d(2), nn.Linear(2, 3), nn.Flatten(), nn.Linear(18, 5))),
    "conv2d": ((8, 2, 6, 6), lambda: nn.Sequential(
        nn.BatchNorm2d(2), nn.Conv2d(2, 4, 3, groups=2), nn.BatchNorm2d(4, affine=False, momentum=0.3), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(1, 2), nn.Flatten(), nn.Linear(16, 5),
        nn.BatchNorm1d(5, track_running_stats=False))),
    "shared": ((8, 2, 10), lambda: nn.Sequential(
        nn.AvgPool1d(2), nn.Conv1d(2, 3, 3), nn.LeakyReLU(0.1), nn.Flatten(), nn.Linear(9, 4), nn.SiLU(),
        nn.Linear(4, 5))),
    "mlp": ((8, 12), lambda: nn.Sequential(nn.Linear(12, 6), nn.ELU(), nn.Identity(), nn.Linear(6, 5, bias=False),
                                           nn.Sigmoid())),
}


def run(forward, members, x):
    params, buffers = torch.func.stack_module_state(members)
    params = {name: p.detach().requires_grad_() for name, p in params.items()}
    buffers = {name: b.clone() for name, b in buffers.items()}
    out = forward(params, buffers, x)
    (out * torch.linspace(-1, 2, out.shape[-1], dtype=out.dtype)).square().sum().backward()
    return [out.detach(), *(p.grad for p in params.values()), *buffers.values()]


@pytest.mark.parametrize("name", NETS)
def test_fused_operators_give_what_vmap_gives(name):
    shape, build = NETS[name]
    members = []
    for seed in range(3):
        torch.manual_seed(seed)
        members.append(build().double())
    x = torch.randn(*shape, dtype=torch.float64)
    fused = fused_forward(members[0])
    assert fused is not None
    mine = run(fused, members, x)
    theirs = run(torch.func.vmap(lambda p, b, x: torch.func.functional_call(members[0], (p, b), (x,)),
                                 in_dims=(0, 0, None)), members, x)
    assert mine[0].shape == theirs[0].shape == (3, 8, *theirs[0].shape[2:])
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs):  # (num_batches_tracked among the buffers: counted once a forward)
        assert float((a - b).double().norm()) <= 1e-12 * (1 + float(b.double().norm())), tuple(b.shape)


def test_what_has_no_fused_form_is_left_to_vmap():
    layers = lambda: [nn.Linear(4, 4), nn.ReLU()]  # noqa: E731
    hooked = nn.Sequential(*layers())
    hooked[1].register_forward_hook(lambda *_: None)  # a hook would not see a fused layer
    relu, linear, tied = nn.ReLU(), nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    tied[2].weight = tied[0].weight  # (named once, run twice: as a layer at two places)
    for model in (Subclassed(*layers()), hooked, nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)),
                  nn.Sequential(linear, relu, nn.Linear(4, 4), relu), nn.Sequential(linear, relu, linear), tied,
                  nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None)),
                  nn.Sequential(nn.Conv1d(1, 2, 3, padding=1, padding_mode="reflect")),
                  nn.Sequential(nn.Flatten(0), nn.Linear(4, 4))):
        assert fused_forward(model) is None, model
    assert fused_forward(nn.Sequential(*layers())) is not None
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *_: None)
    try:
        assert fused_forward(nn.Sequential(*layers())) is None
    finally:
        handle.remove()


def test_a_layer_that_would_read_a_members_batch_as_one_sample_is_refused():
    """MaxPool1d on a (b, F) batch pools each sample's features as one unbatched (C = b, L = F) sample: side by
    side its windows would cross from one member into the next."""
    members = [nn.Sequential(nn.Linear(8, 4), nn.MaxPool1d(2)).double() for _ in range(2)]
    params, buffers = torch.func.stack_module_state(members)
    with pytest.raises(RuntimeError, match="MaxPool1d on a batch of rank 2 has no fused form"):
        fused_forward(members[0])(params, buffers, torch.randn(6, 8, dtype=torch.float64))
