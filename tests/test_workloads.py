"""Workloads beyond tensors and per-sample losses: any Dataset through a DataLoader in the same order, losses
normalized over the window's items and terms, a small language model, and the probe seam."""
import ast
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from batchsweep.trainers import ConfigError, TrainConfig, train
from batchsweep.trainers.data import load_data
from batchsweep.trainers.models import build_model
from batchsweep.trainers.probes import LossTerms, Probe

from .conftest import ROOT

TOKENS = dict(model="gpt", dataset="tests.factories:tokens", dtype="float64", optimizer="adamw", base_lr=3e-3,
              physical_batch=4, accum_steps=4, epochs=2)


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def rel_diff(a, b) -> float:
    return ((flat(a) - flat(b)).norm() / flat(b).norm()).item()


def test_token_loss_is_exact_over_unequal_micro_batches():
    # 50 sequences at B = 16: three full windows and a short one of 2, every micro-batch with its own
    # number of tokens. (b, k) and (b*k, 1) agree in float64 to rounding.
    accum = TrainConfig(**TOKENS)
    a, t = train(accum), train(replace(accum, physical_batch=16, accum_steps=1))
    assert a.history[-1]["steps"] == t.history[-1]["steps"] == 2 * 4
    assert rel_diff(a.model, t.model) <= 1e-12
    assert a.metrics["train_loss"] == pytest.approx(t.metrics["train_loss"], rel=1e-12)
    assert {"val_perplexity", "val_acc"} <= set(a.metrics)


def test_a_naive_mean_over_k_misses_by_far():
    # The control, on one window of the same data: each micro-batch's mean over its tokens, divided by k,
    # against the mean over the window's tokens.
    data = load_data("tests.factories:tokens", "", 0)
    torch.manual_seed(0)
    model = build_model("gpt", data.input_shape, data.num_classes, "batch").double()
    x, y = data.x_train[:16], data.y_train[:16]

    def gradient(losses) -> torch.Tensor:
        model.zero_grad()
        sum(losses).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    def ce(xs, ys):
        return F.cross_entropy(model(xs).flatten(0, 1), ys.flatten(), ignore_index=-100, reduction="sum")

    exact = gradient([ce(x[i:i + 4], y[i:i + 4]) / (y != -100).sum() for i in range(0, 16, 4)])
    naive = gradient([ce(x[i:i + 4], y[i:i + 4]) / (y[i:i + 4] != -100).sum() / 4 for i in range(0, 16, 4)])
    true = gradient([ce(x, y) / (y != -100).sum()])
    assert ((exact - true).norm() / true.norm()).item() <= 1e-12
    assert ((naive - true).norm() / true.norm()).item() >= 1e-3


def test_named_terms_are_each_normalized_by_their_window_count():
    accum = TrainConfig(**TOKENS, loss="tests.factories:two_terms")
    a, t = train(accum), train(replace(accum, physical_batch=16, accum_steps=1))
    assert rel_diff(a.model, t.model) <= 1e-12
    row = a.history[-1]
    assert {"loss/tokens", "loss/logit_mean"} <= set(row)
    assert row["train_loss"] == pytest.approx(row["loss/tokens"] + row["loss/logit_mean"], rel=1e-12)
    assert row["loss/logit_mean"] > 0


def test_a_loss_that_counts_tokens_without_saying_so_is_normalized_by_its_own_count():
    accum = TrainConfig(**TOKENS, loss="tests.factories:tokens_without_counts")
    a, t = train(accum), train(replace(accum, physical_batch=16, accum_steps=1))
    assert rel_diff(a.model, t.model) <= 1e-12
    counted = train(replace(accum, loss="auto"))  # the built-in loss: counted before backward, the same sums
    assert rel_diff(a.model, counted.model) <= 1e-12


def test_terms_that_count_different_items_without_saying_so_are_refused():
    with pytest.raises(ConfigError, match=r"terms count different items in one micro-batch \(tokens: \d+, "
                                          r"logit_mean: 4\): give the function a counts\(target\)"):
        train(TrainConfig(**TOKENS, loss="tests.factories:two_terms_without_counts"))


