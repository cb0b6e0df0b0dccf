import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, run_script
from batchsweep.trainers.cli import main


def one_line_error(capsys, argv, bar: bool = True) -> str:
    """The error line, and nothing else left on the terminal by this command (a bar that counted nothing clears
    itself; with bar=False none was drawn at all) but the line that says which checkpoint it tried to resume
    from."""
    capsys.readouterr()  # what earlier commands of the test printed
    code = main(argv)
    lines = [line for line in capsys.readouterr().err.strip().split("\n") if not line.startswith("resuming from ")]
    assert code == 2 and len(lines) == 1, lines
    assert bar or "\r" not in lines[0], lines
    shown = lines[0].rsplit("\r", 1)[-1]
    assert shown.startswith("error:"), lines
    return shown


@pytest.mark.parametrize("argv,expected", [
    (["--physical-batch", "0"], "physical_batch must be >= 1"),
    (["--accum-steps", "0"], "accum_steps must be >= 1"),
    (["--physical-batch", "eight"], "physical_batch takes an integer, got 'eight'"),
    (["--physical-batch", "512", "--accum-steps", "16"], "effective batch 8192"),
    (["--physical-batch", "auto", "--effective-batch", "5000"], "effective batch 5000 (physical_batch 5000 x "
     "accum_steps 1) is larger than the training set (4000 samples): lower --physical-batch, --accum-steps or "
     "--effective-batch"),
    (["--model", "vgg"], "unknown model 'vgg'"),
    (["--dataset", "imagenet"], "unknown dataset 'imagenet'"),
    (["--lr-rule", "cube"], "unknown lr_rule 'cube'"),
    (["--lr-rule", "adam_halflife"], "lr_rule=adam_halflife is a rule for AdamW: set optimizer=adamw"),
    (["--optimizer", "adamw", "--lr-rule", "adam_halflife", "--base-batch", "1", "--physical-batch", "2048",
      "--adam-beta2", "0.5"], "takes adam_beta2 = 0.5 to adam_beta2^kappa = 0, outside (0, 1)"),
    (["--bn-momentum-rule", "half"], "unknown bn_momentum_rule 'half'"),
    (["--model", "nosuchpkg.mod:make"], "does not import"),
    (["--model", "tests.factories:missing"], "has no callable 'missing'"),
    (["--model", "tests.factories:not_a_model"], "returned str, not a torch.nn.Module"),
    (["--dataset", "tests.factories:not_a_dataset"], "must return (train, test) Datasets"),
    (["--model", "tests.factories"], "or give package.module:factory"),
    (["--model", ":make"], "import path ':make' is malformed"),
    (["--model", "gpt"], "model 'gpt' takes token ids of shape (length,), and dataset 'mnist1d' gives floats of "
                         "shape (1, 40): use --model cnn1d or mlp"),
    (["--model", "resnet18", "--dataset", "pytext"], "gives integers of shape (64,): use --model gpt"),
    (["--dataset", "pytext_hf"], "and dataset 'pytext_hf' gives mappings of input_ids, attention_mask: use a model "
                                 "that takes them as keyword arguments (--model hf:gpt2-tiny, or your own "
                                 "factory)"),
    (["--model", "resnet18", "--dataset", "tests.factories:byte_images"], "model 'resnet18' takes images of shape "
     "(channels, height, width), and dataset 'tests.factories:byte_images' gives integers of shape (3, 8, 8): use "
     "your own model (--model package.module:factory)"),
])
def test_bad_input_is_one_line(capsys, data_dir, argv, expected):
    """Before the epochs' bar opens, so that a log holds the line alone, but for what only training finds: the
    training set's size against the effective batch, and what a user's model factory returns."""
    after_the_bar = "effective batch" in expected or "not a torch.nn.Module" in expected
    line = one_line_error(capsys, [*argv, "--data-dir", data_dir, "--epochs", "1"], bar=after_the_bar)
    assert expected in line


