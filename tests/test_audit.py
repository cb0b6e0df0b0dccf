"""`batchsweep audit` against the catalog of accumulation mistakes (tests/programs/catalog.py): it names each
one and passes the correct loop, on per-sample and per-token losses, in float64 and float32."""
import json
import math
import re

import pytest
import torch
from mlflow import MlflowClient

from sweeps.audit import Run, first_parting, main
from tests.conftest import ROOT

CATALOG = ROOT / "tests" / "programs" / "catalog.py"
# (mistake, loss) -> the verdict. On a per-token loss, dividing each micro-batch's mean by k is first of all a
# mean of micro-batch means (every window differs), and the audit names the first difference; on a per-sample
# loss with micro-batches of equal size a mean of means is exact, as it should be.
EXPECTED = {
    ("none", "sample"): "exact", ("none", "token"): "exact",
    ("zero_grad", "sample"): "zero_grad_per_micro_batch", ("zero_grad", "token"): "zero_grad_per_micro_batch",
    ("not_divided", "sample"): "loss_not_divided", ("not_divided", "token"): "loss_not_divided",
    ("short_window", "sample"): "short_window_divided_by_k", ("short_window", "token"): "mean_of_micro_batch_means",
    ("skip_short_window", "sample"): "short_window_skipped", ("drop_last", "sample"): "short_window_extra",
    ("mean_of_means", "sample"): "exact", ("mean_of_means", "token"): "mean_of_micro_batch_means",
    ("step_per_micro", "sample"): "step_per_micro_batch", ("step_per_micro", "token"): "step_per_micro_batch",
    ("batchnorm", "sample"): "batchnorm", ("unseeded", "sample"): "not_reproducible",
    ("schedule_per_micro", "sample"): "schedule_per_micro_batch", ("lr_times_k", "sample"): "lr_differs",
}
# float32's looser tolerance matters where the verdict rests on a small difference, or on none: a correct
# loop on padded tokens (exact within 1e-5 over the epoch), a mean of micro-batch means on them (a small
# difference at step 1), and seven windows that agree before a short one that does not. The gross mistakes,
# and the per-sample loops that float64 finds exact, are checked in float64 only.
FLOAT32 = (("none", "token"), ("mean_of_means", "token"), ("short_window", "sample"))
CASES = [(*case, floats) for case in sorted(EXPECTED) for floats in ("float64", "float32")
         if floats == "float64" or case in FLOAT32]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('audit')}/mlflow.db"


def study(folder, mistake: str, loss: str, floats: str, print_lr: str = "yes", momentum: float = 0.0,
          weight_decay: float = 0.0, optimizer: str = "sgd", decay: str = "all", autocast: str = "no",
          clip: float = 0.0, frozen_bn: str = "no", class_weights: str = "no", warmup: int = 0,
          loss_scale: float = 2.0 ** 16, schedule: str = "exponential", epochs: int = 10, base_lr: float = 0.1):
    path = folder / "catalog.toml"
    path.write_text(f'''name = "catalog"
[program]
command = ["{{python}}", "{CATALOG}", "--batch-size", "{{physical_batch}}", "--accum", "{{accum_steps}}",
           "--lr", "{{lr}}", "--seed", "{{seed}}", "--epochs", "{{epochs}}", "--max-steps", "{{max_steps}}",
           "--mistake", "{{mistake}}", "--loss", "{{per}}", "--dtype", "{{floats}}", "--print-lr", "{print_lr}",
           "--momentum", "{momentum}", "--weight-decay", "{weight_decay}", "--optimizer", "{optimizer}",
           "--decay", "{decay}", "--autocast", "{autocast}", "--clip", "{clip}",
           "--frozen-bn", "{frozen_bn}", "--class-weights", "{class_weights}", "--warmup", "{warmup}",
           "--loss-scale", "{loss_scale}", "--schedule", "{schedule}"]
[fixed]
epochs = {epochs}
base_lr = {base_lr}
mistake = "{mistake}"
per = "{loss}"
floats = "{floats}"
''')
    return path


