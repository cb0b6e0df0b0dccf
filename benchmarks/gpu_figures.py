"""Every GPU figure of docs/benchmarks.md in one run, most wanted first, under one time budget.

Runs each benchmark in its own process group with a time limit taken from what is left of --budget, writes
its whole output to OUT/gpu_figures.log as it comes, and ends with a table of what each step measured (the
figure on its last line, or why there is none). The default study's report and stores are copied to OUT.
The steps, in order (--only picks groups):

    context     the GPU memory a worker holds outside PyTorch's allocator, against CONTEXT_BYTES, and what
                the allocator reserves against its peak, against the placement's MARGIN
    fused       fused.py: trials of cnn1d and of gpt trained as one against each alone, in one process;
                fused_study.py: accum_lr's trials an hour fused against --no-fuse, 4 workers on the GPU
    memory      memory.py: peak memory and samples/s at k = 1, 4, 16 against the true batch, for cnn1d, gpt
                and resnet18 (synthetic:cifar_shaped), in fp32 and bf16
    throughput  throughput.py: the trainer against the hand-written loop, for the same three models, then
                for cnn1d and gpt once more without the trainer's diagnostics
    workers     gpu_workers.py: trials per hour of accum_lr with 1, 2 and 4 workers on GPU 0
    study       sweeps/run.py --study accum_lr on the GPU, with its report
    metrics     a placed trial with --system-metrics: MLflow's GPU metrics of its own GPU, found in NVML by
                UUID, and NVML's free memory of that GPU, which the placement offers
    program     a [program] trial of a script of its own on the GPU: the tracer's allocator peak as
                peak_memory_bytes (memory_source cuda_allocator) beside the process's, and what it observed

    python benchmarks/gpu_figures.py --out gpu-figures [--budget 540] [--only memory,throughput]

The last line is `measured=<steps that printed their figure>`; the exit status is 1 unless every step
chosen did. --tiny runs each step at a size for the CPU (a small MLP, a simulated GPU, no context step): a
check of the steps and their flags, not a figure.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from batchsweep.sweeps.launch.program import stop_group
from batchsweep.sweeps.trials.tables import format_table
from batchsweep.trainers import BatchsweepError
from batchsweep.trainers.cli import run_script

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
GROUPS = ("context", "fused", "memory", "throughput", "workers", "study", "metrics", "program")
LEAST_S = 20  # a step is not started with less time left than this

# Measured after a real training step, so that every library the trainer loads (cuBLAS, cuDNN, their
# workspaces, the kernels used) is in the figure. Nothing else may hold the GPU meanwhile.
CONTEXT = """
import torch
from batchsweep.sweeps.gpus.placement import CONTEXT_BYTES, MARGIN
from batchsweep.trainers import TrainConfig, train
for model, dataset in (("cnn1d", "mnist1d"), ("resnet18", "synthetic:cifar_shaped")):
    train(TrainConfig(model=model, dataset=dataset, device="cuda", precision="bf16", epochs=1, max_steps=3,
                      data_dir=DATA))
free, total = torch.cuda.mem_get_info()
reserved, peak = torch.cuda.memory_reserved(), torch.cuda.max_memory_allocated()
outside = total - free - reserved
print(f"{torch.cuda.get_device_name()}: the allocator reserved {reserved / 2**20:.0f} MiB for a peak of "
      f"{peak / 2**20:.0f} MiB allocated ({reserved / peak:.2f}x; a placed trial holds {MARGIN}x its predicted peak)")
print(f"{outside / 2**20:.0f} MiB held outside the allocator, against an allowance of "
      f"{CONTEXT_BYTES / 2**20:.0f} MiB per worker")
print(f"context_share={outside / CONTEXT_BYTES:.3f}")
"""

# One trial placed on the GPU with --system-metrics: its run must hold the GPU metrics of its own GPU alone
# (gpu_0), and NVML must know that GPU by the UUID that torch gave the placement, and say its free memory (what
# the placement offers). On the CPU (--tiny): no GPU metrics.
METRICS = """
from mlflow import MlflowClient
from batchsweep.sweeps.cli import main
from batchsweep.sweeps.gpus.placement import visible_gpus
from batchsweep.sweeps.gpus.placement import own_gpu
assert main(["--study", "accum_lr", "--study-name", "system_metrics", "--device", DEVICE, "--n-trials", "1",
             "--epochs", "3", "--seeds", "1", "--workers", "1", "--system-metrics", "--no-report",
             "--log-models", "none", "--set", "data_dir=" + DATA]) == 0  # in this process, placed on GPU 0
