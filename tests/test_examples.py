"""The worked examples of docs/programs.md, each swept at a small size: a transformers Trainer script that
prints JSON lines, and a Lightning script that logs through its own MLFlowLogger; and docs/audit.md's real
subjects (Lightning, transformers' Trainer, Accelerate's two loops, a minimal GPT loop under torchrun), audited
as it shows. They need the optional extra (pip install -e '.[scripts]'), which CI installs. And docs/report.md's
regression, whose report compares in val_loss."""
import importlib.util
import json
import math
import shutil

import optuna
import pytest

from tests.conftest import ROOT
from tests.test_sweeps import child_runs, stores, sweep

pytestmark = pytest.mark.slow  # real subject libraries (transformers, Lightning, Accelerate)

EXTRA = "pip install -e '.[scripts]'"


def needs(*modules: str):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}: {EXTRA}")


def swept(tmp_path, example: str, name: str, steps_per_epoch: int):
    """Two trials of the example's study, one epoch each: every run complete, with per-epoch val_acc at the
    step the script logged it and its memory measured."""
    proc = sweep(tmp_path, "--study", str(ROOT / "examples" / example / "study.toml"), "--n-trials", "2",
                 "--epochs", "1", "--workers", "1", "--no-report", timeout=600)
    assert proc.returncode == 0, proc.stderr
    storage, client = stores(tmp_path)
    trials = optuna.load_study(study_name=name, storage=storage).trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    children, _ = child_runs(client, name)
    for run in children:
        assert run.info.status == "FINISHED"
        b, k = int(run.data.params["physical_batch"]), int(run.data.params["accum_steps"])
        [acc] = client.get_metric_history(run.info.run_id, "val_acc")
        assert acc.step == steps_per_epoch(b, k) and 0.5 < acc.value <= 1
        assert run.data.metrics["peak_memory_bytes"] > 100 * 2 ** 20
    return children


@needs("transformers", "accelerate")
def test_a_transformers_trainer_script_swept_by_program(tmp_path):
    children = swept(tmp_path, "hf_trainer", "hf_trainer", lambda b, k: 1)  # its JSON rows: the epoch
    for run in children:
        assert len(run.data.params) and "loss" in run.data.metrics


@needs("lightning")
def test_a_lightning_script_logging_through_its_mlflow_logger(tmp_path):
    # Lightning logs at its global step: the optimizer steps of the epoch's full windows, less one (0-based),
    # and one more for a short last window.
    swept(tmp_path, "lightning", "lightning", lambda b, k: math.ceil(math.ceil(1000 / b) / k) - 1)


def audited(tmp_path, capsys, monkeypatch, study: str, b: int, k: int) -> dict:
    """`batchsweep audit` on one of examples/audit/, as docs/audit.md runs it: what its --json says."""
    from batchsweep.sweeps.audit.command import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # its scripts' own threads, beside the other test process
    code = main(["--study", str(ROOT / "examples" / "audit" / study), "--physical-batch", str(b), "--accum-steps",
                 str(k), "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", "--json", str(tmp_path / "audit.json")])
    finding = json.loads((tmp_path / "audit.json").read_text())
    cannot_tell = finding["verdict"] == "random_forward"  # (exit status 2: nothing about the loop can be told)
    assert code == (0 if finding["verdict"] == "exact" else 2 if cannot_tell else 1), capsys.readouterr().out
    return finding


@needs("lightning")
def test_the_audit_finds_that_lightning_divides_the_short_last_window_by_k(tmp_path, capsys, monkeypatch):
    """Lightning #19987: 125 micro-batches of 8 at k = 4 end in a window of 1 micro-batch, divided by 4. A
    Lightning that fixes it fails here: docs/audit.md and the README say otherwise then."""
    finding = audited(tmp_path, capsys, monkeypatch, "lightning.toml", 8, 4)
    assert finding["verdict"] == "short_window_divided_by_k", finding
    assert finding["first_differing_update"] == finding["steps_true_batch"] == 32
    assert finding["update_ratio"] == pytest.approx(0.25, rel=1e-6)
    # Its loss rows agree throughout: the last update is tried first, from the pair one step before it.
    assert finding["runs"] == 5 and finding["compared"]["after step 31"] <= finding["tolerance"]  # as docs/audit.md