def assert_every_run_is_a_nested_mlflow_run_and_the_verdict_a_tag(store):
    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("catalog-audit").experiment_id],
                              order_by=["attributes.start_time DESC"])
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)  # this audit's: the latest
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.data.tags["verdict"] == "loss_not_divided" and parent.info.status == "FINISHED"
    assert parent.data.tags["mlflow.note.content"].startswith("verdict: loss_not_divided. ")
    assert len(children) == 6 and all(r.info.status == "FINISHED" for r in children)
    assert {r.data.tags["audit.role"] for r in children} == {"start", "accumulated", "true batch", "repeat"}


def assert_a_bar_over_each_runs_steps(out: str, err: str):
    """Each run of the table on stdout had a frame at step 0 and one at its last step, under its number."""
    rows = [re.fullmatch(r"(.+?)\s+(\d+)\s+(\d+)\s+\d+\s+(epoch|\d+)\s+(\d+)", line) for line in out.splitlines()]
    rows = [m.groups() for m in rows if m]
    frames = err.split("\r")
    assert rows and not any(f.startswith(f"run {len(rows) + 1}: ") for f in frames)
    for i, (name, b, k, max_steps, steps) in enumerate(rows, 1):
        what = "an epoch" if max_steps == "epoch" else f"to step {max_steps}"
        own = [f for f in frames if f.startswith(f"run {i}: {name} b{b} k{k}, {what}: ")]
        done = f"{steps}/{steps} [" if max_steps != "epoch" else f" {steps}step ["
        assert own and ("0step [" in own[0] or f" 0/{max_steps} [" in own[0]) and done in own[-1], (i, own)
        assert "loss=" not in own[0] and "loss=" in own[-1]


@pytest.mark.parametrize("decay, weight_decay, taken_out", [
    ("all", 5e-4, "0.81 of the update before (momentum) and 2.39e-05 of the weights (weight decay)"),
    ("matrices", 1e-2, "0.81 of the update before (momentum) and 0.000478 of the matrices (weight decay; none "
                       "measurable on the 1-D tensors)")])
def test_a_short_window_is_named_through_the_momentum_and_weight_decay_both_runs_hold(decay, weight_decay, taken_out,
                                                                                      tmp_path, store, capsys):
    """SGD with momentum 0.9 and weight decay adds to both runs' updates a share of the update before and of the
    weights, which hid the short window's 2/4 (read as mean_of_micro_batch_means); taken out, the ratio is 2/4
    at cosine 1 again, the momentum's share 0.9 times the LR's decay of that step, and weight decay's the step's
    LR (0.1 x 0.9^7) times weight_decay. So too where the biases are not decayed (nanoGPT's param groups),
    which read as mean_of_micro_batch_means while weight decay's share was fitted on every weight alike."""
    path = study(tmp_path, "short_window", "sample", "float32", momentum=0.9, weight_decay=weight_decay,
                 decay=decay)
    code = main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")])
    out = capsys.readouterr().out
    assert code == 1 and "verdict: short_window_divided_by_k\n" in out, out
    assert f"taken out: {taken_out}\n" in out, out
    found = json.loads((tmp_path / "audit.json").read_text())
    assert found["first_differing_update"] == 8 and found["update_ratio"] == pytest.approx(2 / 4, rel=1e-4)
    assert found["update_cosine"] > 0.9999 and found["momentum_share"] == pytest.approx(0.81, rel=1e-3)
    shares = {key: value for key, value in found.items() if key.startswith("weight_decay")}
    assert shares == {"weight_decay_share" if decay == "all" else "weight_decay_2d_share":
                      pytest.approx(-0.1 * 0.9 ** 7 * weight_decay, rel=1e-2)}
    assert found["runs"] == 6  # the epoch's pair, the pair before the last update, its repeat, and one to the step
    # before that, for the update before


