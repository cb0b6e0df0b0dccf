"""Fused members train exactly as they would alone: every member's weights after each of its steps, its history
and its result, against its solo `train`; a member that diverges ends alone; what cannot be fused is refused
before any step."""
import math

import numpy as np
import pytest
import torch
from torch import nn

from batchsweep.trainers import TrainConfig, train
from batchsweep.trainers.fused import NotFusable, alone, group_key, train_fused
from batchsweep.trainers.probes import Probe

BASE = dict(model="tests.factories:bn_mlp", dataset="tests.factories:blobs300", physical_batch=32, epochs=2,
            dtype="float64", device="cpu", warmup_epochs=1, base_lr=0.1, seed=3)
# Every k (the epoch's last window short: 300 samples at b = 32 are 10 micro-batches, the last of 12), each LR
# rule, a cosine schedule, clipping and AdamW among them.
MEMBERS = [dict(accum_steps=1, lr_rule="none"), dict(accum_steps=2, lr_rule="linear"),
           dict(accum_steps=4, lr_rule="sqrt", schedule="cosine"), dict(accum_steps=3, lr_rule="linear", grad_clip=0.5),
           dict(accum_steps=2, optimizer="adamw", lr_rule="adam_sqrt", base_lr=0.01, weight_decay=0.01)]


class Weights(Probe):
    """Every parameter after each optimizer step."""

    def start(self, run):
        super().start(run)
        self.seen = []

    def after_step(self, step):
        self.seen.append(torch.cat([p.detach().flatten().clone() for p in self.run.model.parameters()]))


def solo(config: TrainConfig):
    probe = Weights()
    return train(config, probes=[probe]), probe.seen


TIMES = {"epoch_time_s", "samples_per_s"}  # (the group's time)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("model", ["tests.factories:bn_mlp", "mlp", "tests.factories:bn_mlp_through_vmap"])
def test_every_member_steps_as_its_solo_run_in_float64(model):
    """As fused operators (the first two) and through vmap (the last)."""
    configs = [TrainConfig(**{**BASE, "model": model, **m}) for m in MEMBERS]
    assert len({group_key(c) for c in configs}) == 1
    probes, rows = [[Weights()] for _ in configs], [[] for _ in configs]
    fused = train_fused(configs, on_epoch=[r.append for r in rows], probes=probes)
    for config, (probe,), result, seen_rows in zip(configs, probes, fused, rows):
        alone_result, alone_seen = solo(config)
        assert len(probe.seen) == len(alone_seen) == 2 * math.ceil(10 / config.accum_steps)
        assert max(relative(a, b) for a, b in zip(probe.seen, alone_seen)) < 1e-10, config
        assert seen_rows == result.history
        for mine, theirs in zip(result.history, alone_result.history):  # the diagnostics and noise scale too
            assert set(mine) == set(theirs)
            assert mine["peak_memory_bytes"] == theirs["peak_memory_bytes"]  # its own, measured alone
            assert {n: mine[n] for n in set(mine) - TIMES} == pytest.approx(
                {n: theirs[n] for n in set(mine) - TIMES}, rel=1e-9, abs=1e-12, nan_ok=True)
        if model != "mlp":  # the running statistics are the member's own: its evaluation is its solo one
            for a, b in zip(result.model.buffers(), alone_result.model.buffers()):
                assert relative(a.double(), b.double()) < 1e-10


def test_one_step_of_every_member_in_float32_is_its_solo_step():
    configs = [TrainConfig(**{**BASE, "dtype": "float32", "epochs": 1, **m}) for m in MEMBERS]
    probes = [[Weights()] for _ in configs]
    train_fused(configs, probes=probes)
    for config, (probe,) in zip(configs, probes):
        assert relative(probe.seen[0], solo(config)[1][0]) < 1e-6, config


# Members whose windows end at the same micro-batch step in one batched update where their optimizer's settings
# agree (k = 1 and 2 under none without warmup: the same LR at every step), one update each where they differ
# (momentum, nesterov, weight decay, AdamW's betas and eps), and alone with clipping.
TOGETHER = [dict(accum_steps=1, lr_rule="none", weight_decay=0.01, warmup_epochs=0),
            dict(accum_steps=2, lr_rule="none", weight_decay=0.01, warmup_epochs=0),
            dict(accum_steps=2, momentum=0.5, nesterov=True), dict(accum_steps=2, momentum=0.0),
            dict(accum_steps=3, weight_decay=0.05), dict(accum_steps=3, grad_clip=0.5),
            dict(accum_steps=1, optimizer="adamw", base_lr=0.01, weight_decay=0.01, warmup_epochs=0),
            dict(accum_steps=2, optimizer="adamw", base_lr=0.01, weight_decay=0.01, warmup_epochs=0),
            dict(accum_steps=2, optimizer="adamw", base_lr=0.01, adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-6)]