@needs("transformers", "accelerate")
def test_the_audit_finds_the_transformers_trainers_accumulation_exact(tmp_path, capsys, monkeypatch):
    """Padded sequences of different token counts and a short last window of 2 micro-batches: transformers
    divides by the window's token count (num_items_in_batch), and steps its schedule once per window."""
    finding = audited(tmp_path, capsys, monkeypatch, "hf.toml", 4, 4)
    assert finding["verdict"] == "exact", finding
    assert finding["steps_accumulated"] == finding["steps_true_batch"] == 13
    # Its linear schedule spans {max_steps} where it is given: under the study's 10 epochs the LRs are the same,
    # and the last window was checked at 1/13 of the LR, which the sentence says.
    assert finding["runs"] == 3 and finding["last_lr_share"] == pytest.approx(1 / 13)
    assert "ran at 0.077 of its largest LR" in finding["sentence"] and "constant" in finding["sentence"]


@needs("transformers", "accelerate")
def test_the_audit_of_the_transformers_script_with_its_default_dropout_names_the_fields_to_set_to_0(
        tmp_path, capsys, monkeypatch):
    """hf.toml's script with GPT-2's config dropouts left at transformers' 0.1: the micro-batches draw other masks
    than the true batch, so the runs part. The audit says the forward is random and which config fields to set to
    0, never that the loop is wrong (it read `unexplained`, exit status 1)."""
    finding = audited(tmp_path, capsys, monkeypatch, "hf_dropout.toml", 4, 4)
    assert finding["verdicts"] == ["random_forward"], finding
    assert "transformer.h.0.attn.attn_dropout: Dropout(p=0.1)" in finding["random_modules"], finding
    for field in ("attn_pdrop=0.1", "embd_pdrop=0.1", "resid_pdrop=0.1"):
        assert field in finding["sentence"], finding["sentence"]


@needs("transformers", "accelerate")
@pytest.mark.parametrize("study, verdict", [("accelerate.toml", "mean_of_micro_batch_means"),
                                            ("accelerate_window.toml", "exact")])
def test_the_audit_of_accelerates_two_loops_says_what_docs_audit_says(tmp_path, capsys, monkeypatch, study, verdict):
    """`accumulate()` around the model's own per-micro-batch mean is a mean of micro-batch means on padded
    sequences, from the first update on; the guide's loop for samples of variable size, which divides the
    window's summed token loss by its count of tokens, is exact, the short last window included."""
    finding = audited(tmp_path, capsys, monkeypatch, study, 4, 4)
    assert finding["verdict"] == verdict, finding
    assert finding["steps_accumulated"] == finding["steps_true_batch"] == 13
    if verdict != "exact":
        assert finding["first_differing_update"] == 1 and finding["runs"] == 5  # the start's weights: the tracer's
        assert finding["update_ratio"] == pytest.approx(1.01, abs=0.01) and 0.99 < finding["update_cosine"] < 1