@pytest.mark.parametrize("mistake, verdict", [("none", "within_rounding"), ("not_divided", "loss_not_divided")])
def test_under_bf16_autocast_rounding_is_not_named_a_mistake_and_a_mistake_still_is(mistake, verdict, tmp_path, store,
                                                                                      capsys):
    """A correct loop whose forward runs in bf16 (autocast, float32 weights) parts from the true batch at update 1
    by rounding alone, 2e-3 of the update on padded tokens, which read as mean_of_micro_batch_means: the audit
    says it cannot tell a mistake from rounding there, and how to audit instead (exit status 2)."""
    path = study(tmp_path, mistake, "token", "float32", autocast="bf16")
    code = main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")])
    out = capsys.readouterr().out
    found = json.loads((tmp_path / "audit.json").read_text())
    assert found["verdict"] == verdict and found["first_differing_update"] == 1, out
    if verdict == "within_rounding":
        assert code == 2 and 1e-4 < found["update_difference"] < 1e-2, found
        assert "Audit in float64, or in float32 with autocast off" in out
    else:
        assert code == 1 and found["update_ratio"] == pytest.approx(4, rel=0.02)


@pytest.mark.parametrize("mistake, scale, verdict, code", [
    ("not_divided", 2 ** 18, "accumulated_step_skipped", 1), ("none", 2 ** 19, "true_batch_step_skipped", 2),
    ("not_divided", 2 ** 16, "loss_not_divided", 1)])
def test_a_step_that_a_grad_scaler_skipped_in_one_run_is_named_not_taken_for_zero_grad(mistake, scale, verdict, code,
                                                                                        tmp_path, store, capsys):
    """Under fp16 autocast a GradScaler skips a step whose gradients overflowed: the update is then exactly zero,
    which read as zero_grad_per_micro_batch (r 0). The catalog's first step overflows at a scale between 2^17
    and 2^17.6 with an undivided loss (its gradients k times larger), between 2^18 and 2^18.6 in the true batch,
    whose fp16 sums are over b*k samples, and between 2^19 and 2^19.6 in a correct loop's micro-batches: at 2^18
    the undivided loss is named by its skipped step, at 2^19 the correct loop is not called a mistake, and at the
    default 2^16 the undivided loss is named as without a GradScaler."""
    path = study(tmp_path, mistake, "sample", "float32", autocast="fp16", loss_scale=scale)
    assert main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")]) == code
    out = capsys.readouterr().out
    found = json.loads((tmp_path / "audit.json").read_text())
    assert found["verdict"] == verdict and found["first_differing_update"] == 1, out
    if verdict.endswith("skipped"):
        assert "first update where they part: 1 of 8\n" in out and "update_ratio" not in found, out
        assert "with the GradScaler off (bf16 autocast, or float32)" in out, out
    else:
        assert found["update_ratio"] == pytest.approx(4, rel=0.01)


def test_an_undivided_loss_under_gradient_clipping_says_what_hides_it(tmp_path, store, capsys):
    """Clipping cuts both runs' gradients to its threshold: an undivided loss changes the update's length by
    clip_grad_norm_'s eps only (in float32 it would read exact). The verdict says so, and how to audit."""
    path = study(tmp_path, "not_divided", "sample", "float64", clip=0.05)
    code = main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")])
    out = capsys.readouterr().out
    found = json.loads((tmp_path / "audit.json").read_text())
    assert code == 1 and found["verdict"] == "update_scaled" and found["first_differing_update"] == 1, out
    assert 0 < abs(found["update_ratio"] - 1) < 1e-3 and found["update_cosine"] > 1 - 1e-9, found
    assert "gradient clipping (clip_grad_norm_" in out and "audit with clipping off" in out, out


@pytest.mark.parametrize("mistake, verdict, code", [("none", "exact", 0),
                                                   ("clip_per_micro", "differs_under_clipping", 1)])