@pytest.mark.parametrize("module,argv,started,start,end", [
    ("batchsweep.sweeps.cli", ["--bogus"], "batchsweep", "unrecognized arguments: --bogus", "batchsweep run"),
    ("batchsweep.sweeps.cli", ["--log-models", "x"], "", "argument --log-models: invalid choice: ", "python sweeps/run.py"),
    ("batchsweep.analysis.cli", [], "batchsweep", "one of the arguments --study --compare is required", "batchsweep report"),
    ("batchsweep.analysis.cli", ["--study"], "", "argument --study: expected one argument", "python analysis/report.py"),
    ("batchsweep.sweeps.audit.command", ["--study", "x"], "", "the following arguments are required: --physical-batch",
     "batchsweep audit"),
    ("batchsweep.trainers.cli", ["--bogus"], "batchsweep", "unrecognized arguments: --bogus", "batchsweep train"),
    ("batchsweep.trainers.cli", ["--epochs"], "", "argument --epochs: expected one argument", "python trainers/train.py"),
    ("batchsweep.sweeps.commands", ["plan", "--bogus"], "", "unrecognized arguments: --bogus", "batchsweep plan"),
    ("batchsweep.sweeps.commands", ["run", "--bogus"], "", "unrecognized arguments: --bogus", "batchsweep run"),
])
def test_a_flag_argparse_refuses_is_one_line_naming_the_help_as_the_user_started_it(capsys, monkeypatch, module,
                                                                                    argv, started, start, end):
    """Not argparse's usage block: the problem, and the --help of the command as it was typed."""
    import importlib

    monkeypatch.setenv("BATCHSWEEP_COMMAND", started)
    with pytest.raises(SystemExit) as exited:
        importlib.import_module(module).main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {start}") and err.endswith(f": see {end} --help\n"), err


