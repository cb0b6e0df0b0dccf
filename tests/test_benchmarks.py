"""Every benchmark runs in a tiny mode and prints its figure: a benchmark that breaks (a changed interface, a
trial that fails) fails here, rather than printing a figure of nothing."""
import importlib.util
import math
import os
import re
import subprocess
import sys
import weakref

import pytest

from tests.conftest import ROOT

TINY = ["--model", "mlp", "--dataset", "synthetic:blobs", "--epochs", "3"]
# benchmark (its script, and what the run shows): (how it is launched, its tiny arguments, the figure on its
# last line)
RUNS = {
    "throughput.py": ([], [*TINY, "--physical-batch", "32", "--accum-steps", "4"], "ratio"),
    "throughput.py ops": ([], [*TINY, "--physical-batch", "32", "--accum-steps", "4", "--count-ops"], "extra_ops"),
    "throughput.py profile": ([], [*TINY, "--physical-batch", "32", "--accum-steps", "2", "--profile", "3"],
                              "host_extra_us"),
    "throughput.py mappings": ([], ["--model", "tests.factories:keyword_lm", "--dataset", "tests.factories:hf_shaped",
                                    "--epochs", "3", "--physical-batch", "4", "--accum-steps", "2"], "ratio"),
    "fused.py": ([], ["--model", "mlp", "--dataset", "synthetic:blobs", "--epochs", "1", "--repeats", "1",
                      "--accum", "1", "2"], "speedup"),
    "fused_study.py": ([], ["--seeds", "1", "--epochs", "1", "--workers", "1", "--set", "model=mlp", "--set",
                            "dataset=tests.factories:blobs1k", "--set", "warmup_epochs=0"], "ratio"),
    "memory.py": ([], ["--model", "mlp", "--dataset", "synthetic:blobs", "--physical-batch", "8"], "flat_ratio"),
    "diagnostics_overhead.py": ([], [*TINY, "--repeats", "1"], "overhead"),
    "checkpoint_cost.py": ([], [*TINY, "--pairs", "1"], "checkpoint_share"),
    "system_metrics.py": ([], ["--pairs", "1", "--epochs", "1"], "ratio"),
    "sweep_overhead.py": ([], ["--trials", "2", "--epochs", "3"], "overhead"),
    "trial_scaling.py": ([], ["--seeds", "1", "--window", "5"], "ratio"),
    "program_overhead.py": ([], ["--trials", "2", "--seconds", "0.3"], "overhead_s"),
    "stop_time.py": ([], ["--repeats", "1", "--workers", "1"], "stop_s"),
    "tracer_overhead.py": ([], ["--pairs", "2", "--windows", "2", "--precision", "10"], "overhead"),
    "tracer_overhead.py noise": ([], ["--pairs", "2", "--windows", "8", "--precision", "10", "--noise"], "overhead"),
    "gpu_workers.py": ([], ["--simulate-gpu", "8GiB", "--trials", "2", "--workers", "2", *TINY[:4], "--epochs", "1",
                            "--seeds", "1", "--set", "warmup_epochs=0"], "speedup"),
    # a step of each kind but the context (CUDA only) and those run above as they are (memory.py, gpu_workers.py)
    "gpu_figures.py": ([], ["--tiny", "--only", "throughput,study,metrics,program", "--out", "figures"], "measured"),
    "walk.py": ([], [], "returns"),
    "ddp_sync.py": (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
                    [*TINY, "--pairs", "1", "--accum-steps", "2", "--physical-batch", "32"], "epoch_time_ratio"),
}


def test_every_benchmark_has_a_tiny_run():
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py") if "def main" in p.read_text()}
    assert scripts == {run.split()[0] for run in RUNS}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(RUNS))
def test_a_benchmark_prints_its_figure(tmp_path, data_dir, script):
    launcher, args, figure = RUNS[script]
    script = script.split()[0]
    if script in ("system_metrics.py", "sweep_overhead.py", "gpu_figures.py"):
        args = [*args, "--data-dir", data_dir]
    if script == "fused_study.py":  # a study of 4 points, one group fused: accum_lr's 27 measure nothing more here
        (tmp_path / "fused4.toml").write_text('name = "fused4"\n[grid]\nphysical_batch = [32]\n'
                                              'accum_steps = [1, 2, 4, 8]\n')
        args = [*args, "--study", str(tmp_path / "fused4.toml")]
    if "torch.distributed.run" in launcher:  # its log folders in the test's, not one left in /tmp each launch
        launcher = [*launcher, "--log-dir", str(tmp_path / "elastic")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *launcher, str(ROOT / "benchmarks" / script), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    match = re.fullmatch(rf"{figure}=(-?[0-9.]+)", last)
    assert match and math.isfinite(float(match.group(1))), proc.stdout[-2000:]
    # A ratio of two timings is positive; an overhead or a share is a difference of two noisy timings, which a
    # tiny run on a busy machine can make negative (checkpoint_share=-0.37 was seen): a figure, not a failure.
    assert float(match.group(1)) > 0 or not figure.endswith("ratio"), proc.stdout[-2000:]


def test_memory_trains_each_configuration_with_no_earlier_model_alive(monkeypatch, capsys):
    """On a GPU a run's peak is the allocator's, which counts every tensor alive, and a run's result holds its
    model: results kept until the next run added two ResNet-18s (85 MiB) to the peaks at k = 4 and 16."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("memory_benchmark", ROOT / "benchmarks" / "memory.py")
    memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory)
    real_train, models, alive = memory.train, [], []

    def train(config, **kwargs):
        alive.append(sum(model() is not None for model in models))
        result = real_train(config, **kwargs)
        models.append(weakref.ref(result.model))
        return result

    monkeypatch.setattr(memory, "train", train)
    monkeypatch.setattr(sys, "argv", ["memory.py", "--device", "cpu", *RUNS["memory.py"][1]])
    memory.main()
    assert alive == [0] * 6
    assert capsys.readouterr().out.splitlines()[-1].startswith("flat_ratio=")


def test_the_gpu_figures_say_what_they_did_not_measure(tmp_path):
    """A step the budget leaves out is a line of the table, and the run exits non-zero: no silent gap."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_figures.py"), "--tiny", "--only", "memory",
                           "--budget", "0", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stdout.count("not run: the budget was spent") == 2 * 2  # each step's line, and its row of the table
    assert proc.stdout.strip().splitlines()[-1] == "measured=0"
    assert "measured=0" in (tmp_path / "gpu_figures.log").read_text()