class Seen(Probe):
    """Records the inputs of every optimizer step, in order."""

    def start(self, run):
        super().start(run)
        self.steps: list[list[torch.Tensor]] = []
        self.last = -1

    def after_micro(self, micro):
        if micro.step != self.last:
            self.steps.append([])
            self.last = micro.step
        self.steps[-1].append(micro.x.clone())

    def windows(self) -> list[torch.Tensor]:
        return [torch.cat(parts) for parts in self.steps]


JITTERED = dict(model="mlp", dataset="tests.factories:jittered", dtype="float64", physical_batch=4, accum_steps=3,
                epochs=3)


@pytest.mark.parametrize("workers,dataset", [(0, "jittered"), (2, "jittered"), (2, "jittered_python"),
                                             (2, "jittered_numpy")])
def test_a_dataset_with_augmentation_sees_the_same_samples_at_b_k_and_bk_1(workers, dataset):
    # Outside the package, read through the DataLoader path: at (4, 3) and (12, 1) every optimizer step
    # sees the same sample indices and the same augmented inputs, with loader processes or without, whether
    # the augmentation draws from torch's, Python's or numpy's RNG.
    accum = TrainConfig(**{**JITTERED, "dataset": f"tests.factories:{dataset}"}, num_workers=workers)
    seen_a, seen_t, seen_0 = Seen(), Seen(), Seen()
    a = train(accum, probes=[seen_a])
    t = train(replace(accum, physical_batch=12, accum_steps=1), probes=[seen_t])
    train(replace(accum, num_workers=0), probes=[seen_0])
    assert len(seen_a.windows()) == len(seen_t.windows()) == 3 * 4  # 40 samples at B = 12: 3 + a short window
    for wa, wt, w0 in zip(seen_a.windows(), seen_t.windows(), seen_0.windows()):
        assert torch.equal(wa[:, 1, 0], wt[:, 1, 0])  # the same samples, in the same order
        assert torch.equal(wa, wt) and torch.equal(wa, w0)  # augmented alike
    assert rel_diff(a.model, t.model) <= 1e-12  # and so, without BatchNorm, the same training
    # The augmentation is random: a sample's input differs between epochs.
    first = {int(i): row for w in seen_a.windows()[:4] for i, row in zip(w[:, 1, 0], w[:, 0])}
    second = {int(i): row for w in seen_a.windows()[4:8] for i, row in zip(w[:, 1, 0], w[:, 0])}
    assert sum(not torch.equal(first[i], second[i]) for i in first) >= 35
    assert a.dataset["train_size"] == 40 and a.dataset["digest"]


def test_the_cifar_shaped_dataset_trains_through_the_loader():
    result = train(TrainConfig(model="tests.factories:small_conv2d", dataset="cifar_shaped", physical_batch=32,
                               accum_steps=2, epochs=2, num_workers=1, base_lr=0.1))
    assert result.status == "ok" and result.history[-1]["steps"] == 2 * 32  # 2,000 samples at B = 64
    assert result.metrics["val_acc"] > 0.5 and "bn_mean_error" in result.metrics  # 10 classes: chance is 0.1


class TokensPerStep(Probe):
    """A user's own per-step metric: counted tokens per optimizer step, averaged over the epoch."""

    def start(self, run):
        super().start(run)
        self.total, self.steps = 0, 0

    def after_micro(self, micro):
        self.total += int((micro.y != -100).sum())

    def after_step(self, step):
        self.steps += 1

    def epoch_end(self, epoch):
        row = {"tokens_per_step": self.total / self.steps}
        self.total, self.steps = 0, 0
        return row


def test_a_users_probe_adds_its_metric_to_every_epoch():
    config = TrainConfig(**TOKENS)
    data = load_data(config.dataset, "", 0)
    result = train(config, probes=[TokensPerStep()])
    assert [r["tokens_per_step"] for r in result.history] == [int((data.y_train != -100).sum()) / 4] * 2