def test_python_m_sweeps_is_named_as_typed(capsys, monkeypatch):
    import runpy

    from batchsweep.sweeps import commands

    monkeypatch.setattr(commands, "started", None)  # __main__ sets it for the process: put back afterwards
    monkeypatch.setattr("sys.argv", ["sweeps", "--bogus"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("sweeps", run_name="__main__")
    assert exited.value.code == 2
    assert capsys.readouterr().err == "error: unrecognized arguments: --bogus: see python -m batchsweep.sweeps --help\n"


INSTALLED = ["-c", "import sys; from batchsweep.sweeps.commands import main; sys.exit(main())"]  # what `batchsweep` runs


@pytest.mark.parametrize("command", [["sweeps/run.py"], ["-m", "batchsweep.sweeps"], ["analysis/report.py"],
                                     ["trainers/train.py"], [*INSTALLED, "audit"], [*INSTALLED, "plan"]])
@pytest.mark.parametrize("flag, code", [("--help", 0), ("--bogus", 2)])
def test_help_and_a_bad_flag_answer_before_torch_mlflow_or_optuna_is_imported(command, flag, code):
    """What makes them answer at once (0.1 to 0.3 s on a 2-core CPU, against 4 to 7 s with the imports):
    nothing heavy is imported before the command line is parsed. Python's own import log says what was."""
    proc, imported, said = run_logging_imports([*command, flag])
    assert proc.returncode == code, said
    assert (said == [] if code == 0 else len(said) == 1 and said[0].startswith("error: ")), said
    assert proc.stdout.startswith("usage: ") == (code == 0), proc.stdout[:200]
    heavy = imported & {"torch", "mlflow", "optuna", "pandas"}
    assert not heavy, heavy


@pytest.mark.parametrize("study, said", [
    (["--list"], None),
    (["--study", "nope"], "error: unknown study 'nope': name a built-in one"),
    (["--study", "{tmp}/mine.toml"], "error: {tmp}/mine.toml: grid.physical_batch: must be a non-empty list of values"),
])
def test_the_list_of_studies_and_a_study_files_mistake_answer_without_torch_or_mlflow(tmp_path, study, said):
    """0.6 s instead of 7 on a 2-core CPU: a study file is read, and names its objective's kind, before torch
    and MLflow are imported."""
    (tmp_path / "mine.toml").write_text('name = "mine"\n[grid]\nphysical_batch = "32"\n')
    proc, imported, lines = run_logging_imports(["sweeps/run.py", *(a.format(tmp=tmp_path) for a in study)])
    if said is None:
        assert proc.returncode == 0 and lines == [], lines
        assert proc.stdout.startswith("study ") and "\naccum_lr " in proc.stdout, proc.stdout[:300]
    else:
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(said.format(tmp=tmp_path)), lines
    heavy = imported & {"torch", "mlflow", "pandas"}
    assert not heavy, heavy


def run_logging_imports(args: list[str]):
    """The command's process, the modules Python's own import log says it imported, and its other stderr lines."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return proc, imported, [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]


def test_missing_offline_dataset(capsys, tmp_path):
    line = one_line_error(capsys, ["--dataset", "mnist", "--data-dir", str(tmp_path / "none"), "--epochs", "1"])
    assert "dataset MNIST is not in" in line and "could not be downloaded" in line


def test_refused_dataset_files_say_so(capsys, tmp_path):
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py/data_batch_1").write_bytes(b"not a pickle")
    line = one_line_error(capsys, ["--dataset", "cifar10", "--data-dir", str(tmp_path), "--epochs", "1"])
    assert "the files in" in line and "were refused" in line and "failed their checksum" in line
    assert "could not be downloaded" not in line


def test_settings_without_effect_are_warnings(capsys, data_dir):
    assert main(["--model", "mlp", "--bn-momentum-rule", "matched", "--ghost-batch", "4", "--label-key", "target",
                 "--epochs", "1", "--data-dir", data_dir, "--metrics", "tests.factories:margin"]) == 0
    out, err = capsys.readouterr()
    # The summary: no BN momentum for a model without BatchNorm, and the user's own metric beside val acc.
    assert "bn momentum" not in out and re.search(r"\nval margin +-?\d+\.\d+\n", out), out
    assert "warning: bn_momentum_rule='matched' has no effect" in err
    assert "warning: ghost_batch has no effect: model 'mlp' has no BatchNorm layer" in err
    assert "warning: label_key='target' has no effect: the samples of 'mnist1d' are (input, target) pairs" in err


@pytest.mark.slow
def test_script_trains_and_writes_json(tmp_path, data_dir):
    out = tmp_path / "result.json"
    proc = run_script("trainers/train.py", "--physical-batch", "16", "--accum-steps", "4", "--lr-rule", "linear",
                      "--bn-momentum-rule", "matched", "--epochs", "2", "--data-dir", data_dir, "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "16 x 4 = 64" in proc.stdout and "val acc" in proc.stdout
    assert re.search(r"\nbn momentum +0\.026 \(matched\)\n", proc.stdout), proc.stdout  # cnn1d's BatchNorm
    result = json.loads(out.read_text())
    # The epochs' time, said to be that (not the command's, whose imports and data come before them).
    seconds = re.search(r"\ntime +(\d+\.\d) s in its epochs, evaluations included\n", proc.stdout).group(1)
    assert float(seconds) == round(result["metrics"]["wall_time_s"], 1), proc.stdout
    assert result["status"] == "ok" and len(result["history"]) == 2
    assert result["config"]["effective_batch"] == 64 and result["config"]["lr"] == pytest.approx(0.1)
    assert result["config"]["bn_momentum"] == pytest.approx(1 - 0.9 ** 0.25)


def test_the_half_life_rule_from_the_command_line(tmp_path, data_dir):
    out = tmp_path / "result.json"
    assert main(["--model", "mlp", "--optimizer", "adamw", "--lr-rule", "adam_halflife", "--halflife-beta1",
                 "--adam-beta2", "0.95", "--base-lr", "1e-3", "--accum-steps", "4", "--max-steps", "1",
                 "--data-dir", data_dir, "--json", str(out)]) == 0
    config = json.loads(out.read_text())["config"]
    assert (config["lr"], config["beta1"], config["beta2"]) == pytest.approx((2e-3, 0.9 ** 4, 0.95 ** 4))


def test_script_bad_input_has_no_traceback(data_dir):
    proc = run_script("trainers/train.py", "--accum-steps", "0", "--data-dir", data_dir)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: accum_steps must be >= 1, got 0"


@pytest.mark.parametrize("script", ["benchmarks/throughput.py", "benchmarks/memory.py",
                                    "benchmarks/diagnostics_overhead.py"])
def test_benchmark_scripts_refuse_bad_input_in_one_line(script):
    result = run_script(script, "--physical-batch", "0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: physical_batch must be >= 1, got 0"], result.stderr
    if not torch.cuda.is_available():  # where there is a GPU, --device cuda is good input
        result = run_script(script, "--device", "cuda")
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [
            "error: device 'cuda' is not available on this machine: use --device cpu or auto"], result.stderr


@pytest.mark.parametrize("profile, said", [
    ("-2", "--profile takes the number of windows to profile, at least 1; got -2"),
    ("500", "--profile 500 needs 504 windows of B = 128 in an epoch: lower it, --physical-batch or --accum-steps")])
def test_a_profile_the_benchmark_cannot_take_is_refused_in_one_line(profile, said):
    result = run_script("benchmarks/throughput.py", "--profile", profile)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"error: {said}"], result.stderr


@pytest.mark.parametrize("flag", ["--json", "--epochs-jsonl"])
def test_an_output_path_that_cannot_be_written_is_refused_before_training(capsys, tmp_path, flag):
    (tmp_path / "a-file").write_text("")
    args = ["--model", "mlp", "--dataset", "tests.factories:blobs", "--epochs", "1", "--device", "cpu"]
    line = one_line_error(capsys, [*args, flag, str(tmp_path / "a-file/result.json")])
    assert line.startswith(f"error: {flag} {tmp_path}/a-file/result.json: its folder cannot be made (")
    line = one_line_error(capsys, [*args, flag, str(tmp_path)])
    assert line == f"error: {flag} {tmp_path} is a folder: name a file in a folder you can write"
    # A folder that takes no file, whoever asks (os.access() lets root write anywhere): opened, not asked.
    line = one_line_error(capsys, [*args, flag, "/proc/batchsweep.json"])
    assert line == f"error: {flag} /proc/batchsweep.json cannot be written (No such file or directory): name a file " \
                   f"in a folder you can write"
    assert capsys.readouterr().out == ""  # refused before training: no summary


def test_every_metric_a_run_logs_is_known_before_it_runs():
    """METRICS lets a study's objective be checked before anything runs: it must name all that a run logs."""
    from batchsweep.trainers import METRICS, TrainConfig, train

    logged = set()
    for config in (TrainConfig(model="mlp", dataset="tests.factories:blobs", epochs=2, accum_steps=2, device="cpu"),
                   TrainConfig(model="tests.factories:fits_16", dataset="tests.factories:blobs", epochs=1,
                               physical_batch=64, shrink_on_oom=True, device="cpu"),
                   TrainConfig(model="gpt", dataset="tests.factories:tokens", epochs=1, physical_batch=5,
                               device="cpu")):
        result = train(config)
        logged |= set(result.metrics) | {k for row in result.history for k in row}
    assert {"noise_scale", "oom_retries", "val_perplexity"} <= logged  # each kind of run was covered
    assert logged <= set(METRICS), logged - set(METRICS)


def test_checkpoint_dir_none_turns_checkpoints_off(tmp_path, monkeypatch):
    """As for sweeps/run.py: 'none' is no folder named none."""
    monkeypatch.chdir(tmp_path)
    assert main(["--model", "mlp", "--dataset", "tests.factories:blobs", "--epochs", "1", "--device", "cpu",
                 "--checkpoint-dir", "none"]) == 0
    assert not (tmp_path / "none").exists()


def test_the_bar_over_epochs_draws_each_epoch_with_its_own_metrics(capsys):
    from batchsweep.trainers.cli import epoch_progress

    on_epoch, close = epoch_progress(3)
    for epoch in (1, 2, 3):  # faster than tqdm's default 0.1 s between frames
        on_epoch({"epoch": epoch, "train_loss": 1 / epoch, "val_acc": 0.5 + epoch / 10})
    close()
    frames = re.split(r"[\r\n]", capsys.readouterr().err)
    for epoch in (1, 2, 3):
        assert any(f" {epoch}/3 [" in f and f"val_acc={0.5 + epoch / 10:.3f}" in f for f in frames), frames
    assert not any(" 0/3 [" in f and "val_acc" in f for f in frames), frames


def test_the_cpu_is_named_with_its_threads():
    from batchsweep.trainers.loop import device_name

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert device_name(torch.device("cpu")).endswith(", 1 thread)")
        torch.set_num_threads(2)
        assert device_name(torch.device("cpu")).endswith(", 2 threads)")
    finally:
        torch.set_num_threads(before)
