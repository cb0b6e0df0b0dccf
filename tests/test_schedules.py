"""Batch-size warmup (batch_warmup) and evaluations within epochs (eval_every_steps)."""
import re
from dataclasses import replace

import pytest
import torch

from batchsweep.trainers import Checkpointing, TrainConfig, train
from batchsweep.trainers.errors import ConfigError
from batchsweep.trainers.loop import lr_at, warmup_steps
from batchsweep.trainers.probes import Probe

# 90 samples: windows of 4, 8 and 16 give 23, 12 and 6 steps an epoch (each with a short last window).
BASE = TrainConfig(model="mlp", dataset="tests.factories:blobs", dtype="float64",
                   device="cpu", epochs=4, base_lr=0.05, base_batch=16, lr_rule="linear", warmup_epochs=1,
                   schedule="cosine", seed=3)


def weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_batch_warmup_through_accumulation_equals_the_true_batch_warmup_in_float64():
    accumulated = train(replace(BASE, physical_batch=4, accum_steps=4, batch_warmup="4,8"))
    true_batch = train(replace(BASE, physical_batch=16, accum_steps=1, batch_warmup="4,8"))
    fixed = train(replace(BASE, physical_batch=4, accum_steps=4))
    a, t = weights(accumulated.model), weights(true_batch.model)
    assert ((a - t).norm() / t.norm()).item() <= 1e-12
    assert [r["train_loss"] for r in accumulated.history] == pytest.approx(
        [r["train_loss"] for r in true_batch.history], rel=1e-12, abs=0)
    assert ((weights(fixed.model) - t).norm() / t.norm()).item() > 1e-3  # the warmup changed the run
    # Steps by hand: epochs of B = 4, 8, then 16 and 16.
    assert [r["steps"] for r in accumulated.history] == [23, 35, 41, 47]
    assert [r["steps"] for r in fixed.history] == [6, 12, 18, 24]
    # The learning rate follows the epoch's B by the linear rule; the warmup spans epoch 1 (23 steps) and the
    # cosine the 24 steps after it.
    expected = [lr_at(replace(BASE, physical_batch=b), s - 1, 47, 23) for b, s in ((4, 23), (8, 35), (16, 41),
                                                                                    (16, 47))]
    assert [r["current_lr"] for r in accumulated.history] == pytest.approx(expected, rel=1e-12)
    assert accumulated.history[0]["current_lr"] == pytest.approx(0.05 * 4 / 16)  # the peak at B = 4
    assert warmup_steps(BASE, [23, 12, 6, 6]) == 23


class Hyper(Probe):
    """AdamW's hyper-parameters at every step, with the window's size."""

    def start(self, run):
        super().start(run)
        self.seen = []

    def before_step(self, step, window):
        group = self.run.optimizer.param_groups[0]
        self.seen.append((window, group["betas"], group["eps"], group["weight_decay"]))


@pytest.mark.parametrize("rule,first", [("adam_sqrt", (1 - 0.25 * 0.1, 1 - 0.25 * 0.001)),
                                        ("adam_halflife", (0.9 ** 0.25, 0.999 ** 0.25))])
def test_adams_rules_follow_the_epochs_batch(rule, first):
    config = replace(BASE, optimizer="adamw", lr_rule=rule, halflife_beta1=True, wd_rule="timescale",
                     weight_decay=0.01, base_lr=1e-3, physical_batch=4, accum_steps=4, batch_warmup="4,8", epochs=3)
    probe = Hyper()
    train(config, probes=[probe])
    first_of = {1: 0, 2: 23, 3: 35}  # the first step of each epoch (23 and 12 steps before)
    for epoch, step in first_of.items():
        now = config.at_epoch(epoch)
        window, betas, eps, decay = probe.seen[step]
        assert window == now.effective_batch == (4, 8, 16)[epoch - 1]
        assert betas == (now.beta1, now.beta2) and eps == now.eps and decay == now.decay
    assert probe.seen[0][1] == pytest.approx(first)  # kappa = 4 / 16
    assert probe.seen[-1][1] == pytest.approx((0.9, 0.999)) and probe.seen[-1][2] == 1e-8  # kappa = 1


