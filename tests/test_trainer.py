import math
import random
import signal
import weakref
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchsweep.trainers import ConfigError, TrainConfig, interrupt, train
from batchsweep.trainers.data import load_data, mnist1d
from batchsweep.trainers.evaluation import evaluate
from batchsweep.trainers.loop import lr_at, warmup_steps
from batchsweep.trainers.order import permutation, windows
from batchsweep.trainers.models import build_model
from batchsweep.trainers.probes import Probe
from tests.factories import noise_truth


def max_rel_diff(a: nn.Module, b: nn.Module) -> float:
    return max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(a.parameters(), b.parameters()))


# MNIST-1D has 4,000 training samples: with b=24, k=3 (B=72) the last window holds 40 = 24 + 16,
# so every epoch ends with a short window and a short micro-batch.
SHORT_TAIL = dict(model="mlp", physical_batch=24, accum_steps=3, epochs=3, base_lr=0.05)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float64", 1e-12)])
def test_accumulation_equals_true_batch_without_bn(data_dir, dtype, tol):
    accum = TrainConfig(**SHORT_TAIL, dtype=dtype, data_dir=data_dir)
    true = replace(accum, physical_batch=72, accum_steps=1)
    assert 4000 % 72 == 40
    a, t = train(accum), train(true)
    assert max_rel_diff(a.model, t.model) <= tol
    assert a.history[-1]["steps"] == t.history[-1]["steps"] == 3 * 56


def naive_loss_over_k(config: TrainConfig) -> nn.Module:
    """The usual loop: mean loss of each micro-batch divided by k."""
    data = load_data(config.dataset, config.data_dir, config.seed)
    torch.manual_seed(config.seed)
    model = build_model(config.model, data.input_shape, data.num_classes, config.norm)
    opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    for epoch in range(1, config.epochs + 1):
        for window in windows(permutation(config, epoch, len(data.x_train), torch.device("cpu")), config):
            for idx in window.split(config.physical_batch):
                loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]) / config.accum_steps
                loss.backward()
            opt.step()
            opt.zero_grad()
    return model


def test_naive_loss_over_k_is_not_exact(data_dir):
    accum = TrainConfig(**SHORT_TAIL, data_dir=data_dir)
    true = train(replace(accum, physical_batch=72, accum_steps=1))
    # It under-weights the short last window, so it misses the tolerance that ours meets.
    assert max_rel_diff(naive_loss_over_k(accum), true.model) > 1e-3