client = MlflowClient("sqlite:///mlruns/mlflow.db")
runs = client.search_runs([client.get_experiment_by_name("system_metrics").experiment_id], "tags.state = 'COMPLETE'")
keys = sorted(k for k in runs[0].data.metrics if k.startswith("system/gpu_"))
print("the trial's GPU metrics:", ", ".join(keys) or "none")
expected = {"system/gpu_0_memory_usage_megabytes", "system/gpu_0_utilization_percentage"} if DEVICE == "cuda" else set()
assert expected <= set(keys) and not [k for k in keys if not k.startswith("system/gpu_0_")], keys
if DEVICE == "cuda":
    import pynvml
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
    gpu = visible_gpus()[0]  # (this process holds the trial's CUDA context and cached blocks: less is free)
    print(f"torch's total {gpu.total_bytes / 2**20:.0f} MiB; NVML's free now: {gpu.free_bytes} bytes")
    monitor = SystemMetricsMonitor(runs[0].info.run_id, tracking_uri="sqlite:///mlruns/mlflow.db")
    own_gpu(monitor, gpu.uuid)
    handles = [h for m in monitor.monitors for h in getattr(m, "gpu_handles", [])]
    print(f"torch's UUID {gpu.uuid}; NVML's:", [pynvml.nvmlDeviceGetUUID(h) for h in handles])
    assert len(handles) == 1 and gpu.uuid in pynvml.nvmlDeviceGetUUID(handles[0]) and gpu.free_bytes
print(f"own_gpu_metrics={len(keys)}")
"""


# A [program] trial of a script that knows nothing of batchsweep, on DEVICE: the tracer inside it reports the
# CUDA allocator's peak from the first training forward (the trainer's measure) and what it saw (b, k).
PROGRAM = """
import pathlib
from mlflow import MlflowClient
from batchsweep.sweeps.cli import main
pathlib.Path("own.py").write_text('''import sys, torch
b, k, device = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for window in range(20):
    for micro in range(k):
        x, y = torch.randn(b, 512, device=device), torch.randint(0, 10, (b,), device=device)
        (torch.nn.functional.cross_entropy(model(x), y) / k).backward()
    opt.step()
    opt.zero_grad()
print('{"epoch": 1, "val_acc": 0.5}')
''')
pathlib.Path("own.toml").write_text('''name = "own_program"
[program]
command = ["{python}", "own.py", "{physical_batch}", "{accum_steps}", "DEVICE"]
[fixed]
physical_batch = 256
accum_steps = 4
''')
assert main(["--study", "own.toml", "--no-report", "--workers", "1"]) == 0
client = MlflowClient("sqlite:///mlruns/mlflow.db")
[run] = client.search_runs([client.get_experiment_by_name("own_program").experiment_id], "tags.state = 'COMPLETE'")
m, t = run.data.metrics, run.data.tags
print("observed b, k:", t["observed_physical_batch"], t["observed_accum_steps"], "; memory_source:", t["memory_source"])
assert (t["observed_physical_batch"], t["observed_accum_steps"]) == ("256", "4"), t
if "DEVICE" != "cpu":
    assert t["memory_source"] == "cuda_allocator", t
    peak, process = m["peak_memory_bytes"], m["process_peak_memory_bytes"]
    print(f"allocator peak {peak / 2**20:.0f} MiB; the process's {process / 2**20:.0f} MiB")
    print(f"allocator_share={peak / process:.3f}")
else:  # (--tiny: no GPU; the process tree's memory, and the tracer's observations)
    print(f"allocator_share={float(t['memory_source'] == 'rss'):.3f}")