def test_members_that_end_a_window_together_step_as_one_and_as_their_solo_runs(monkeypatch):
    """Every member's weights after each step, and its optimizer's state at the end (momentum buffers, AdamW's
    moments and step), are its solo run's; members of equal settings share one update, and only the member
    that clips steps through its own optimizer.step()."""
    from torch.optim import adam, sgd

    configs = [TrainConfig(**{**BASE, **m}) for m in TOGETHER]
    sizes, stepped = [], []
    for module, name in ((sgd, "sgd"), (adam, "adam")):
        def spy(params, *args, _real=getattr(module, name), _name=name, **kwargs):
            sizes.append((_name, len(params)))
            return _real(params, *args, **kwargs)
        monkeypatch.setattr(module, name, spy)
    for kind in (torch.optim.SGD, torch.optim.AdamW):
        def step(self, *args, _real=kind.step, **kwargs):
            stepped.append(self)
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(kind, "step", step)
    probes = [[Weights()] for _ in configs]
    fused = train_fused(configs, probes=probes)
    members = {id(probe.run.optimizer): i for i, (probe,) in enumerate(probes)}
    assert {members[id(o)] for o in stepped if id(o) in members} == {5}  # the clipping member's own step alone
    per_member = len(list(fused[0].model.parameters()))
    assert max(n for name, n in sizes if name == "sgd") == 2 * per_member  # the first two SGD members as one
    assert max(n for name, n in sizes if name == "adam") == 2 * per_member  # and the two AdamW members
    monkeypatch.undo()
    for config, (probe,) in zip(configs, probes):
        alone = Weights()
        train(config, probes=[alone])
        assert len(probe.seen) == len(alone.seen) == 2 * math.ceil(10 / config.accum_steps)
        assert max(relative(a, b) for a, b in zip(probe.seen, alone.seen)) < 1e-10, config
        mine, theirs = probe.run.optimizer.state_dict()["state"], alone.run.optimizer.state_dict()["state"]
        assert mine.keys() == theirs.keys() and all(s.keys() == theirs[i].keys() for i, s in mine.items()), config
        for name in {name for state in theirs.values() for name in state}:  # (over every tensor: a bias before
            a, b = (torch.cat([s[i][name].double().flatten() for i in s]) for s in (mine, theirs))  # BN has ~0)
            assert relative(a, b) < 1e-10, (config, name)


def test_batchnorm_in_the_stacked_forward_is_one_batch_norm_over_the_members_channels(monkeypatch):
    """Through vmap (a model that is no nn.Sequential itself), the stacked forward's BatchNorm (2d, 1d, without
    affine weights, without running statistics) runs as one batch_norm over the members' channels side by side, with the outputs, gradients and running statistics of
    vmap's own batching rule (each member's own statistics, updated in place)."""
    import torch.nn.functional as F
    from batchsweep.trainers.fused import _stacked_forward

    from .factories import Subclassed

    def net(seed):  # (a subclass: through vmap, where the side-by-side op serves)
        torch.manual_seed(seed)
        return Subclassed(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 3, 1),
                             nn.BatchNorm2d(3, affine=False), nn.Flatten(), nn.Linear(48, 5),
                             nn.BatchNorm1d(5, track_running_stats=False)).double()

    members = [net(seed) for seed in range(3)]
    x = torch.randn(8, 2, 6, 6, dtype=torch.float64)
    shapes = []

    def batch_norm(input, *args, _real=F.batch_norm, **kwargs):
        shapes.append(tuple(input.shape))
        return _real(input, *args, **kwargs)

    def run(forward):
        params, buffers = torch.func.stack_module_state(members)
        params = {name: p.detach().requires_grad_() for name, p in params.items()}
        buffers = {name: b.clone() for name, b in buffers.items()}
        out = forward(params, buffers, x)
        (out * torch.arange(5.0, dtype=out.dtype)).square().sum().backward()
        return [out.detach(), *(p.grad for p in params.values()), *buffers.values()]

    monkeypatch.setattr(F, "batch_norm", batch_norm)
    side_by_side = run(_stacked_forward(members[0]))
    assert (8, 3 * 4, 4, 4) in shapes and (8, 3 * 3, 4, 4) in shapes and (8, 3 * 5) in shapes
    shapes.clear()
    vmapped = run(torch.func.vmap(lambda p, b, x: torch.func.functional_call(members[0], (p, b), (x,)),
                                  in_dims=(0, 0, None)))
    assert (8, 3 * 4, 4, 4) not in shapes  # (vmap's rule: not through F.batch_norm)
    assert len(side_by_side) == len(vmapped)
    for a, b in zip(side_by_side, vmapped):  # (a bias before BatchNorm has a gradient of ~1e-17: absolute there)
        assert float((a - b).double().norm()) <= 1e-12 * (1 + float(b.double().norm())), tuple(b.shape)