def hand_written_regression(batch: int, forget_zero_grad: bool = False) -> list[float]:
    from tests.factories import linreg, zero_linear

    (x, y), _ = (d.tensors for d in linreg())
    model = zero_linear((2,), 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for _ in range(3):
        total = 0.0
        for xs, ys in zip(x.split(batch), y.split(batch)):
            loss = ((model(xs) - ys) ** 2).mean()
            loss.backward()
            opt.step()
            if not forget_zero_grad:
                opt.zero_grad()
            total += loss.item() * len(xs)
        losses.append(total / len(x))
    return losses


def test_classic_linear_regression(data_dir):
    base = TrainConfig(model="tests.factories:zero_linear", dataset="tests.factories:linreg", momentum=0.0,
                       base_lr=0.01, shuffle=False, epochs=3, physical_batch=40, data_dir=data_dir)
    big = [r["train_loss"] for r in train(base).history]
    accum_result = train(replace(base, physical_batch=10, accum_steps=4))
    accum = [r["train_loss"] for r in accum_result.history]
    assert accum == pytest.approx(big, rel=1e-6)
    assert big == pytest.approx(hand_written_regression(40), rel=1e-6)
    assert big[-1] < big[0] / 5  # it learns: 75 steps at lr 0.01 from zero move towards (-2, 3.4)
    w = accum_result.model.weight.detach().flatten().tolist()
    assert w[0] < -1 and w[1] > 1.5
    # A loop that forgets zero_grad piles gradients up and drifts away from these losses.
    assert hand_written_regression(40, forget_zero_grad=True) != pytest.approx(big, rel=1e-2)


def test_gradients_are_zeroed_once_per_window(data_dir):
    config = TrainConfig(model="tests.factories:GradProbe", dataset="tests.factories:blobs",
                         physical_batch=10, accum_steps=3, epochs=2, data_dir=data_dir)
    probe = train(config).model
    # 90 samples = 3 windows of 3 micro-batches: each window starts with no gradient, the rest add to it.
    assert probe.grad_was_empty == [True, False, False] * 6


def test_runs_that_share_one_load_of_the_data_train_as_runs_that_load_it_each(monkeypatch):
    """train(config, data=load(config)), as the planner's probes share one load: the factory is called once, and
    each run ends bitwise where a run that loads the data itself does."""
    from tests import factories
    from batchsweep.trainers import load

    monkeypatch.setattr(factories, "LOADS", [])
    config = TrainConfig(model="mlp", dataset="tests.factories:counted_blobs", physical_batch=16, epochs=2)
    data = load(config)
    shared = [train(replace(config, accum_steps=k), data=data) for k in (1, 4)]
    assert factories.LOADS == [0]
    timeless = lambda history: [{key: value for key, value in row.items()
                                 if key not in ("epoch_time_s", "samples_per_s")} for row in history]
    for k, run in zip((1, 4), shared):
        alone = train(replace(config, accum_steps=k))
        assert timeless(run.history) == timeless(alone.history)
        weights = zip(run.model.state_dict().values(), alone.model.state_dict().values())
        assert all(torch.equal(a, b) for a, b in weights)
        assert run.dataset == alone.dataset
    assert factories.LOADS == [0, 0, 0]


def test_batchnorm_makes_accumulation_differ(data_dir):
    accum = TrainConfig(physical_batch=16, accum_steps=4, epochs=1, data_dir=data_dir)
    a, t = train(accum), train(replace(accum, physical_batch=64, accum_steps=1))
    assert max_rel_diff(a.model, t.model) > 1e-3


@pytest.mark.parametrize("k", [2, 4, 16])
def test_matched_momentum_decays_like_one_true_batch_update(k):
    config = TrainConfig(bn_momentum_rule="matched", accum_steps=k)
    micro, true = nn.BatchNorm1d(3, momentum=config.bn_momentum), nn.BatchNorm1d(3, momentum=0.1)
    for layer in (micro, true):
        layer.running_mean.fill_(1.0)
    zero_mean = torch.tensor([[-1.0, -2.0, -3.0], [1.0, 2.0, 3.0]])  # batch mean 0: only the decay shows
    for _ in range(k):
        micro(zero_mean)
    true(zero_mean.repeat(k, 1))
    torch.testing.assert_close(micro.running_mean, true.running_mean, rtol=1e-6, atol=0)
    assert true.running_mean[0].item() == pytest.approx(0.9)
    scaled = replace(config, bn_momentum_rule="scaled")
    assert scaled.bn_momentum == pytest.approx(0.1 / k)
    assert (1 - scaled.bn_momentum) ** k != pytest.approx(0.9, abs=1e-4)  # m/k decays less than matched


def test_trainer_sets_momentum_on_every_bn_layer(data_dir):
    result = train(TrainConfig(bn_momentum_rule="matched", accum_steps=4, epochs=1, data_dir=data_dir))
    layers = [m for m in result.model.modules() if isinstance(m, nn.BatchNorm1d)]
    assert len(layers) == 3
    assert all(m.momentum == pytest.approx(1 - 0.9 ** 0.25) for m in layers)


def test_frozen_parameters_stay_unchanged(data_dir):
    config = TrainConfig(model="tests.factories:half_frozen", epochs=1, data_dir=data_dir)
    torch.manual_seed(config.seed)
    from tests.factories import half_frozen

    initial = half_frozen((1, 40), 10)
    trained = train(config).model
    assert torch.equal(trained[1].weight, initial[1].weight)
    assert not torch.equal(trained[3].weight, initial[3].weight)


def test_evaluation_keeps_bn_statistics_and_train_mode(data_dir):
    result = train(TrainConfig(epochs=1, data_dir=data_dir))
    model = result.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = load_data("mnist1d", data_dir, 0)
    model.train()
    evaluate(model, zip(data.x_test.split(256), data.y_test.split(256)))
    assert model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_lr_rules():
    base = TrainConfig(base_lr=0.1, base_batch=32, physical_batch=32, accum_steps=16)
    assert replace(base, lr_rule="none").lr == pytest.approx(0.1)
    assert replace(base, lr_rule="linear").lr == pytest.approx(1.6)
    assert replace(base, lr_rule="sqrt").lr == pytest.approx(0.4)
    assert replace(base, lr_rule="linear", accum_steps=1).lr == pytest.approx(0.1)


def test_adam_full_square_root_rule_scales_betas_and_eps_as_the_formula_says():
    # Malladi et al. 2022: with kappa = B / B0, lr * sqrt(kappa), 1 - beta * kappa, eps / sqrt(kappa).
    from batchsweep.trainers.loop import make_optimizer

    base = TrainConfig(optimizer="adamw", lr_rule="adam_sqrt", base_lr=1e-3, base_batch=32, adam_beta1=0.9,
                       adam_beta2=0.999, adam_eps=1e-8, physical_batch=32, accum_steps=4)  # kappa = 4
    assert (base.lr, base.beta1, base.beta2, base.eps) == pytest.approx((2e-3, 0.6, 0.996, 5e-9))
    group = make_optimizer(base, [torch.nn.Parameter(torch.zeros(1))]).param_groups[0]
    assert (group["lr"], *group["betas"], group["eps"]) == pytest.approx((2e-3, 0.6, 0.996, 5e-9))
    same = replace(base, accum_steps=1)  # kappa = 1: nothing moves
    assert (same.lr, same.beta1, same.beta2, same.eps) == (1e-3, 0.9, 0.999, 1e-8)
    lr_only = replace(base, lr_rule="sqrt")  # the learning rate alone
    assert (lr_only.lr, lr_only.beta1, lr_only.beta2, lr_only.eps) == pytest.approx((2e-3, 0.9, 0.999, 1e-8))
    assert {"beta1": 0.6, "beta2": 0.996} == pytest.approx({k: base.to_dict()[k] for k in ("beta1", "beta2")})
    assert "beta1" not in TrainConfig().to_dict()  # SGD runs record no Adam values
    with pytest.raises(ConfigError, match=r"adam_sqrt at B = 512 \(kappa = B / base_batch = 16\) scales 1 - "
                                          r"adam_beta1 = 0.1 to 1.6: beyond 1 the rule does not hold"):
        replace(base, accum_steps=16)
    with pytest.raises(ConfigError, match="lr_rule=adam_sqrt is a rule for AdamW: set optimizer=adamw"):
        replace(base, optimizer="sgd")


def test_the_half_life_rule_keeps_beta2s_half_life_fixed_in_samples():
    # Marek et al. 2025: beta2' = beta2 ** kappa; the learning rate as sqrt scales it; eps unchanged.
    from batchsweep.trainers.loop import make_optimizer

    base = TrainConfig(optimizer="adamw", lr_rule="adam_halflife", base_lr=1e-3, base_batch=32, adam_beta1=0.9,
                       adam_beta2=0.95, adam_eps=1e-8, physical_batch=32)

    def halflife_in_samples(config, beta):  # B * ln(1/2) / ln(beta): samples for the average to halve
        return config.effective_batch * math.log(0.5) / math.log(beta)

    for k in (1, 2, 4, 8, 16):
        config = replace(base, accum_steps=k)
        group = make_optimizer(config, [torch.nn.Parameter(torch.zeros(1))]).param_groups[0]
        assert group["betas"][1] == pytest.approx(0.95 ** k) and group["betas"][0] == 0.9  # beta1 only if asked
        assert group["lr"] == pytest.approx(1e-3 * math.sqrt(k)) and group["eps"] == 1e-8
        assert halflife_in_samples(config, group["betas"][1]) == pytest.approx(halflife_in_samples(base, 0.95))
    both = replace(base, halflife_beta1=True, accum_steps=4)
    assert (both.beta1, both.beta2) == pytest.approx((0.9 ** 4, 0.95 ** 4))
    assert {"beta1": 0.9 ** 4, "beta2": 0.95 ** 4} == pytest.approx({k: both.to_dict()[k] for k in ("beta1", "beta2")})
    assert replace(base, halflife_beta1=True).beta1 == 0.9  # kappa = 1: exactly the base values
    smaller = replace(base, base_batch=128)  # kappa = 1/4: a smaller B averages over more steps
    assert smaller.beta2 == pytest.approx(0.95 ** 0.25) and smaller.lr == pytest.approx(5e-4)
    # Where the two laws part (the figures docs/science.md gives): beta2 = 0.95 at kappa = 16.
    malladi = replace(base, lr_rule="adam_sqrt", adam_beta1=0.95, accum_steps=16)
    assert (malladi.beta2, replace(base, accum_steps=16).beta2) == pytest.approx((0.20, 0.4401), abs=1e-4)
    assert replace(base, lr_rule="none", accum_steps=8).beta2 == 0.95  # halflife_beta1 alone moves nothing


def test_the_half_life_rule_is_refused_where_beta_leaves_the_open_interval():
    base = TrainConfig(optimizer="adamw", lr_rule="adam_halflife", base_batch=1, physical_batch=2048,
                       adam_beta2=0.999, base_lr=1e-4)
    assert base.beta2 == pytest.approx(0.999 ** 2048)  # inside (0, 1): kept
    with pytest.raises(ConfigError, match=r"^adam_halflife at B = 2048 \(kappa = B / base_batch = 2048\) takes "
                                          r"adam_beta2 = 0.5 to adam_beta2\^kappa = 0, outside \(0, 1\) in floating "
                                          r"point: raise adam_beta2, or give a base_batch nearer B$"):
        replace(base, adam_beta2=0.5)  # 0.5 ** 2048 underflows to 0
    with pytest.raises(ConfigError, match=r"adam_beta1\^kappa = 1, outside \(0, 1\) in floating point: lower adam_beta1"):
        TrainConfig(optimizer="adamw", lr_rule="adam_halflife", halflife_beta1=True, adam_beta1=1 - 2 ** -53,
                    base_batch=64, physical_batch=1)  # kappa = 1/64 rounds beta1 ** kappa up to 1
    with pytest.raises(ConfigError, match="lr_rule=adam_halflife is a rule for AdamW: set optimizer=adamw"):
        replace(base, optimizer="sgd")


def test_the_weight_decay_timescale_rule_keeps_adamw_decay_fixed_in_epochs():
    # Wang & Aitchison 2025: 1 / (lr * decay) steps, at N / B steps an epoch, is B / (lr * decay * N) epochs.
    base = TrainConfig(optimizer="adamw", base_lr=1e-3, base_batch=32, weight_decay=0.05, wd_rule="timescale",
                       physical_batch=32)

    def epochs(config):
        return config.effective_batch / (config.lr * config.decay * 4000)

    for rule in ("none", "linear", "sqrt", "adam_sqrt", "adam_halflife"):
        for k in (1, 2, 4, 8):
            config = replace(base, lr_rule=rule, accum_steps=k)
            assert epochs(config) == pytest.approx(epochs(base)), (rule, k)
    assert replace(base, lr_rule="linear", accum_steps=8).decay == pytest.approx(0.05)  # lr follows B already
    assert replace(base, accum_steps=8).decay == pytest.approx(0.4)  # lr fixed: decay follows B
    assert replace(base, wd_rule="none", accum_steps=8).decay == 0.05


def test_warmup_and_cosine_schedule():
    config = TrainConfig(base_lr=0.1, lr_rule="linear", accum_steps=4, warmup_epochs=2, epochs=4,
                         schedule="cosine")
    per_epoch, total = 5, 20
    warmup = warmup_steps(config, [per_epoch] * 4)
    assert warmup == 10 and warmup_steps(replace(config, warmup_epochs=1.5), [8, 4, 2, 2]) == 10
    values = [lr_at(config, s, total, warmup) for s in range(total)]
    assert values[:10] == pytest.approx([0.4 * (s + 1) / 10 for s in range(10)])
    assert values[10] == pytest.approx(0.4)  # the peak, where cosine starts
    assert values[15] == pytest.approx(0.2)  # half-way through the cosine
    assert all(a > b for a, b in zip(values[10:], values[11:]))
    constant = replace(config, schedule="constant")
    assert [lr_at(constant, s, total, warmup) for s in range(10, 20)] == pytest.approx([0.4] * 10)


def test_trainer_follows_the_schedule(data_dir):
    config = TrainConfig(model="mlp", base_lr=0.05, physical_batch=100, accum_steps=4, epochs=3,
                         warmup_epochs=1, lr_rule="sqrt", schedule="cosine", data_dir=data_dir)
    history = train(config).history
    steps = [r["steps"] for r in history]
    assert steps == [10, 20, 30]
    assert [r["current_lr"] for r in history] == pytest.approx([lr_at(config, s - 1, 30, 10) for s in steps])
    assert history[0]["current_lr"] == pytest.approx(config.lr)  # the last warmup step reaches the peak

def test_drop_last_skips_the_short_window(data_dir):
    config = TrainConfig(**SHORT_TAIL, drop_last=True, data_dir=data_dir)
    assert train(replace(config, epochs=1)).history[-1]["steps"] == 55


def test_metrics_and_memory(data_dir):
    small = train(TrainConfig(epochs=2, physical_batch=16, data_dir=data_dir))
    large = train(TrainConfig(epochs=1, physical_batch=256, data_dir=data_dir))
    row = small.history[-1]
    for key in ("train_loss", "val_loss", "val_acc", "current_lr", "steps", "epoch_time_s", "samples_per_s",
                "peak_memory_bytes"):
        assert math.isfinite(row[key]), key
    assert small.status == "ok" and small.memory_source == "saved_tensors"
    assert 0.1 < row["val_acc"] <= 1 and row["steps"] == 2 * 250
    # Saved-tensor bytes grow with the physical batch.
    assert large.metrics["peak_memory_bytes"] > 5 * small.metrics["peak_memory_bytes"]


def test_nan_loss_is_diverged_not_a_crash(data_dir):
    result = train(TrainConfig(model="mlp", base_lr=1e6, epochs=5, data_dir=data_dir))
    assert result.status == "diverged"
    assert len(result.history) < 5
    assert not math.isfinite(result.metrics["train_loss"])


def test_mnist1d_cache_restores_global_rng(tmp_path):
    np.random.seed(5)
    random.seed(5)
    expected = (np.random.rand(), random.random())
    np.random.seed(5)
    random.seed(5)
    data = mnist1d(str(tmp_path))
    assert (tmp_path / "mnist1d.npz").exists()
    assert (np.random.rand(), random.random()) == expected
    assert data.x_train.shape == (4000, 1, 40) and data.x_test.shape == (1000, 1, 40)


@pytest.mark.parametrize("bad,message", [
    (dict(physical_batch=0), "physical_batch must be >= 1"),
    (dict(accum_steps=-1), "accum_steps must be >= 1"),
    (dict(lr_rule="cubic"), "unknown lr_rule 'cubic'"),
    (dict(bn_momentum_rule="half"), "unknown bn_momentum_rule"),
    (dict(model="vgg"), "unknown model 'vgg'"),
    (dict(dataset="imagenet"), "unknown dataset 'imagenet'"),
    (dict(base_lr=float("nan")), "base_lr must be a finite number"),
    (dict(momentum=1.0), "momentum must be below 1"),
])
def test_config_validates_itself(bad, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**bad)


def test_saved_tensor_measure_sees_graphs_kept_alive():
    from batchsweep.trainers.probes import SavedTensorBytes

    model = nn.Sequential(nn.Linear(40, 256), nn.ReLU(), nn.Linear(256, 10))
    peaks = {}
    for mode in ("backward each", "keep graphs"):
        saved, losses = SavedTensorBytes(model), []
        for _ in range(8):
            with saved.hooks():
                loss = model(torch.randn(32, 40)).sum()
            if mode == "backward each":
                loss.backward()
            else:
                losses.append(loss)
        if losses:
            sum(losses).backward()
        peaks[mode] = saved.peak
        assert saved.current == 0  # everything released once backward ran
    # The leaky loop holds all 8 micro-batches' activations at once.
    assert peaks["keep graphs"] > 6 * peaks["backward each"]


def test_memory_is_flat_under_accumulation(data_dir):
    peak = {k: train(TrainConfig(epochs=1, physical_batch=32, accum_steps=k, data_dir=data_dir)).metrics[
        "peak_memory_bytes"] for k in (1, 16)}
    true = train(TrainConfig(epochs=1, physical_batch=512, data_dir=data_dir)).metrics["peak_memory_bytes"]
    assert peak[16] <= 1.05 * peak[1] and true > 8 * peak[1]


def test_resnet18_channels_last_and_bf16_autocast_run(data_dir):
    # The GPU options, exercised on the CPU (bf16 convolutions are emulated here, so bf16 runs on the mlp).
    config = TrainConfig(model="resnet18", dataset="tests.factories:cifar_tiny", physical_batch=16, accum_steps=2,
                         epochs=1, channels_last=True, data_dir=data_dir)
    result = train(config)
    assert result.status == "ok" and result.warnings == []
    assert result.model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    bf16 = train(replace(config, model="mlp", precision="bf16"))
    assert bf16.status == "ok" and math.isfinite(bf16.metrics["val_loss"])
    assert bf16.warnings == ["channels_last has no effect: the model has no 2-D convolution"]


def test_a_healthy_default_run_is_ok(data_dir):
    result = train(TrainConfig(epochs=3, data_dir=data_dir))
    assert result.health == "ok" and result.health_epoch is None and result.warnings == []
    for row in result.history:
        assert row["grad_norm"] > 0 and 1e-4 < row["update_ratio"] < 0.1 and row["dead_fraction"] == 0.0


def test_far_too_large_learning_rates_are_flagged(data_dir):
    # SGD at lr 50 on cnn1d: the first steps blow the weights up, every ReLU goes negative for every input,
    # so from epoch 2 only the output bias still gets a gradient and accuracy sits at chance: dead.
    dead = train(TrainConfig(base_lr=50.0, epochs=3, data_dir=data_dir))
    assert (dead.status, dead.health, dead.health_epoch) == ("ok", "dead", 2)
    assert dead.history[1]["dead_fraction"] > 0.5
    # The mlp has no normalization to absorb lr 5: its loss overflows to NaN in the first epoch: diverged.
    diverged = train(TrainConfig(model="mlp", base_lr=5.0, epochs=3, data_dir=data_dir))
    assert (diverged.health, diverged.health_epoch) == ("diverged", 1)
    # And too small: nothing moves, the loss does not fall, accuracy stays at chance: stalled.
    stalled = train(TrainConfig(base_lr=1e-7, epochs=2, data_dir=data_dir))
    assert stalled.health == "stalled"


def test_step_statistics_match_a_direct_computation():
    from batchsweep.trainers.health import StepStats

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(2))]
    stats = StepStats(params)
    grad_norms, ratios = [], []
    for step in range(3):
        params[0].grad, params[1].grad = torch.randn(3, 4), torch.randn(5)  # params[2] never gets one
        old = torch.cat([p.detach().flatten() for p in params])
        grad_norms.append(torch.cat([params[0].grad.flatten(), params[1].grad.flatten()]).norm())
        stats.before_step()
        with torch.no_grad():
            params[0].sub_(0.1 * params[0].grad)
            params[1].mul_(1.5)
        new = torch.cat([p.detach().flatten() for p in params])
        ratios.append((new - old).norm() / new.norm())
        stats.after_step()
    row = stats.epoch()
    assert row["grad_norm"] == pytest.approx(torch.stack(grad_norms).mean().item(), rel=1e-6)
    assert row["update_ratio"] == pytest.approx(torch.stack(ratios).mean().item(), rel=1e-6)
    assert row["dead_fraction"] == pytest.approx(1 / 3)
    assert stats.ever_got_grad.tolist() == [True, True, False]
    assert stats.epoch() == {}  # a new epoch starts empty