def test_the_regression_example_is_reported_in_its_own_metric(tmp_path):
    """examples/regression, run from its folder as its study file says, at 2 seeds and 3 epochs: float targets
    log no accuracy, and the report compares the LR rules and the twins in val_loss, where lower is better."""
    for name in ("waves.py", "study.toml"):
        shutil.copy(ROOT / "examples" / "regression" / name, tmp_path)
    proc = sweep(tmp_path, "--study", "study.toml", "--seeds", "2", "--epochs", "3", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    report = (tmp_path / "reports" / "waves" / "report.md").read_text()
    assert "configurations are compared in val_loss (lower is better)" in report, report
    rules = [line for line in report.splitlines() if " LR rule against " in line]  # (the recommendation's too)
    assert len([line for line in rules if line.startswith("- The ")]) == 3, rules
    assert all("val_loss" in line and "points" not in line for line in rules), rules
    assert "Accumulation and its true-batch twin at the same B were" in report
    assert "rule had the lowest mean (val_loss " in report  # the best at the largest B is the lowest loss
    figures = {p.name for p in (tmp_path / "reports" / "waves").glob("*.png")}
    assert {"objective_vs_batch.png", "learning_curves.png"} <= figures and "accuracy_vs_batch.png" not in figures


@pytest.mark.parametrize("study, verdicts", [("gpt.toml", ["data_differs"]), ("gpt_no_estimate.toml", ["exact"]),
                                             ("gpt_undivided.toml", ["loss_not_divided"])])
def test_the_audit_of_a_minimal_gpt_loop_unmodified_says_what_docs_audit_says(tmp_path, capsys, monkeypatch, study,
                                                                               verdicts):
    """Random batches by torch.randint, no epochs, AdamW and a clip at 1.0, run as it is: its loss estimate before
    training draws 10·b samples, so the runs train on other data (that read as zero_grad_per_micro_batch); without
    the estimate it is exact; with its loss undivided, the gradients before the clip are k times the true batch's."""
    from batchsweep.sweeps.audit.command import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code = main(["--study", str(ROOT / "examples" / "audit" / study), "--physical-batch", "4", "--accum-steps", "4",
                 "--steps", "5", "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", "--json",
                 str(tmp_path / "audit.json")])
    finding = json.loads((tmp_path / "audit.json").read_text())
    assert finding["verdicts"] == verdicts, capsys.readouterr().out
    assert code == {"exact": 0, "loss_not_divided": 1, "data_differs": 2}[verdicts[0]]
    if verdicts == ["loss_not_divided"]:
        assert finding["gradient_ratio"] == pytest.approx(4, rel=1e-6)
    if verdicts == ["data_differs"]:
        assert finding["data_window"] == 1


def test_the_audit_of_a_minimal_gpt_loop_under_torchrun_finds_its_sync_switched_after_the_forward(
        tmp_path, capsys, monkeypatch):
    """examples/audit/gpt_ddp.toml as docs/audit.md runs it: the minimal GPT loop on 2 gloo ranks (torchrun), its
    require_backward_grad_sync set after the model's call (build-nanogpt #30), so the window's last micro-batch
    stays on its own rank and the ranks' weights part at update 1, where the true batch's ranks agree."""
    from batchsweep.sweeps.audit.command import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code = main(["--study", str(ROOT / "examples" / "audit" / "gpt_ddp.toml"), "--physical-batch", "4",
                 "--accum-steps", "4", "--steps", "5", "--nproc", "2", "--tracking-uri",
                 f"sqlite:///{tmp_path}/mlflow.db", "--json", str(tmp_path / "audit.json")])
    finding = json.loads((tmp_path / "audit.json").read_text())
    assert (code, finding["verdicts"]) == (1, ["grads_not_synced"]), capsys.readouterr().out
    assert finding["rank_first_parting"] == 1 and finding["rank_rel_diff"] > 1e-3
    assert "where the true batch's ranks agree" in finding["sentence"]


HF445 = ROOT / "examples" / "audit" / ".venv-hf445" / "bin" / "python"


@pytest.mark.skipif(not HF445.exists(), reason="needs examples/audit/.venv-hf445 (the commands in hf445.toml)")
def test_the_audit_names_both_faults_of_transformers_4_45_in_a_venv_of_its_own(tmp_path, capsys, monkeypatch):
    """transformers 4.45.2's Trainer, run by another interpreter where batchsweep is not installed: its short last
    window never steps (12 steps against 13), and in the 12 windows both step its loss is each micro-batch's token
    mean (#34191, fixed in 4.46). Both are named; its schedule over 12 steps parts the LRs from step 2, so the
    weights are compared after step 1 only."""
    finding = audited(tmp_path, capsys, monkeypatch, "hf445.toml", 4, 4)
    assert finding["verdicts"] == ["short_window_skipped", "mean_of_micro_batch_means"], finding
    assert (finding["steps_accumulated"], finding["steps_true_batch"]) == (12, 13)
    assert finding["first_differing_update"] == 1 and finding["lr_step"] == 2
    assert 0.98 < finding["gradient_cosine"] < 0.999, finding