def test_a_member_that_diverges_ends_alone_and_the_others_go_on():
    configs = [TrainConfig(**{**BASE, "epochs": 4, **MEMBERS[0]}),
               TrainConfig(**{**BASE, "epochs": 4, "accum_steps": 2, "base_lr": 1e30, "warmup_epochs": 0})]
    fused = train_fused(configs)
    diverged = solo(configs[1])[0]
    assert diverged.status == fused[1].status == "diverged" and len(fused[1].history) == len(diverged.history) < 4
    assert fused[0].status == "ok" and len(fused[0].history) == 4
    assert fused[0].history[-1]["val_acc"] == pytest.approx(solo(configs[0])[0].history[-1]["val_acc"])


def test_what_cannot_train_as_one_is_refused_before_any_step():
    with pytest.raises(NotFusable, match="differ in physical_batch"):
        train_fused([TrainConfig(**BASE), TrainConfig(**{**BASE, "physical_batch": 16})])
    with pytest.raises(NotFusable, match="differ in bn_momentum"):  # k updates of the statistics at another m
        train_fused([TrainConfig(**BASE), TrainConfig(**{**BASE, "accum_steps": 2, "bn_momentum_rule": "scaled"})])
    assert alone(TrainConfig(**{**BASE, "max_steps": 3})) == "it stops at max_steps"
    probe = Weights()
    with pytest.raises(NotFusable, match="cannot be stacked"):  # dropout: no stacked draw is each solo run's
        train_fused([TrainConfig(**{**BASE, "model": "tests.factories:dropout_mlp"})] * 2, probes=[[probe], []])
    assert probe.seen == []


def test_a_member_whose_callback_raises_ends_there_alone_and_the_others_go_on():
    configs = [TrainConfig(**{**BASE, "epochs": 3, **m}) for m in MEMBERS[:3]]
    rows = [[] for _ in configs]

    def stop(row):
        rows[1].append(row)
        if row["epoch"] == 1:
            raise KeyError("stopped")

    fused = train_fused(configs, on_epoch=[rows[0].append, stop, rows[2].append])
    assert isinstance(fused[1], KeyError) and len(rows[1]) == 1
    for i in (0, 2):
        assert [r["epoch"] for r in rows[i]] == [1, 2, 3]
        assert rows[i][-1]["val_acc"] == pytest.approx(solo(configs[i])[0].history[-1]["val_acc"], abs=1e-12)


def test_members_checkpoint_each_epoch_and_go_on_from_there_fused_or_alone(tmp_path):
    """A group stopped after its first epoch goes on from its members' checkpoints, and ends where one that ran
    through ends; a member's checkpoint resumes alone too (the same probes as a solo run's)."""
    from batchsweep.trainers import Checkpointing

    configs = [TrainConfig(**{**BASE, "epochs": 3, **m}) for m in MEMBERS[:3]]
    specs = [Checkpointing(str(tmp_path / str(i))) for i in range(3)]

    def stop_all(row):
        if row["epoch"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_fused(configs, on_epoch=[None, None, stop_all], checkpoints=specs)  # (after every member's write)
    rows = [[] for _ in configs]
    resumed = train_fused(configs[:2], on_epoch=[r.append for r in rows[:2]], checkpoints=specs[:2])
    whole = train_fused(configs)
    for i in (0, 1):
        assert resumed[i].resumed_after == 1 and [r["epoch"] for r in rows[i]] == [1, 2, 3]  # the first replayed
        assert resumed[i].history[-1]["val_loss"] == pytest.approx(whole[i].history[-1]["val_loss"], rel=1e-12)
    alone_result = train(configs[2], checkpoint=specs[2])
    assert alone_result.resumed_after == 1
    assert alone_result.history[-1]["val_loss"] == pytest.approx(whole[2].history[-1]["val_loss"], rel=1e-10)
    assert alone_result.history[-1]["peak_memory_bytes"] == whole[2].history[-1]["peak_memory_bytes"]


@pytest.mark.slow
def test_the_default_studys_group_steps_as_its_solo_runs_over_two_epochs(data_dir):
    """accum_lr's protocol (cnn1d with BatchNorm on MNIST-1D, warmup and cosine, weight decay) in float64, at
    k = 1 and 16 under each LR rule (the fast tests hold k = 2, 3, 4): every member's every step against its solo
    run's."""
    fixed = dict(physical_batch=32, epochs=2, warmup_epochs=1, schedule="cosine", weight_decay=5e-4, base_lr=0.05,
                 dtype="float64", device="cpu", data_dir=data_dir)
    configs = [TrainConfig(**fixed, accum_steps=k, lr_rule=rule) for k in (1, 16) for rule in ("none", "linear", "sqrt")]
    probes = [[Weights()] for _ in configs]
    fused = train_fused(configs, probes=probes)
    for config, (probe,), result in zip(configs, probes, fused):
        alone_result, alone_seen = solo(config)
        assert len(probe.seen) == len(alone_seen) > 0
        assert max(relative(a, b) for a, b in zip(probe.seen, alone_seen)) < 1e-10, config
        assert result.history[-1]["val_acc"] == pytest.approx(alone_result.history[-1]["val_acc"], abs=1e-12)


EVENTS: list[str] = []  # what logged_mlp's models did, in order: each build, each forward


class Logged(nn.Sequential):
    def forward(self, x):
        EVENTS.append("forward")
        return super().forward(x)


def logged_mlp(input_shape, num_classes, **_):
    EVENTS.append("built")
    return Logged(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 8), nn.ReLU(), nn.Linear(8, num_classes))