def test_measuring_changes_nothing(data_dir):
    # The diagnostics read gradients and weights, never write them: a run without them ends with bitwise the
    # same weights.
    config = TrainConfig(physical_batch=16, accum_steps=16, epochs=1, data_dir=data_dir)
    measured = train(config)
    assert "noise_scale" in measured.metrics and "grad_norm" in measured.metrics
    blind = train(config, diagnostics=False)
    assert "noise_scale" not in blind.metrics and "grad_norm" not in blind.metrics
    for p, q in zip(measured.model.parameters(), blind.model.parameters()):
        assert torch.equal(p, q)


def test_exploding_and_dead_verdicts_from_their_thresholds():
    from batchsweep.trainers.health import verdict

    row = dict(epoch=1, train_loss=2.3, val_acc=0.5, grad_norm=1.0, update_ratio=1e-3, dead_fraction=0.0)
    assert verdict("ok", [row, {**row, "epoch": 2, "train_loss": 1.0}], chance=0.1, classes=10) == ("ok", None)
    assert verdict("ok", [row, {**row, "epoch": 2, "update_ratio": 1.5}], 0.1, 10) == ("exploding", 2)
    collapsed = {**row, "epoch": 2, "grad_norm": 1e-9, "val_acc": 0.1}
    assert verdict("ok", [row, collapsed], 0.1, 10) == ("dead", 2)
    assert verdict("ok", [row, {**collapsed, "val_acc": 0.9}], 0.1, 10)[0] != "dead"  # not at chance