def test_a_batch_warmup_that_cannot_be_reached_is_one_line():
    for warmup, words in (("8,4", "each B must grow"), ("4,32", "up to B = 16"), ("6", "a multiple of b * N = 4"),
                          ("4,x", "not a list of batch sizes"), ("4,8,8,16", "lists 4 epochs of a 4-epoch run")):
        with pytest.raises(ConfigError, match=re.escape(words)):
            replace(BASE, physical_batch=4, accum_steps=4, batch_warmup=warmup)
    assert replace(BASE, physical_batch=16, batch_warmup="2,6").at_epoch(2).physical_batch == 6  # below b: b = B


def test_steps_counted_every_n_steps_match_a_hand_count():
    rows = []
    config = replace(BASE, physical_batch=4, accum_steps=4, epochs=3, eval_every_steps=4)
    result = train(config, on_epoch=rows.append)
    # 6 windows an epoch (the last of 10 samples): epoch ends at steps 6, 12, 18; evaluations at 4, 8, 12, 16.
    assert [(r.get("epoch"), r.get("step", r.get("steps"))) for r in rows] == [
        (None, 4), (1, 6), (None, 8), (None, 12), (2, 12), (None, 16), (3, 18)]
    within = {r["step"]: r for r in rows if "epoch" not in r}
    # At step 12 the evaluation within the epoch and the epoch's own see the same weights.
    assert within[12]["step_val_acc"] == rows[4]["val_acc"] and within[12]["step_val_loss"] == rows[4]["val_loss"]
    assert all(0 <= r["step_val_acc"] <= 1 for r in within.values())
    plain = train(replace(config, eval_every_steps=0))
    assert torch.equal(weights(plain.model), weights(result.model))  # evaluating changes nothing in training
    assert len(result.history) == 3  # the run's history (and its final metrics) is the epochs'


def test_a_resumed_run_gives_its_evaluations_within_epochs_again(tmp_path):
    config = replace(BASE, physical_batch=4, accum_steps=4, epochs=3, eval_every_steps=4)
    whole = []
    train(config, on_epoch=whole.append)

    def stop_after_epoch_2(row):
        if row.get("epoch") == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(config, on_epoch=stop_after_epoch_2, checkpoint=Checkpointing(str(tmp_path)))
    resumed = []
    train(config, on_epoch=resumed.append, checkpoint=Checkpointing(str(tmp_path)))
    timing = ("epoch_time_s", "samples_per_s")
    assert [{k: v for k, v in r.items() if k not in timing} for r in resumed] == \
        [{k: v for k, v in r.items() if k not in timing} for r in whole]


def test_a_branch_repeats_the_reference_run_bitwise_until_it_branches():
    # The critical_batch study's premise: a batch_warmup that repeats the reference's B for t epochs, under a
    # constant schedule after the warmup, is the reference run until epoch t, and then trains at its own B.
    reference = replace(BASE, physical_batch=4, accum_steps=2, schedule="constant", epochs=4)
    branch = replace(reference, accum_steps=8, batch_warmup="8,8", epochs=3)
    ref, got = train(reference).history, train(branch).history
    same = ("train_loss", "val_loss", "val_acc", "steps", "current_lr")
    assert [{k: r[k] for k in same} for r in got[:2]] == [{k: r[k] for k in same} for r in ref[:2]]
    assert got[2]["steps"] == ref[1]["steps"] + 3  # 90 samples in windows of 32
    assert got[2]["current_lr"] == pytest.approx(4 * ref[2]["current_lr"])  # the linear rule, B 8 -> 32
    assert got[2]["val_loss"] != ref[2]["val_loss"]
