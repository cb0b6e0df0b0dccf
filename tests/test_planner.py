import re
import weakref

import pytest
import torch

from batchsweep.sweeps.gpus import planner
from batchsweep.sweeps.gpus.planner import Fit, measure, parse_bytes, plan
from tests.test_sweeps import TINY, sweep
from batchsweep.trainers import ConfigError, TrainConfig, train


def test_planned_batch_runs_within_the_budget(data_dir):
    config = TrainConfig(data_dir=data_dir)
    budget = parse_bytes("2MiB")
    answer = plan(measure(config), target=1024, budget=budget)
    assert answer.effective_batch == 1024 and answer.note is None
    peak = lambda b: train(TrainConfig(physical_batch=b, epochs=1, max_steps=3, data_dir=data_dir)).metrics[
        "peak_memory_bytes"]
    assert peak(answer.physical_batch) <= budget  # the plan fits (saved-tensor measure, CPU) ...
    assert peak(2 * answer.physical_batch) > budget  # ... and the next divisor would not


def test_each_probe_trains_with_no_earlier_model_alive(data_dir, monkeypatch):
    """On a GPU a probe's peak is the allocator's, which counts every tensor alive: a result kept from the probe
    before would add its model to the next probe's point, and the fit would be off by it."""
    models, alive = [], []

    def probe(config, **kwargs):
        alive.append(sum(model() is not None for model in models))
        result = train(config, **kwargs)
        models.append(weakref.ref(result.model))
        return result

    monkeypatch.setattr(planner, "train", probe)
    measure(TrainConfig(model="mlp", data_dir=data_dir))
    assert alive == [0, 0, 0]


@pytest.mark.parametrize("model", ["mlp", "tests.factories:zero_linear"])
def test_a_plan_calls_the_dataset_factory_once(model, capsys, monkeypatch, tmp_path):
    """The model check, the training set's size and the three probes share one load of the data (a built-in model
    is checked against it; a model of the user's is not). They were five: minutes for a factory that tokenizes."""
    from batchsweep.sweeps import commands
    from tests import factories

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(commands.INVOKED, "")  # main() sets it for the process: put back afterwards
    monkeypatch.setattr(factories, "LOADS", [])
    assert commands.main(["plan", "--target-batch", "512", "--memory-budget", "1MiB", "--model", model,
                          "--dataset", "tests.factories:counted_blobs"]) == 0
    assert "from the probe of b = 8, 32, 128 (3 steps each)" in capsys.readouterr().out
    assert factories.LOADS == [0]


def test_plan_rounds_to_a_divisor_or_says_why():
    fit = Fit(fixed=1000.0, per_sample=100.0, source="test", memory_source="saved_tensors", points=[])
    assert (plan(fit, 1000, 1000 + 100 * 130).physical_batch, plan(fit, 1000, 1000 + 100 * 130).accum_steps) == \
        (125, 8)
    prime = plan(fit, 997, 1000 + 100 * 130)  # 997 is prime: no divisor near 130
    assert (prime.physical_batch, prime.accum_steps, prime.effective_batch) == (130, 8, 1040)
    assert "B = 1040 instead of 997" in prime.note
    with pytest.raises(ConfigError, match=r"^even b = 1 needs about 1.1 KiB, more than the budget of 1.0 KiB: "):
        plan(fit, 1000, 1050)  # in MiB both would read 0.0