def test_a_probe_is_called_where_it_acts_whether_its_class_or_the_probe_itself_defines_the_method():
    # The loop calls only the methods a probe defines (trainers/probes.py, Hooks): one set on the probe itself
    # counts too, and a subclass inherits its parent's.
    class Steps(TokensPerStep):
        pass

    config = TrainConfig(**TOKENS)
    by_class, by_instance = Steps(), Probe()
    seen = []
    by_instance.after_micro = lambda micro: seen.append(len(micro.y))
    result = train(config, probes=[by_class, by_instance])
    assert "tokens_per_step" in result.history[-1]
    assert sum(seen) == 2 * load_data(config.dataset, "", 0).n_train  # every sample of two epochs, once


def test_the_trainers_modules_import_each_other_without_a_circle():
    graph = {}
    for path in (ROOT / "trainers").glob("*.py"):
        tree = ast.parse(path.read_text())
        graph[path.stem] = {node.module for node in ast.walk(tree)
                            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module}
    assert {"models", "data"} <= graph["config"]  # the registries' names come from the registries

    def reaches(start, target, seen=()):
        return any(m == target or (m not in seen and reaches(m, target, (*seen, m))) for m in graph.get(start, ()))

    assert [m for m in graph if reaches(m, m)] == []


@pytest.mark.slow
def test_gpt_learns_pytext():
    # A real protocol at small size: warmup and cosine over 3 epochs of 1,000 steps' worth of text.
    config = TrainConfig(model="gpt", dataset="pytext", optimizer="adamw", base_lr=3e-3, physical_batch=16,
                         accum_steps=2, epochs=3, warmup_epochs=1, schedule="cosine", max_steps=0)
    result = train(config)
    history = result.history
    assert result.health == "ok"
    assert history[-1]["val_loss"] < history[0]["val_loss"] < 3.5  # nats per byte; uniform guessing is 5.5
    assert history[-1]["val_perplexity"] == pytest.approx(2.718281828 ** history[-1]["val_loss"], rel=1e-6)


def test_a_loss_that_returns_a_number_is_one_line(capsys):
    from batchsweep.trainers.cli import main

    assert main(["--model", "mlp", "--dataset", "tests.factories:blobs", "--loss", "tests.factories:a_number",
                 "--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # below the epoch bar
    assert err == ("error: loss tests.factories:a_number must return (loss_sum, count) or a dict of such "
                           "named terms, got float")


def test_a_models_own_loss_is_used_by_default():
    accum = TrainConfig(model="tests.factories:WithOwnLoss", dataset="tests.factories:blobs", dtype="float64",
                        physical_batch=10, accum_steps=4, epochs=2)  # 90 samples at B = 40: a short window of 10
    a, t = train(accum), train(replace(accum, physical_batch=40, accum_steps=1))
    assert {"loss/ce", "loss/l2"} <= set(a.history[-1])
    assert rel_diff(a.model, t.model) <= 1e-12


class RecordedLoss(Probe):
    """Each epoch's mean loss over its counted items, from every micro-batch's (sum, count), read one by one."""

    def start(self, run):
        super().start(run)
        self.means, self.total, self.count = [], 0.0, 0

    def after_micro(self, micro):
        total, count = micro.terms["loss"]
        self.total, self.count = self.total + float(total.detach()), self.count + int(count)

    def epoch_end(self, epoch):
        self.means.append(self.total / self.count)
        self.total, self.count = 0.0, 0
        return {}


@pytest.mark.parametrize("config", [dict(model="mlp", dataset="mnist1d", physical_batch=32, accum_steps=4, epochs=2),
                                    TOKENS], ids=["samples", "tokens"])
def test_the_training_loss_is_the_mean_over_every_counted_item(config, data_dir, monkeypatch):
    """The loop holds the micro-batches' sums (and token counts) on the device and adds them HELD at a time:
    with 7, several times an epoch and a remainder at its end, the epoch's loss is still their exact mean."""
    monkeypatch.setattr(LossTerms, "HELD", 7)
    recorded = RecordedLoss()
    result = train(TrainConfig(**config, data_dir=data_dir), probes=[recorded])
    assert len(recorded.means) == 2
    assert [row["train_loss"] for row in result.history] == pytest.approx(recorded.means, rel=1e-12)