def test_a_clip_inside_the_micro_batch_loop_is_told_from_a_mean_of_means(mistake, verdict, code, tmp_path, store,
                                                                        capsys):
    """clip_grad_norm_ after every micro-batch's backward() cuts the window's partial sums: the update keeps the
    true batch's length (both are cut to the threshold) and turns, which read as mean_of_micro_batch_means on a
    per-sample loss, where a mean of means is exact. Clipped once per window, the loop is exact."""
    path = study(tmp_path, mistake, "sample", "float32", clip=0.5)
    assert main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")]) == code
    out = capsys.readouterr().out
    found = json.loads((tmp_path / "audit.json").read_text())
    assert found["verdict"] == verdict, out
    if code:
        assert found["first_differing_update"] == 1 and abs(found["update_length_ratio"] - 1) < 1e-5, found
        assert found["update_cosine"] < 0.999 and "Clipping inside the micro-batch loop" in out, out


@pytest.mark.parametrize("mistake, loss, verdict", [("mean_of_means", "token", "mean_of_micro_batch_means"),
                                                   ("not_divided", "sample", "update_scaled"),
                                                   ("zero_grad", "token", "unexplained")])
def test_adams_first_update_is_not_taken_for_clipping(mistake, loss, verdict, tmp_path, store, capsys):
    """Adam's first update is about the LR on every weight, whatever the gradient: both runs' updates have one
    length there, as under clipping, and also one size on each weight, which clipping does not give. A mean of
    means is named (it read as differs_under_clipping); an undivided loss, whose scale Adam divides away, and
    zero_grad per micro-batch, whose 1/k Adam hides (r = cosine 0.954), say that Adam may hide them."""
    path = study(tmp_path, mistake, loss, "float64", optimizer="adam")
    assert main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")]) == 1
    out = capsys.readouterr().out
    found = json.loads((tmp_path / "audit.json").read_text())
    assert found["verdict"] == verdict and found["first_differing_update"] == 1, out
    assert abs(found["update_length_ratio"] - 1) < 1e-3, found
    sizes, difference = found["update_magnitude_difference"], found["update_difference"]
    assert sizes < 1e-4 or sizes < 0.05 * difference, found  # one size on each weight, but where signs differ
    if verdict != "mean_of_micro_batch_means":
        assert "Adam's first update is about the LR on every weight" in out, out


@pytest.mark.parametrize("mistake, print_lr, verdict", [("not_divided", "yes", "loss_not_divided"),
                                                       ("zero_grad", "no", "zero_grad_per_micro_batch")])
def test_after_a_warmup_from_lr_0_the_first_update_that_moves_is_the_first(mistake, print_lr, verdict, tmp_path,
                                                                           store, capsys):
    """transformers' linear warmup starts at LR 0: the runs part at update 2, the first that moves the weights,
    where a mistake of every window is named (an undivided loss read as update_scaled, zero_grad as
    unexplained). The rows' LRs say that update 1 moved nothing, or else the start's weights do."""
    path = study(tmp_path, mistake, "sample", "float64", print_lr=print_lr, warmup=3)
    assert main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")]) == 1
    found = json.loads((tmp_path / "audit.json").read_text())
    assert found["verdict"] == verdict and found["first_differing_update"] == 2, capsys.readouterr().out
    if mistake == "zero_grad":  # its rows, in the true batch's scale, part at step 3: tried at updates 2 and 1
        assert found["compared"]["after step 1"] <= found["tolerance"]
        assert found["runs"] == 8  # the epoch's pair, those two pairs, the repeat, and one start for the rest


@pytest.mark.parametrize("mistake, verdict, code", [("none", "exact", 0), ("not_divided", "loss_not_divided", 1)])
def test_a_frozen_batchnorm_is_audited_as_any_layer(mistake, verdict, code, tmp_path, store, capsys):
    """A BatchNorm in eval mode (fine-tuning) normalizes (b, k) and (b*k, 1) by the same statistics: the loop is
    exact, and an undivided loss beside it is named, where any difference passed as batchnorm (exit status 0)."""
    path = study(tmp_path, mistake, "sample", "float64", frozen_bn="yes")
    assert main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store]) == code
    assert f"verdict: {verdict}\n" in capsys.readouterr().out