@pytest.mark.parametrize("text,expected", [("6GiB", 6 * 2 ** 30), ("512 MiB", 512 * 2 ** 20), ("2e9", 2 * 10 ** 9),
                                           ("1.5GB", 1_500_000_000)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_plan_from_a_batch_memory_study(tmp_path):
    assert sweep(tmp_path, *TINY, "--study", "batch_memory", "--n-trials", "4").returncode == 0
    proc = sweep(tmp_path, "--plan", "--target-batch", "512", "--memory-budget", "1MiB", "--model", "mlp",
                 "--dataset", "tests.factories:blobs1k")
    assert proc.returncode == 0, proc.stderr
    assert "from the batch_memory study" in proc.stdout and "(4 runs)" in proc.stdout
    assert "plan: physical batch" in proc.stdout and "= 512" in proc.stdout
    assert "\nrun it: python trainers/train.py --model mlp --dataset tests.factories:blobs1k --physical-batch" \
        in proc.stdout  # as the user started it: the script
    bad = sweep(tmp_path, "--plan", "--target-batch", "512", "--memory-budget", "lots")
    assert bad.returncode == 2 and bad.stderr.strip() == \
        "error: memory budget 'lots' is not a size: write e.g. 6GiB, 512MiB or 2e9"


def test_plan_help_lists_only_the_flags_a_plan_reads(capsys, monkeypatch):
    from batchsweep.sweeps import commands

    monkeypatch.setenv(commands.INVOKED, "")  # main() sets it for the process: put back afterwards
    with pytest.raises(SystemExit) as exited:
        commands.main(["plan", "--help"])
    said = capsys.readouterr().out
    assert exited.value.code == 0 and said.startswith("usage: batchsweep plan"), said
    flags = set(re.findall(r"^  (--[a-z-]+)", said, re.MULTILINE))
    assert flags == {"--target-batch", "--memory-budget", "--model", "--dataset", "--device", "--set",
                     "--tracking-uri"}, flags  # not run's --study, --workers, --storage, ...


@pytest.mark.parametrize("argv, asked", [(["plan"], "batchsweep plan"), (["run", "--plan", "--target-batch", "8"],
                                                                        "--plan")])
def test_a_plan_without_its_target_or_budget_names_what_was_typed(capsys, monkeypatch, tmp_path, argv, asked):
    from batchsweep.sweeps import commands

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(commands.INVOKED, "")  # main() sets it for the process: put back afterwards
    assert commands.main(argv) == 2
    assert capsys.readouterr().err == f"error: {asked} needs --target-batch N and --memory-budget SIZE (e.g. 6GiB)\n"
    assert list(tmp_path.iterdir()) == []


def test_a_probe_on_a_training_set_smaller_than_its_batches_measures_what_fits(tmp_path):
    proc = sweep(tmp_path, "--plan", "--target-batch", "90", "--memory-budget", "1GiB", "--model", "mlp",
                 "--dataset", "tests.factories:blobs")  # 90 samples: b = 128 cannot be measured
    assert proc.returncode == 0, proc.stderr
    assert "from the probe of b = 8, 32, 90 (3 steps each)" in proc.stdout
    assert "plan: physical batch 90 x 1 accumulation steps = 90 " in proc.stdout


@pytest.mark.parametrize("args, expected", [
    (["--dataset", "tests.factories:blobs", "--target-batch", "91"],
     "--target-batch 91 is larger than the training set of tests.factories:blobs (90 samples): a step holds each "
     "sample once at most; give at most 90"),
    (["--dataset", "tests.factories:broken_model", "--target-batch", "8"],
     "dataset 'tests.factories:broken_model' raised RuntimeError: factory exploded"),
    (["--dataset", "tests.factories:blobs", "--model", "tests.factories:broken_model", "--target-batch", "8"],
     "the memory probe of tests.factories:broken_model on tests.factories:blobs raised RuntimeError: factory "
     "exploded: check that `python trainers/train.py --model tests.factories:broken_model --dataset "
     "tests.factories:blobs` trains"),
    pytest.param(["--device", "cuda", "--target-batch", "8"],
                 "device 'cuda' is not available on this machine: use --device cpu or auto",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: cuda is valid")),
])
def test_a_plan_that_cannot_be_made_is_one_line(tmp_path, args, expected):
    proc = sweep(tmp_path, "--plan", "--memory-budget", "1GiB", "--model", "mlp", *args)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {expected}", proc.stderr
    assert not (tmp_path / "mlruns").exists()