"""


@dataclass
class Step:
    group: str
    name: str
    argv: list[str]  # after the Python interpreter
    figure: str  # the name its last line prints as name=value; "" when its result is the study's report
    cap_s: float  # the longest it may take


def steps(device: str, tiny: bool, data: str) -> list[Step]:
    # model, dataset, b, epochs of memory.py and of throughput.py, flags (one epoch of cifar_shaped is 50,000).
    # The launch-bound models' ratios spread by about 0.08 between quartiles of single epochs on the H200:
    # 20 paired epochs (one to two seconds each) give the median a standard error of about 0.017 (0.024 for 10).
    models = [("mlp", "synthetic:blobs", 8, 2, 3, [])] if tiny else [
        ("cnn1d", "mnist1d", 32, 2, 20, []), ("gpt", "pytext", 32, 2, 20, []),
        ("resnet18", "synthetic:cifar_shaped", 128, 1, 4, ["--channels-last"])]
    on = ["--device", device, "--data-dir", data]
    out = [] if tiny else [Step("context", "context", ["-c", CONTEXT.replace("DATA", repr(data))], "context_share",
                                120)]
    for model, dataset, accum, epochs in [("mlp", "synthetic:blobs", ["1", "2"], 1)] if tiny else [
            ("cnn1d", "mnist1d", ["1", "2", "4", "8", "16"], 2), ("gpt", "pytext", ["1", "2", "4"], 1)]:
        out.append(Step("fused", f"fused {model}, k = {', '.join(accum)}", [
            str(BENCH / "fused.py"), "--device", device, "--data-dir", data, "--model", model, "--dataset", dataset,
            "--accum", *accum, "--epochs", str(epochs), "--repeats", "1" if tiny else "3"], "speedup", 240))
    small = ["--seeds", "1", "--epochs", "1", "--workers", "1", "--set", "warmup_epochs=0", "--set", "max_steps=2"] \
        if tiny else ["--workers", "4"]
    out.append(Step("fused", "accum_lr fused against --no-fuse", [
        str(BENCH / "fused_study.py"), *small, "--set", f"device={device}", "--set", f"data_dir={data}"], "ratio", 420))
    for model, dataset, b, epochs, _, flags in models:
        for precision in ("fp32", "bf16"):
            out.append(Step("memory", f"memory {model} {precision}", [
                str(BENCH / "memory.py"), *on, "--model", model, "--dataset", dataset, "--physical-batch", str(b),
                "--precision", precision, "--epochs", str(epochs), *flags], "flat_ratio", 180))
    # Every model, then the two launch-bound ones without diagnostics: what share the diagnostics take.
    for (model, dataset, b, _, epochs, flags), bare in [(m, False) for m in models] + [(m, True) for m in models[:2]]:
        out.append(Step("throughput", f"throughput {model} bf16 k=4{', no diagnostics' if bare else ''}", [
            str(BENCH / "throughput.py"), *on, "--model", model, "--dataset", dataset, "--physical-batch", str(b),
            "--accum-steps", "4", "--precision", "bf16", "--epochs", str(epochs),
            *(["--no-diagnostics"] if bare else []), *flags], "ratio", 180))
    small = ["--simulate-gpu", "8GiB", "--trials", "2", "--workers", "1,2", "--epochs", "1", "--seeds", "1",
             "--set", "warmup_epochs=0"] if tiny else ["--trials", "12"]
    out.append(Step("workers", "workers 1, 2, 4 on GPU 0", [
        str(BENCH / "gpu_workers.py"), *small, "--set", f"data_dir={data}"], "speedup", 300))
    small = ["--n-trials", "1", "--epochs", "1", "--seeds", "1", "--workers", "1", "--set", "warmup_epochs=0"] if tiny \
        else ["--workers", "4"]  # the GPU machine's cores make room for more workers than the study's own 2
    out.append(Step("study", "study accum_lr", [
        str(ROOT / "sweeps" / "run.py"), "--study", "accum_lr", "--device", device, *small,
        "--set", f"data_dir={data}"], "", 300))
    out.append(Step("metrics", "system metrics of a placed trial", [
        "-c", METRICS.replace("DEVICE", repr(device)).replace("DATA", repr(data))], "own_gpu_metrics", 120))
    out.append(Step("program", "a [program] trial observed on the GPU", ["-c", PROGRAM.replace("DEVICE", device)],
                    "allocator_share", 120))
    return out


def run(step: Step, limit: float, log_path: Path, cwd: Path, env: dict) -> tuple[str, bool]:
    """Runs one step into the log; returns what it measured, or why not, and whether it measured."""
    with open(log_path, "ab") as log:
        log.write(f"\n=== {step.name} (at most {limit:.0f} s)\n$ python {' '.join(step.argv)}\n".encode())
        log.flush()
        start = log.tell()
        # A session of its own, so that the workers and loader processes it starts go with it.
        proc = subprocess.Popen([sys.executable, *step.argv], stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            stop_group(proc.pid, proc)  # what it left running would hold the GPU for the next step
    lines = log_path.read_bytes()[start:].decode(errors="replace").strip().splitlines() or [""]
    if code is None:
        return f"stopped at its limit of {limit:.0f} s", False
    if code != 0:
        return f"exit {code}: {lines[-1][:90]}", False
    if not step.figure:
        return "done", True
    found = re.fullmatch(rf"{step.figure}=(\S+)", lines[-1])
    return (found.group(0), True) if found else (f"no {step.figure}= on its last line", False)


def keep_study(work: Path, out: Path) -> str:
    """Copies the study's report and stores to OUT; returns what was kept."""
    kept = []
    for source, name in ((work / "reports" / "accum_lr" / "report.md", "accum_lr_report.md"),
                         (work / "reports" / "accum_lr" / "report.html", "accum_lr_report.html"),
                         (work / "mlruns" / "mlflow.db", "accum_lr_mlflow.db"),
                         (work / "mlruns" / "optuna.db", "accum_lr_optuna.db")):
        if source.exists():
            shutil.copyfile(source, out / name)
            kept.append(name)
    return ", ".join(kept) or "nothing"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="a folder for the log, the study's report and its stores")
    parser.add_argument("--budget", type=float, help="seconds for all the steps together (default: no limit)")
    parser.add_argument("--only", default=",".join(GROUPS), help=f"groups, comma-separated: {', '.join(GROUPS)}")
    parser.add_argument("--data-dir", default=str(ROOT / "data"), help="where the MNIST-1D cache is")
    parser.add_argument("--tiny", action="store_true", help="every step at a size for the CPU: a check, not a figure")
    args = parser.parse_args()
    only = args.only.split(",")
    if unknown := set(only) - set(GROUPS):
        raise BatchsweepError(f"unknown group {sorted(unknown)[0]!r} in --only: choose from {', '.join(GROUPS)}")
    # nvidia-smi rather than torch.cuda: this process must hold no GPU memory while the steps measure it
    gpus = shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    if not gpus and not args.tiny:
        raise BatchsweepError("nvidia-smi lists no GPU: run it on a GPU machine, or give --tiny for a check of the "
                              "steps on the CPU")
    chosen = [s for s in steps("cpu" if args.tiny else "cuda", args.tiny, args.data_dir) if s.group in only]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "gpu_figures.log"
    paths = [str(ROOT), str(BENCH), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    log_path.write_text(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}  python {sys.version.split()[0]}  "
                        f"torch {torch.__version__}\n{gpus or 'no nvidia-smi'}\n")
    end = time.monotonic() + (float("inf") if args.budget is None else args.budget)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for i, step in enumerate(chosen, 1):
            left = end - time.monotonic()
            began = time.monotonic()
            if left < LEAST_S:
                result, measured = "not run: the budget was spent", False
            else:
                result, measured = run(step, min(step.cap_s, left), log_path, Path(work), env)
                if step.group == "study" and measured:
                    kept = keep_study(Path(work), out)
                    result, measured = f"kept {kept}", "accum_lr_report.md" in kept
            rows.append((step.name, time.monotonic() - began, result, measured))
            print(f"[{i}/{len(chosen)}] {step.name}: {result} ({rows[-1][1]:.0f} s)", flush=True)
    table = format_table(["step", "seconds", "result"], [[name, f"{s:.0f}", result] for name, s, result, _ in rows])
    measured = sum(row[3] for row in rows)
    with open(log_path, "a") as log:
        log.write(f"\n{table}\nmeasured={measured}\n")
    print(table)
    print(f"measured={measured}")
    if measured < len(chosen):
        sys.exit(1)


if __name__ == "__main__":
    run_script(main)