@pytest.mark.parametrize("mistake, verdict", [("none", "exact"), ("mean_of_means", "mean_of_micro_batch_means")])
def test_a_loss_weighted_by_class_is_a_mean_of_means_unless_divided_by_the_windows_weights(mistake, verdict, tmp_path,
                                                                                         store, capsys):
    """CrossEntropyLoss(weight=...) divides its mean by the micro-batch's sum of weights, which differs between
    micro-batches of the same size: its micro-batch means, averaged, are a mean of means, where on an unweighted
    per-sample loss they are exact; the window's weighted sum over its sum of weights is exact."""
    path = study(tmp_path, mistake, "sample", "float64", class_weights="yes")
    main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store])
    assert f"verdict: {verdict}\n" in capsys.readouterr().out


def test_a_short_window_under_adam_is_unexplained_and_says_where_to_look(tmp_path, store, capsys):
    """Adam divides a window's scale away: the short window's update is not a multiple of the true batch's, and
    the verdict says where the difference is and how to have it named."""
    path = study(tmp_path, "short_window", "sample", "float64", optimizer="adam")
    code = main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store])
    out = capsys.readouterr().out
    assert code == 1 and "first update where they part: 8 of 8;" in out and "verdict: unexplained\n" in out, out
    assert "Only the epoch's last update differs: look at its last window" in out and "audit with SGD" in out
    assert "ends in a short micro-batch, which a mean of micro-batch means" in out