def test_every_members_peak_is_measured_before_any_member_is_built():
    """On a GPU the allocator's peak counts every tensor resident, so a member measured alone after others were
    built would count their weights too: each peak run (a build, then its forwards) comes first, then the members'
    builds one after the other. (Here on the CPU the peak counts the run's own tensors whatever the order; that
    the CUDA figure then equals a solo run's needs a GPU.)"""
    EVENTS.clear()
    configs = [TrainConfig(**{**BASE, "model": "tests.test_fused:logged_mlp", "epochs": 1, **m})
               for m in (dict(accum_steps=1), dict(accum_steps=2), dict(accum_steps=2, lr_rule="linear"))]
    fused = train_fused(configs)
    built = [i for i, e in enumerate(EVENTS) if e == "built"]
    assert len(built) == 2 + 3  # two measured alone (the LR rule allocates nothing), three members
    assert built[-3:] == [built[-3], built[-3] + 1, built[-3] + 2]  # the members', nothing run in between
    assert "forward" in EVENTS[built[0]:built[1]] and "forward" in EVENTS[built[1]:built[2]]
    for config, result in zip(configs, fused):
        assert result.metrics["peak_memory_bytes"] == train(config).metrics["peak_memory_bytes"]


def test_each_members_evaluation_is_its_solo_runs_with_the_configs_own_metrics():
    """Each member's evaluation, its own metric functions' terms included, is its solo run's (each member evaluates
    alone: on the CPU a stacked forward of 15 cnn1d members over 1,000 test samples took 0.85 s against 0.15 s for
    the 15 alone, its tensors too large for the caches)."""
    configs = [TrainConfig(**{**BASE, "metrics": "tests.factories:margin", **m}) for m in MEMBERS[:3]]
    for result, config in zip(train_fused(configs), configs):
        alone_result = train(config)
        for mine, theirs in zip(result.history, alone_result.history):
            assert "val_margin" in mine
            assert {n: mine[n] for n in mine if n.startswith("val_")} == pytest.approx(
                {n: theirs[n] for n in theirs if n.startswith("val_")}, rel=1e-12, abs=1e-14)


def test_on_the_cpu_members_with_large_micro_batches_train_alone(data_dir):
    """cnn1d at b = 128 saves 1.6 MiB for backward a micro-batch: on the CPU such a group is refused before any
    step (its members then train alone); at b = 64 (0.8 MiB) it trains fused."""
    fixed = dict(model="cnn1d", dataset="mnist1d", epochs=1, device="cpu", data_dir=data_dir)
    with pytest.raises(NotFusable, match=r"saves 1\.6 MiB for backward \(more than 1\.0\) train alone"):
        train_fused([TrainConfig(**fixed, physical_batch=128, lr_rule=rule) for rule in ("none", "linear")])
    fused = train_fused([TrainConfig(**fixed, physical_batch=64, lr_rule=rule) for rule in ("none", "linear")])
    assert [r.status for r in fused] == ["ok", "ok"]