def test_frozen_and_left_out_parameters_are_reported(data_dir):
    frozen = train(TrainConfig(model="tests.factories:half_frozen", epochs=1, data_dir=data_dir))
    assert frozen.warnings == ["2 parameter tensors are frozen (requires_grad=False) and will not change: "
                               "1.weight, 1.bias"]
    left_out = train(TrainConfig(model="tests.factories:forgets_a_layer", epochs=1, data_dir=data_dir))
    assert left_out.warnings == ["2 trainable parameter tensors are in no optimizer group and will not change: "
                                 "0.weight, 0.bias"]
    unused = train(TrainConfig(model="tests.factories:unused_layer", epochs=1, data_dir=data_dir))
    assert unused.warnings == ["2 parameter tensors in the optimizer never received a gradient: "
                               "unused.weight, unused.bias"]
    assert unused.history[0]["dead_fraction"] == pytest.approx(2 / 6)


def test_ghost_batch_true_batch_matches_accumulated_bn(data_dir):
    # Accumulated BN training is Ghost BatchNorm with ghost size b: the true batch with ghost_batch = b
    # normalizes the same chunks and updates the running statistics as often, so it matches.
    accum = TrainConfig(physical_batch=16, accum_steps=4, epochs=1, dtype="float64", data_dir=data_dir)
    ghost = train(replace(accum, physical_batch=64, accum_steps=1, ghost_batch=16))
    accumulated = train(accum)
    assert max_rel_diff(accumulated.model, ghost.model) < 1e-12
    for (name, a), (_, g) in zip(accumulated.model.named_buffers(), ghost.model.named_buffers()):
        torch.testing.assert_close(a, g, rtol=1e-9, atol=1e-12, msg=name)  # running stats and counts too
    plain = train(replace(accum, physical_batch=64, accum_steps=1))
    assert max_rel_diff(accumulated.model, plain.model) > 1e-2