@pytest.mark.parametrize("epochs, verdict", [(6, "unexplained"), (1, "exact")])
def test_a_last_window_at_a_schedules_tail_is_audited_where_the_study_trains_it(epochs, verdict, tmp_path, store,
                                                                               capsys):
    """A cosine to 0 over the run's {epochs}, Adam, and a short last window divided by k (float32, b = 3, k = 3: 26
    full windows and one of 2). Run for one epoch, that window is at the schedule's tail (LR 3.4e-5): the weights
    differ by 4e-6, within float32's 1e-5, and it read as exact. The study trains 6 epochs, where epoch 1 ends at
    94% of the LR: run to the same step under that schedule, they part at the last update by 1e-3. A study of one
    epoch trains with that window at the tail: exact there, after the two runs."""
    path = study(tmp_path, "short_window", "sample", "float32", optimizer="adam", schedule="cosine", epochs=epochs,
                 base_lr=0.01)
    code = main(["--study", str(path), "--physical-batch", "3", "--accum-steps", "3", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")])
    out = capsys.readouterr().out
    found = json.loads((tmp_path / "audit.json").read_text())
    assert found["verdict"] == verdict and code == (1 if epochs > 1 else 0), out
    assert found["compared"]["after 27 steps"] < 1e-5
    if epochs == 1:
        assert found["runs"] == 2 and "schedule_epochs" not in found
        return
    assert found["schedule_epochs"] == 6 and found["compared"]["after 27 steps of the schedule over 6 epochs"] > 1e-4
    assert found["first_differing_update"] == 27 and "Only the epoch's last update differs" in out
    assert re.search(r"true batch\s+9\s+1\s+6\s+27\s+27\n", out), out  # the runs under the study's epochs


def test_an_l2_penalty_added_to_every_micro_batch_is_named_with_its_share_of_the_weights(tmp_path, store, capsys):
    """λ‖w‖² in each micro-batch's loss: a window's gradient holds (k − 1)·2λ·w more than the true batch's, so the
    updates differ by lr·(k − 1)·2λ = 0.1 · 3 · 2e-3 of the weights. It read as mean_of_micro_batch_means."""
    path = study(tmp_path, "penalty_per_micro", "sample", "float64")
    assert main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")]) == 1
    found = json.loads((tmp_path / "audit.json").read_text())
    assert found["verdict"] == "weight_penalty_per_micro_batch", capsys.readouterr().out
    assert found["weight_penalty_share"] == pytest.approx(-0.1 * 3 * 2e-3, rel=1e-6)
    assert found["penalized"] == "weights"


def test_clipping_is_one_length_with_other_sizes_where_adam_and_a_small_difference_are_not():
    """Figures of real audits of the catalog (float64 but the first): a clip per micro-batch (float32), zero_grad
    on tokens under Adam (one length, signs differ), and an L2 penalty added to every micro-batch's loss,
    k times a window (no clipping; its length 1 + 8.2e-4)."""
    from sweeps.audit import Update

    assert Update(0.98691, 0.98691, 0.16180, 0.9999991, 0.15827, None).clipped
    assert not Update(0.95436, 0.95453, 0.30153, 0.99982, 0.00327, None).clipped
    assert not Update(1.00062, 0.99980, 0.01995, 1.00082, 0.01974, None).clipped


def test_a_mistake_of_every_window_is_never_named_for_a_later_update():
    """zero_grad per micro-batch and an undivided loss part the runs at step 1. Where they part later (Adam
    hiding a short window's scale, say), the update's figures may look like them, and the verdict says it is
    unexplained rather than name a mistake the loop cannot have."""
    from sweeps.audit import classify

    assert classify(0.6111, 0.9106, 4, first=True, last=False) == "zero_grad_per_micro_batch"
    assert classify(0.6111, 0.9106, 4, first=False, last=True) == "unexplained"
    assert classify(4.0, 1.0, 4, first=True, last=False) == "loss_not_divided"
    assert classify(4.0, 1.0, 4, first=False, last=False) == "update_scaled"


@pytest.mark.parametrize("mistake, loss, floats", CASES)
def test_the_audit_names_each_mistake_of_the_catalog(tmp_path, store, capsys, mistake, loss, floats):
    verdict = EXPECTED[(mistake, loss)]
    code = main(["--study", str(study(tmp_path, mistake, loss, floats)), "--physical-batch", "8", "--accum-steps",
                 "4", "--tracking-uri", store, "--json", str(tmp_path / "audit.json")])
    out, err = capsys.readouterr()
    assert f"verdict: {verdict}\n" in out, out
    assert code == {"exact": 0, "batchnorm": 0, "not_reproducible": 2}.get(verdict, 1)
    assert_a_bar_over_each_runs_steps(out, err)
    found = json.loads((tmp_path / "audit.json").read_text())
    assert found["verdict"] == verdict and found["dtype"] == floats
    assert found["tolerance"] == {"float64": 1e-10, "float32": 1e-5}[floats]
    if verdict == "loss_not_divided":
        assert found["update_ratio"] == pytest.approx(4, rel=0.01)  # k
        if loss == "sample":
            assert_every_run_is_a_nested_mlflow_run_and_the_verdict_a_tag(store)
    if verdict == "schedule_per_micro_batch":  # ExponentialLR(0.9) stepped before the step, per micro-batch
        assert found["lr_step"] == 1 and found["lr_a"] == pytest.approx(0.1 * 0.9 ** 4)
        assert found["lr_t"] == pytest.approx(0.1 * 0.9)
    if verdict == "short_window_divided_by_k":
        assert found["first_differing_update"] == 8 and found["update_ratio"] == pytest.approx(2 / 4, rel=1e-5)
        assert found["runs"] == 5  # the epoch's pair, the pair one step before, the repeat; without momentum, no more
    if verdict == "short_window_skipped":  # 7 full windows and a short one of 2 micro-batches, left unstepped
        assert (found["steps_accumulated"], found["steps_true_batch"]) == (7, 8)
    if verdict == "short_window_extra":  # 240 samples: 30 micro-batches of 8 but 7 batches of 32 (16 dropped)
        assert (found["steps_accumulated"], found["steps_true_batch"]) == (8, 7)
    # A difference in the weights is named only once the true batch has given the same weights twice; a verdict
    # from the epoch's step counts or LRs needs no weights, and no run is made that a verdict does not need.
    from_rows = ("short_window_skipped", "short_window_extra", "step_per_micro_batch", "schedule_per_micro_batch",
                 "lr_differs")
    assert ("repeat_rel_diff" in found) == (verdict not in ("exact", *from_rows))
    first = f"after {found['steps_true_batch']} steps" if found["steps_accumulated"] == found["steps_true_batch"] \
        else f"after {found['steps_accumulated']} and {found['steps_true_batch']} steps"
    assert list(found["compared"])[0] == first  # the epoch's runs, compared first
    if verdict in from_rows:
        assert list(found["compared"]) == [first] and found["runs"] == 2
    if verdict == "exact":  # and the true batch again under the study's 10 epochs, whose LRs came out the same
        assert list(found["compared"]) == [first] and found["runs"] == 3 and "schedule_epochs" not in found
    assert (found.get("repeat_rel_diff", 0) > found["tolerance"]) == (verdict == "not_reproducible")


@pytest.mark.parametrize("b, verdict, code", [(256, "nothing_accumulated", 2), (64, "exact", 0)])
def test_a_micro_batch_that_holds_the_epoch_tests_nothing_and_says_so(b, verdict, code, tmp_path, store, capsys):
    """At b = 256 the catalog's 240 samples are one micro-batch: (b, k) is then (b*k, 1) whatever the loop does,
    and an `exact` would reassure about a loop that never accumulated. At b = 64 the epoch is one window of four
    micro-batches (64, 64, 64, 48), which tests the loop: exact."""
    path = study(tmp_path, "none", "sample", "float64")
    assert main(["--study", str(path), "--physical-batch", str(b), "--accum-steps", "4", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")]) == code
    out = capsys.readouterr().out
    found = json.loads((tmp_path / "audit.json").read_text())
    assert found["verdict"] == verdict and found["runs"] == 3, out  # the pair, and (b, 1) over the epoch
    assert (found["steps_accumulated"], found["steps_true_batch"]) == (1, 1)
    assert re.search(rf"per micro-batch\s+{b}\s+1\s+1\s+epoch\s+{1 if code else 4}\n", out), out
    if code:
        assert "equals the true batch whatever the loop does" in out


def test_without_lr_rows_a_schedule_per_micro_batch_is_a_scaled_update(tmp_path, store, capsys):
    """The same gradient, 0.9 ** 3 as long (cosine 1 to rounding): a scale, not a mean of micro-batch means."""
    code = main(["--study", str(study(tmp_path, "schedule_per_micro", "sample", "float64", print_lr="no")),
                 "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store])
    out = capsys.readouterr().out
    assert code == 1 and "verdict: update_scaled\n" in out, out
    assert "exactly the true batch's direction but 0.729 times its length" in out


class Parting:
    """Runs whose weights agree up to update `u` and differ from it on, and the steps each run was taken to."""

    def __init__(self, u: int):
        self.u, self.steps = u, []

    def run(self, name: str, b: int, k: int, max_steps: int, lr=None) -> Run:
        self.steps.append(max_steps)
        parted = name == "accumulated" and max_steps >= self.u
        return Run(name, b, k, max_steps, 0.1, 1, {"w": torch.tensor([max_steps + 1.0 + parted])})


@pytest.mark.parametrize("n", [1, 2, 3, 8, 13])
def test_the_first_update_where_runs_part_is_found_anywhere_and_where_the_rows_point_with_two_pairs(n):
    """Wherever the loss rows point (nowhere, or at any step: rounded rows part late, rows in a mistake's scale
    at once), the bisection finds the first update that differs without making the epoch's runs again; where
    they point right (at the parting or the step after it), it takes two pairs of runs at most, and one for the
    last update when the rows agree throughout."""
    for u in range(1, n + 1):
        for rows in (None, *range(1, n + 1)):
            auditor = Parting(u)
            assert first_parting(auditor, 8, 4, n, 1e-10, rows) == u, (u, rows)
            assert max(auditor.steps, default=0) < n  # runs of n steps are the epoch's, made already
            assert len(auditor.steps) <= 2 * (math.ceil(math.log2(n)) + 2)  # pairs, however wrong the rows are
            if rows in (u, u + 1) or rows is None and u == n:
                assert len(auditor.steps) <= 4, (u, rows, auditor.steps)
    last = Parting(n)
    first_parting(last, 8, 4, n, 1e-10, None)
    assert last.steps == ([n - 1, n - 1] if n > 1 else [])


@pytest.mark.parametrize("rows, expected", [
    (3, "the accumulated run made 3 optimizer steps where {max_steps} was 2: stop the script after that many"),
    (0, 'the script printed no {"step": s, "loss": l} row: print one per optimizer step'),
])
def test_a_script_that_runs_on_or_prints_no_rows_is_one_line(tmp_path, store, capsys, rows, expected):
    """The audit's runs stop after {max_steps} and count steps by their rows: without either, no verdict holds."""
    (tmp_path / "own.py").write_text(f"""import json, os, sys, torch
for step in range(1, {rows} + 1):  # whatever --max-steps says
    print(json.dumps({{"step": step, "loss": 1.0}}))
torch.save({{"w": torch.tensor([float(sys.argv[3])])}}, os.environ["BATCHSWEEP_STATE"])  # b: the epochs differ
""")
    (tmp_path / "own.toml").write_text('name = "own"\n[program]\ncommand = ["{python}", "own.py", "{max_steps}", '
                                       '"{epochs}", "{physical_batch}"]\n')
    assert main(["--study", str(tmp_path / "own.toml"), "--physical-batch", "8", "--accum-steps", "4",
                 "--tracking-uri", store]) == 2
    err = capsys.readouterr().err
    assert err.rsplit("\r", 1)[-1] == f"error: {expected}\n"  # after the bar, which leave=False clears


def test_rows_per_micro_batch_beside_equal_weights_are_one_line_not_a_mistake(tmp_path, store, capsys):
    """A script that prints a row per micro-batch ends both runs with the same weights: its rows do not count its
    optimizer steps, and the audit says so (exit status 2) rather than name step_per_micro_batch (1)."""
    (tmp_path / "own.py").write_text("""import json, os, sys, torch
for micro in range(32 // int(sys.argv[3])):  # one window of 32: micro-batches of b
    print(json.dumps({"step": 1, "loss": 1.0}))
torch.save({"w": torch.tensor([1.0])}, os.environ["BATCHSWEEP_STATE"])
""")
    (tmp_path / "own.toml").write_text('name = "own"\n[program]\ncommand = ["{python}", "own.py", "{max_steps}", '
                                       '"{epochs}", "{physical_batch}"]\n')
    assert main(["--study", str(tmp_path / "own.toml"), "--physical-batch", "8", "--accum-steps", "4",
                 "--tracking-uri", store]) == 2
    assert capsys.readouterr().err.rsplit("\r", 1)[-1] == (
        'error: the runs end with equal weights but printed 4 and 1 step rows: print one {"step": s, "loss": l} '
        'row per optimizer step, after step(), not one per micro-batch\n')


@pytest.mark.parametrize("body, expected", [
    ('[fixed]\nbase_lr = 0.1', "program.command: pass {max_steps} on to the script"),
])
def test_a_study_the_audit_cannot_use_is_one_line(tmp_path, capsys, body, expected):
    path = tmp_path / "s.toml"
    path.write_text(f'name = "s"\n{body}\n[program]\ncommand = ["{{python}}", "x.py", "{{epochs}}"]\n')
    assert main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}: {expected}: the audit stops runs after a given number of steps, within one " \
                  f"epoch\n"


@pytest.mark.parametrize("where, expected", [
    ("a-file/audit.json", "its folder cannot be made (File exists): name a file in a folder you can write"),
    ("/proc/batchsweep-audit.json", "cannot be written (No such file or directory): name a file in a folder you can "
                                    "write")])
def test_a_json_path_that_cannot_be_written_is_refused_before_any_run(tmp_path, capsys, where, expected):
    (tmp_path / "a-file").write_text("")
    path = where if where.startswith("/") else str(tmp_path / where)
    store = tmp_path / "mlflow.db"
    assert main(["--study", str(study(tmp_path, "none", "sample", "float64")), "--physical-batch", "8",
                 "--accum-steps", "4", "--tracking-uri", f"sqlite:///{store}", "--json", path]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"error: --json {path}") and err.endswith(f" {expected}\n") and err.count("\n") == 1, err
    assert out == "" and not store.exists()  # no run was made, nothing recorded