def test_configurations_that_train_alike_train_once_and_each_keeps_its_own_run(tmp_path, monkeypatch):
    """k = 1 under none, linear and sqrt at B = base_batch is one run: the group trains it once, beside k = 2, and
    each configuration keeps its own result, rows and checkpoints (written with its own configuration, resumable
    fused or alone); one stopped by its callback ends alone, the first one's included, while the others go on."""
    from batchsweep.trainers import Checkpointing, fused as fused_module

    configs = [TrainConfig(**{**BASE, "epochs": 3, "accum_steps": k, "lr_rule": rule})
               for k, rule in ((1, "none"), (1, "linear"), (1, "sqrt"), (2, "linear"))]
    stacked = []

    def counted(active, *args):
        stacked.append(len(active))
        return real(active, *args)

    real = fused_module._micro_batch
    monkeypatch.setattr(fused_module, "_micro_batch", counted)
    specs = [Checkpointing(str(tmp_path / str(i))) for i in range(4)]
    rows = [[] for _ in configs]

    def stop(i):
        def on_epoch(row):
            rows[i].append(row)
            if row["epoch"] == 2:
                raise KeyError("stopped")
        return on_epoch

    results = train_fused(configs, on_epoch=[stop(0), rows[1].append, stop(2), rows[3].append], checkpoints=specs)
    assert set(stacked) == {2}  # k = 1's one member and k = 2's, every micro-batch
    assert isinstance(results[0], KeyError) and isinstance(results[2], KeyError)
    assert [len(r) for r in rows] == [2, 3, 2, 3]
    monkeypatch.undo()
    for i in (1, 3):
        alone_result = train(configs[i])
        assert results[i].config is configs[i] and results[i].history == rows[i]
        assert [{n: r[n] for n in set(r) - TIMES} for r in rows[i]] == [
            pytest.approx({n: r[n] for n in set(r) - TIMES}, rel=1e-10, abs=1e-12, nan_ok=True)
            for r in alone_result.history]
        resumed = train(configs[i], checkpoint=specs[i])  # its own last checkpoint: a finished run of its own
        assert resumed.resumed_after == 3 and resumed.history[-1]["val_loss"] == rows[i][-1]["val_loss"]
    assert torch.load(specs[2].path, weights_only=True)["progress"]["epoch"] == 2  # none written after its stop
    assert torch.load(specs[2].path, weights_only=True)["config"]["lr_rule"] == "sqrt"


def test_configurations_that_train_alike_go_on_from_their_checkpoints_together(tmp_path):
    """Stopped after an epoch, they go on together from their own checkpoints; where one of them has since gone
    on alone, theirs stand at different epochs and the group is refused (its members then train alone)."""
    from batchsweep.trainers import Checkpointing

    configs = [TrainConfig(**{**BASE, "epochs": 3, "lr_rule": rule}) for rule in ("none", "linear")]

    def stopped_after_one_epoch(folder):
        def stop_all(row):
            if row["epoch"] == 1:
                raise KeyboardInterrupt

        specs = [Checkpointing(str(tmp_path / folder / rule)) for rule in ("none", "linear")]
        with pytest.raises(KeyboardInterrupt):
            train_fused(configs, on_epoch=[None, stop_all], checkpoints=specs)
        return specs

    specs = stopped_after_one_epoch("a")
    resumed = train_fused(configs, checkpoints=specs)
    whole = train(configs[1])
    for result in resumed:
        assert result.resumed_after == 1
        assert result.history[-1]["val_loss"] == pytest.approx(whole.history[-1]["val_loss"], rel=1e-12)
    specs = stopped_after_one_epoch("b")
    train(configs[0], checkpoint=specs[0])
    with pytest.raises(NotFusable, match=r"stand at different epochs \(3 and 1\)"):
        train_fused(configs, checkpoints=specs)


def test_one_configuration_given_twice_writes_both_checkpoints_and_batchnorm_without_statistics_trains(tmp_path):
    from batchsweep.trainers import Checkpointing

    config = TrainConfig(**{**BASE, "model": "tests.factories:bn_mlp_without_statistics"})
    specs = [Checkpointing(str(tmp_path / name)) for name in "ab"]
    fused = train_fused([config, config], checkpoints=specs)
    assert all(spec.path.exists() for spec in specs)
    alone_result = train(config)  # (no running statistics: no population error to measure, alone or fused)
    assert alone_result.status == fused[0].status == fused[1].status == "ok"
    assert "bn_mean_error" not in alone_result.metrics
    assert fused[1].history[-1]["val_loss"] == pytest.approx(alone_result.history[-1]["val_loss"], rel=1e-10)
