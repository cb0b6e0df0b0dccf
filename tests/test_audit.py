"""`batchsweep audit` against the catalog of accumulation mistakes (tests/programs/catalog.py): it names each
one and passes the correct loop, on per-sample and per-token losses, in float64 and float32."""
import json
import re

import pytest
from mlflow import MlflowClient

from batchsweep.sweeps.audit.command import main
from batchsweep.sweeps.audit.traces import SHORT_WINDOW
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
# The catalog's line that each verdict names (where the tracer saw the call made): the loss's backward() for a
# mistake of the loss.
LINES = {"zero_grad_per_micro_batch": "opt.zero_grad()  # the mistake", "step_per_micro_batch": "scaler.step(opt)",
         **dict.fromkeys(("loss_not_divided", "mean_of_micro_batch_means", "short_window_divided_by_k"),
                         "scaler.scale(loss).backward()"),
         "short_window_skipped": "scaler.step(opt)  # opt.step()"}


def catalog_line(text: str) -> str:
    return f"catalog.py:{next(i for i, line in enumerate(CATALOG.read_text().splitlines(), 1) if text in line)}"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('audit')}/mlflow.db"


def study(folder, mistake: str, loss: str, floats: str, print_lr: str = "yes", momentum: float = 0.0,
          weight_decay: float = 0.0, optimizer: str = "sgd", decay: str = "all", autocast: str = "no",
          clip: float = 0.0, frozen_bn: str = "no", class_weights: str = "no", warmup: int = 0,
          loss_scale: float = 2.0 ** 16, schedule: str = "exponential", epochs: int = 10, base_lr: float = 0.1,
          lr: str = "{lr}", extra: tuple[str, ...] = (), bare: bool = False, max_steps: bool = False):
    """The catalog's study file; `bare`: a command that passes only b, k and the seed (and the catalog's own
    switches), and a script that prints no rows and saves no weights. `max_steps`: the command passes {max_steps}
    on (which the catalog stops at, as the tracer does), so the audit runs the script to each step it compares
    rather than read that step from a longer run."""
    path = folder / "catalog.toml"
    if bare:
        path.write_text(f'''name = "catalog"
[program]
command = ["{{python}}", "{CATALOG}", "--batch-size", "{{physical_batch}}", "--accum", "{{accum_steps}}",
           "--seed", "{{seed}}", "--lr", "0.1", "--self-report", "no", "--mistake", "{mistake}", "--loss", "{loss}",
           "--dtype", "{floats}"]
''')
        return path
    path.write_text(f'''name = "catalog"
[program]
command = ["{{python}}", "{CATALOG}", "--batch-size", "{{physical_batch}}", "--accum", "{{accum_steps}}",
           "--lr", "{lr}", "--seed", "{{seed}}", "--epochs", "{{epochs}}",{' "--max-steps", "{max_steps}",' * max_steps}
           "--mistake", "{{mistake}}", "--loss", "{{per}}", "--dtype", "{{floats}}", "--print-lr", "{print_lr}",
           "--momentum", "{momentum}", "--weight-decay", "{weight_decay}", "--optimizer", "{optimizer}",
           "--decay", "{decay}", "--autocast", "{autocast}", "--clip", "{clip}",
           "--frozen-bn", "{frozen_bn}", "--class-weights", "{class_weights}", "--warmup", "{warmup}",
           "--loss-scale", "{loss_scale}", "--schedule", "{schedule}"{"".join(f', "{a}"' for a in extra)}]
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
    # the epoch's pair and the repeat at update 1 (the pair to update 1 is read from the epoch's runs)
    assert len(children) == 3 and all(r.info.status == "FINISHED" for r in children)
    assert {r.data.tags["audit.role"] for r in children} == {"accumulated", "true batch", "repeat"}


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
        assert "loss=" not in own[0]  # (the loss of the script's rows, where it prints any, follows)


@pytest.mark.slow
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
    which read as mean_of_micro_batch_means while weight decay's share was fitted on every weight alike. The first
    command passes {max_steps} on, so the runs to the steps compared are made; the second's are read from the
    epoch's runs, with the same figures."""
    path = study(tmp_path, "short_window", "sample", "float32", momentum=0.9, weight_decay=weight_decay,
                 decay=decay, max_steps=decay == "all")
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
    # the epoch's pair, the last update's repeat, and, where the command takes {max_steps}, the pair before the last
    # update and one to the step before that, for the update before
    assert found["runs"] == (6 if decay == "all" else 3)


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("floats", ["float64", "float32"])
def test_an_undivided_loss_under_gradient_clipping_is_named_from_the_gradients_before_the_clip(floats, tmp_path, store,
                                                                                                capsys):
    """Clipping cuts both runs' gradients to its threshold: an undivided loss changes the update's length by
    clip_grad_norm_'s eps only (in float32 the weights alone would read exact). The windows' gradients, which
    the tracer takes before the clip, are k times apart."""
    path = study(tmp_path, "not_divided", "sample", floats, clip=0.05)
    code = main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")])
    out = capsys.readouterr().out
    found = json.loads((tmp_path / "audit.json").read_text())
    assert code == 1 and found["verdicts"] == ["loss_not_divided"], out
    if floats == "float64":  # the weights part by clip_grad_norm_'s eps, at update 1, with one length
        assert found["first_differing_update"] == 1 and abs(found["update_length_ratio"] - 1) < 1e-3, found
    else:  # the weights agree within float32's tolerance; the gradients' norms at step 1 do not
        assert found["first_differing_gradient"] == 1 and "first_differing_update" not in found, found
    assert found["gradient_ratio"] == pytest.approx(4, rel=1e-4) and found["gradient_cosine"] > 1 - 1e-6, found


@pytest.mark.slow
@pytest.mark.parametrize("mistake, verdict, code", [("none", "exact", 0),
                                                   ("clip_per_micro", "clip_per_micro_batch", 1)])
def test_a_clip_inside_the_micro_batch_loop_is_told_from_a_mean_of_means(mistake, verdict, code, tmp_path, store,
                                                                        capsys):
    """clip_grad_norm_ after every micro-batch's backward() cuts the window's partial sums: the tracer sees it
    called k times a window (by the weights alone it read as mean_of_micro_batch_means on a per-sample loss, where
    a mean of means is exact). Clipped once per window, the loop is exact; its LR decays by 0.9 a step, which the
    study's 10 epochs do not stretch, as a third run, of the true batch under them, shows."""
    path = study(tmp_path, mistake, "sample", "float32", clip=0.5)
    assert main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")]) == code
    out = capsys.readouterr().out
    found = json.loads((tmp_path / "audit.json").read_text())
    assert found["verdict"] == verdict, out
    if code:
        assert found["clip_step"] == 1 and found["runs"] == 2 and "Clip once per window" in out, out
    else:
        assert found["runs"] == 3 and found["last_lr_share"] == pytest.approx(0.9 ** 7), found


@pytest.mark.slow
@pytest.mark.parametrize("mistake, loss, verdict", [("mean_of_means", "token", "mean_of_micro_batch_means"),
                                                   ("not_divided", "sample", "loss_not_divided")])
def test_adams_first_update_hides_no_mistake_from_the_gradients(mistake, loss, verdict, tmp_path, store, capsys):
    """Adam's first update is about the LR on every weight, whatever the gradient: both runs' updates have one
    length there, and also one size on each weight. The windows' gradients before Adam name the mistake: a mean of
    means, and an undivided loss, whose scale Adam divides away (by the updates alone, `update_scaled`)."""
    path = study(tmp_path, mistake, loss, "float64", optimizer="adam")
    assert main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")]) == 1
    out = capsys.readouterr().out
    found = json.loads((tmp_path / "audit.json").read_text())
    assert found["verdict"] == verdict and found["first_differing_update"] == 1, out
    assert abs(found["update_length_ratio"] - 1) < 1e-3, found
    sizes, difference = found["update_magnitude_difference"], found["update_difference"]
    assert sizes < 1e-4 or sizes < 0.05 * difference, found  # one size on each weight, but where signs differ
    if mistake == "not_divided":
        assert found["gradient_ratio"] == pytest.approx(4, rel=1e-6), found


@pytest.mark.slow
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
    if mistake == "zero_grad":  # seen in the loop: no weights needed
        assert found["verdicts"] == [verdict] and found["zero_grad_step"] == 1 and found["runs"] == 2
        return
    assert found["verdict"] == verdict and found["first_differing_update"] == 2, capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("mistake, verdict, code", [("none", "exact", 0), ("not_divided", "loss_not_divided", 1)])
def test_a_frozen_batchnorm_is_audited_as_any_layer(mistake, verdict, code, tmp_path, store, capsys):
    """A BatchNorm in eval mode (fine-tuning) normalizes (b, k) and (b*k, 1) by the same statistics: the loop is
    exact, and an undivided loss beside it is named, where any difference passed as batchnorm (exit status 0)."""
    path = study(tmp_path, mistake, "sample", "float64", frozen_bn="yes", epochs=1)  # (no schedule to stretch)
    assert main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store]) == code
    assert f"verdict: {verdict}\n" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("mistake, verdict", [("none", "exact"), ("mean_of_means", "mean_of_micro_batch_means")])
def test_a_loss_weighted_by_class_is_a_mean_of_means_unless_divided_by_the_windows_weights(mistake, verdict, tmp_path,
                                                                                         store, capsys):
    """CrossEntropyLoss(weight=...) divides its mean by the micro-batch's sum of weights, which differs between
    micro-batches of the same size: its micro-batch means, averaged, are a mean of means, where on an unweighted
    per-sample loss they are exact; the window's weighted sum over its sum of weights is exact."""
    path = study(tmp_path, mistake, "sample", "float64", class_weights="yes", epochs=1)  # (no schedule to stretch)
    main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store])
    assert f"verdict: {verdict}\n" in capsys.readouterr().out


@pytest.mark.slow
def test_a_short_window_under_adam_is_named_from_its_gradient(tmp_path, store, capsys):
    """Adam divides a window's scale away: the short window's update is not a multiple of the true batch's (by the
    updates alone it was unexplained), but its gradient before Adam is 2/4 of the true batch's."""
    path = study(tmp_path, "short_window", "sample", "float64", optimizer="adam")
    code = main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store])
    out = capsys.readouterr().out
    assert code == 1 and "first update where they part: 8 of 8;" in out, out
    assert "before any clipping: the accumulated one is 0.5 x the true batch's" in out, out
    assert "verdict: short_window_divided_by_k\n" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("epochs", [6, 1])
def test_a_last_window_at_a_schedules_tail_is_named_from_its_gradient(epochs, tmp_path, store, capsys):
    """A cosine to 0 over the run's {epochs}, Adam, and a short last window divided by k (float32, b = 3, k = 3: 26
    full windows and one of 2). Run for one epoch, that window is at the schedule's tail (LR 3.4e-5): the weights
    differ by 4e-6, within float32's 1e-5 (by the weights alone it read as exact, and needed a run under the
    study's epochs to part). The gradients' norms before Adam differ at step 27: its gradient is 2/3 of the true
    batch's, whatever the LR and the study's epochs."""
    path = study(tmp_path, "short_window", "sample", "float32", optimizer="adam", schedule="cosine", epochs=epochs,
                 base_lr=0.01)
    code = main(["--study", str(path), "--physical-batch", "3", "--accum-steps", "3", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")])
    out = capsys.readouterr().out
    found = json.loads((tmp_path / "audit.json").read_text())
    assert found["verdicts"] == ["short_window_divided_by_k"] and code == 1, out
    assert found["compared"]["after 27 steps"] < 1e-5 and "schedule_epochs" not in found
    assert found["first_differing_gradient"] == 27 and found["gradient_ratio"] == pytest.approx(2 / 3, rel=1e-4)
    assert found["runs"] == 2  # the epoch's pair (the true batch's weights at the step before are read from its run)


@pytest.mark.slow
def test_an_l2_penalty_added_to_every_micro_batch_is_named_with_its_share_of_the_weights(tmp_path, store, capsys):
    """λ‖w‖² in each micro-batch's loss: a window's gradient holds (k − 1)·2λ·w = 3 · 2e-3 of the weights more
    than the true batch's (by the updates alone it read as mean_of_micro_batch_means, until the fit on them)."""
    path = study(tmp_path, "penalty_per_micro", "sample", "float64")
    assert main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")]) == 1
    found = json.loads((tmp_path / "audit.json").read_text())
    assert found["verdict"] == "weight_penalty_per_micro_batch", capsys.readouterr().out
    assert found["weight_penalty_share"] == pytest.approx(3 * 2e-3, rel=1e-6)
    assert found["penalized"] == "weights"


def test_clipping_is_one_length_with_other_sizes_where_adam_and_a_small_difference_are_not():
    """Figures of real audits of the catalog (float64 but the first): a clip per micro-batch (float32), zero_grad
    on tokens under Adam (one length, signs differ), and an L2 penalty added to every micro-batch's loss,
    k times a window (no clipping; its length 1 + 8.2e-4)."""
    from batchsweep.sweeps.audit.compare import Update

    assert Update(0.98691, 0.98691, 0.16180, 0.9999991, 0.15827, None).clipped
    assert not Update(0.95436, 0.95453, 0.30153, 0.99982, 0.00327, None).clipped
    assert not Update(1.00062, 0.99980, 0.01995, 1.00082, 0.01974, None).clipped


def test_a_mistake_of_every_window_is_never_named_for_a_later_update():
    """zero_grad per micro-batch and an undivided loss part the runs at step 1. Where they part later (Adam
    hiding a short window's scale, say), the update's figures may look like them, and the verdict says it is
    unexplained rather than name a mistake the loop cannot have."""
    from batchsweep.sweeps.audit.diagnose import classify

    assert classify(0.6111, 0.9106, 4, first=True, last=False) == "zero_grad_per_micro_batch"
    assert classify(0.6111, 0.9106, 4, first=False, last=True) == "unexplained"
    assert classify(4.0, 1.0, 4, first=True, last=False) == "loss_not_divided"
    assert classify(4.0, 1.0, 4, first=False, last=False) == "update_scaled"


@pytest.mark.slow
@pytest.mark.parametrize("mistake, loss, floats", CASES)
def test_the_audit_names_each_mistake_of_the_catalog(tmp_path, store, capsys, mistake, loss, floats):
    """The command fixes the LR (--lr 0.1, not {lr}), which no run of the audit changes (a run "at LR 0" for the
    start trained at 0.1 and read as true_batch_step_skipped), and the script prints no rows: what the verdicts
    rest on is the tracer's (a scheduler stepped per micro-batch read as update_scaled, 0.729 = 0.9 ** 3, without
    "lr" in the rows; a step per micro-batch as unexplained by rows printed per window)."""
    verdict = EXPECTED[(mistake, loss)]
    code = main(["--study", str(study(tmp_path, mistake, loss, floats, bare=True)), "--physical-batch", "8",
                 "--accum-steps", "4", "--tracking-uri", store, "--json", str(tmp_path / "audit.json")])
    out, err = capsys.readouterr()
    assert f"verdict: {verdict}\n" in out, out
    assert code == {"exact": 0, "batchnorm": 0, "not_reproducible": 2}.get(verdict, 1)
    assert_a_bar_over_each_runs_steps(out, err)
    found = json.loads((tmp_path / "audit.json").read_text())
    assert found["verdict"] == verdict and found["dtype"] == floats
    assert "contradicted" not in found  # no verdict against what the trace recorded
    if verdict in LINES:  # the verdict names the script's line
        assert "Seen at: " in found["sentence"] and catalog_line(LINES[verdict]) in found["sentence"], found["sentence"]
    assert found["tolerance"] == {"float64": 1e-10, "float32": 1e-5}[floats]
    if verdict == "loss_not_divided":
        assert found["update_ratio"] == pytest.approx(4, rel=0.01)  # k
        if loss == "sample":
            assert_every_run_is_a_nested_mlflow_run_and_the_verdict_a_tag(store)
    if verdict == "schedule_per_micro_batch":  # ExponentialLR(0.9) stepped before the step, per micro-batch
        assert found["lr_step"] == 1 and found["lr_a"] == pytest.approx(0.1 * 0.9 ** 4)
        assert found["lr_t"] == pytest.approx(0.1 * 0.9)
        assert "at step 1 the accumulated run's LR is 0.06561 against the true batch's 0.09" in out, out
    if verdict == "step_per_micro_batch":  # counted by the tracer: 30 micro-batches of 8, 8 windows of 32
        assert (found["steps_accumulated"], found["steps_true_batch"]) == (30, 8)
    if verdict == "zero_grad_per_micro_batch":
        assert found["zero_grad_step"] == 1
    if verdict == "short_window_divided_by_k":
        assert found["first_differing_update"] == 8 and found["update_ratio"] == pytest.approx(2 / 4, rel=1e-5)
        assert found["runs"] == 3  # the epoch's pair (the pair one step before is read from them), the repeat
    if verdict == "short_window_skipped":  # 7 full windows and a short one of 2 micro-batches, left unstepped
        assert (found["steps_accumulated"], found["steps_true_batch"]) == (7, 8)
    if verdict == "short_window_extra":  # 240 samples: 30 micro-batches of 8 but 7 batches of 32 (16 dropped)
        assert (found["steps_accumulated"], found["steps_true_batch"]) == (8, 7)
    # A difference in the weights is named only once the true batch has given the same weights twice; a verdict
    # from the epoch's step counts or LRs needs no weights, and no run is made that a verdict does not need.
    seen = ("step_per_micro_batch", "schedule_per_micro_batch", "lr_differs", "zero_grad_per_micro_batch")
    assert ("repeat_rel_diff" in found) == (verdict not in ("exact", *seen, *SHORT_WINDOW))
    first = f"after {found['steps_true_batch']} steps" if found["steps_accumulated"] == found["steps_true_batch"] \
        else f"after {found['steps_accumulated']} and {found['steps_true_batch']} steps"
    assert list(found["compared"])[0] == first  # the epoch's runs, compared first
    if verdict in seen:
        assert list(found["compared"]) == [first] and found["runs"] == 2 and found["verdicts"] == [verdict]
    if verdict in SHORT_WINDOW:  # and the windows both stepped, which agree: no second fault
        common = min(found["steps_accumulated"], found["steps_true_batch"])
        # (the runs to the steps both made are read from the epoch's)
        assert list(found["compared"]) == [first, f"after the {common} steps both made"] and found["runs"] == 2
        assert found["verdicts"] == [verdict]
    if verdict == "exact":  # (a command without {epochs}: there is no schedule over the study's epochs to check)
        assert list(found["compared"]) == [first] and found["runs"] == 2 and "schedule_epochs" not in found
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


@pytest.mark.slow
@pytest.mark.parametrize("estimate, verdicts, code", [("no", ["exact"], 0), ("yes", ["data_differs"], 2)])
def test_random_draws_before_training_in_proportion_to_b_are_told_from_a_mistake(estimate, verdicts, code,
                                                                                 tmp_path, store, capsys):
    """Micro-batches drawn by torch.randint, as minimal GPT trainers draw them, hold the same samples at (8, 4)
    and (32, 1); a loss estimate over random batches of b before training moves the generator by 10·b draws,
    so the runs train on other data. That read as zero_grad_per_micro_batch (r 0.5); it is data_differs."""
    path = study(tmp_path, "none", "sample", "float64", extra=("--sampler", "random", "--estimate", estimate),
                 epochs=1)  # (no schedule over the study's epochs to stretch)
    assert main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")]) == code
    out = capsys.readouterr().out
    found = json.loads((tmp_path / "audit.json").read_text())
    assert found["verdicts"] == verdicts, out
    if estimate == "yes":
        assert found["data_window"] == 1 and "random draws before training" in out and found["runs"] == 3, out


@pytest.mark.slow
def test_two_faults_in_one_script_are_both_named_in_the_order_met(tmp_path, store, capsys):
    """A short last window never stepped and a mean of micro-batch means on padded tokens (transformers before
    4.46 had both): the step counts name the first, the 7 full windows both runs stepped the second."""
    path = study(tmp_path, "skip_short_window,mean_of_means", "token", "float64")
    assert main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--tracking-uri", store,
                 "--json", str(tmp_path / "audit.json")]) == 1
    out = capsys.readouterr().out
    found = json.loads((tmp_path / "audit.json").read_text())
    assert found["verdicts"] == ["short_window_skipped", "mean_of_micro_batch_means"], out
    assert "verdict: short_window_skipped\n" in out and "verdict: mean_of_micro_batch_means\n" in out
    assert len(found["sentences"]) == 2


@pytest.mark.parametrize("body, expected", [
    ("print(1)", "batchsweep saw no optimizer step of the script"),  # no torch at all
    ("import torch\nw = torch.zeros(2, requires_grad=True)\nopt = torch.optim.SGD([w], lr=0.1)\n"
     "(w.sum()).backward()\nopt.step()", "the tracer saw optimizer steps but no module train")])
def test_a_script_the_tracer_cannot_observe_is_one_line(tmp_path, store, capsys, body, expected):
    """Without an optimizer step (a script without torch) or a model's training forward, nothing can be compared."""
    (tmp_path / "own.py").write_text(body + "\n")
    (tmp_path / "own.toml").write_text('name = "own"\n[program]\ncommand = ["{python}", "own.py", "{physical_batch}", '
                                       '"{accum_steps}"]\n')
    assert main(["--study", str(tmp_path / "own.toml"), "--physical-batch", "8", "--accum-steps", "4",
                 "--tracking-uri", store]) == 2
    err = capsys.readouterr().err.rsplit("\r", 1)[-1]  # after the bar, which leave=False clears
    assert err.startswith(f"error: the accumulated run: {expected}") and err.count("\n") == 1, err


@pytest.mark.parametrize("body, expected", [
    ('[fixed]\nbase_lr = 0.1', "program.command: pass {physical_batch} on to the script"),
])
def test_a_study_the_audit_cannot_use_is_one_line(tmp_path, capsys, body, expected):
    path = tmp_path / "s.toml"
    path.write_text(f'name = "s"\n{body}\n[program]\ncommand = ["{{python}}", "x.py", "{{epochs}}"]\n')
    assert main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}: {expected}: the audit runs it at (b, k) and at (b*k, 1)\n"


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