def test_noise_scale_matches_per_sample_gradients(data_dir):
    # With the weights held still (lr 1e-9) the truth is computable: tr(Sigma) / |G|^2 from every
    # training sample's own gradient, at the initial weights.
    # k = 16: every window is measured (below that, every ceil(16/k)-th).
    config = TrainConfig(model="mlp", dataset="tests.factories:blobs1k", base_lr=1e-9, momentum=0.0,
                         physical_batch=4, accum_steps=16, epochs=6, data_dir=data_dir)
    estimates = [row["noise_scale"] for row in train(config).history]
    assert estimates[-1] == pytest.approx(noise_truth(config.dataset, data_dir, config.seed), rel=0.25)


def test_noise_scale_is_not_a_number_for_k_1(data_dir):
    result = train(TrainConfig(epochs=1, data_dir=data_dir))
    assert "noise_scale" not in result.history[0] and "noise_scale" not in result.metrics
    assert "noise_scale" in train(TrainConfig(epochs=1, accum_steps=4, data_dir=data_dir)).metrics


def test_the_noise_scale_takes_each_increment_from_one_flat_copy_of_the_gradient():
    # A measured micro-batch's |increment| is the norm of that micro-batch's own gradient, computed apart, and
    # the window's is the norm of their sum. Measuring allocates one buffer of the gradient's size a window, at
    # its first micro-batch, and lets it go at the step (operations seen by a dispatch mode: another storage of
    # that size would be a second copy, as a cat or a difference is; one kept would be held at the evaluation).
    from torch.utils._python_dispatch import TorchDispatchMode

    from batchsweep.trainers.noise import NoiseScale

    class NewFlat(TorchDispatchMode):
        def __init__(self, size: int):
            super().__init__()
            self.size, self.made = size, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                   if isinstance(a, torch.Tensor)}
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.numel() >= self.size and t.untyped_storage().data_ptr() not in ins:
                    self.made.append(func.__name__)
            return out

    torch.manual_seed(0)
    model, idle = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)), nn.Linear(3, 3)
    params = [*model.parameters(), *idle.parameters()]  # idle's get no gradient: zero in every increment
    noise = NoiseScale(params, b=8, B=32, n_train=1000)
    micro = torch.randn(4, 8, 64)
    own = [torch.autograd.grad(model(x).square().sum(), list(model.parameters())) for x in micro]
    watch = NewFlat(sum(p.numel() for p in params))
    for x in micro:
        model(x).square().sum().backward()
        with watch:
            noise.after_micro()
    with watch:
        noise.step()
    assert watch.made == ["empty.memory_format"] and noise.flat is None
    expected = [torch.cat([g.reshape(-1) for g in grads]).norm() for grads in own]
    torch.testing.assert_close(torch.stack(noise.small), torch.stack(expected), rtol=1e-5, atol=0)
    total = torch.cat([sum(g[i] for g in own).reshape(-1) for i in range(len(own[0]))]).norm()
    torch.testing.assert_close(noise.big[0], total, rtol=1e-6, atol=0)


class SignalInFinalizer(Probe):
    """Ctrl-C at the worst moment: while a finalizer runs (the CPU memory counter runs many per micro-batch),
    where Python prints the KeyboardInterrupt as ignored and drops it."""

    def start(self, run):
        super().start(run)
        self.steps = 0

    def after_micro(self, micro):
        if micro.step == 1:
            held = type("Held", (), {})()
            weakref.finalize(held, signal.raise_signal, signal.SIGINT)
            del held

    def after_step(self, step):
        self.steps += 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_dropped_inside_a_finalizer_still_stops_the_run(data_dir):
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupt.trap()
        probe = SignalInFinalizer()
        with pytest.raises(KeyboardInterrupt):
            train(TrainConfig(model="mlp", physical_batch=32, accum_steps=2, epochs=2, data_dir=data_dir),
                  probes=[probe])
        assert probe.steps == 2  # steps 0 and 1: it stopped after the step that saw the signal
    finally:
        signal.signal(signal.SIGINT, previous)
