"""The tracer inside a script's own process: what it sees of an unmodified loop, how it stops one, and that it
keeps the environment's own sitecustomize."""
import json
import os
import subprocess
import sys

import pytest
import torch

from batchsweep.sweeps.launch import observed
from tests.conftest import ROOT

CATALOG = ROOT / "tests" / "programs" / "catalog.py"


def traced(folder, args, stop=0, grads=(), pythonpath=None, save=True):
    folder.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **observed.environment(folder, stop=stop, save=save, grads=grads,
                                                                         losses=True, data=True,
                                                                         pythonpath=pythonpath)}
    env.pop("BATCHSWEEP_STATE", None)
    proc = subprocess.run([sys.executable, str(CATALOG), *args], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return observed.read(folder), proc


def test_the_tracer_sees_each_window_of_an_unmodified_loop_and_stops_it(tmp_path):
    """The catalog at b = 8, k = 4 over 240 samples: 7 windows of 4 micro-batches and one of 2; stopped after 3
    steps, the process ends there (its own rows stop at 2: the third is printed after the step)."""
    trace, proc = traced(tmp_path / "a", ["--batch-size", "8", "--accum", "4", "--lr", "0.1", "--clip", "5"])
    assert [s.micro_batches for s in trace.steps] == [4] * 7 + [2]
    assert trace.steps[0].events == "ZFBFBFBFBCS" and trace.observed() == (8, 4)
    assert [s.samples for s in trace.steps][-1] == [8, 8] and trace.steps[0].clip == 5.0
    assert trace.steps[1].lrs == [0.1 * 0.9] and not any(s.zero_grad_within() for s in trace.steps)
    assert all(s.grad_norm > 0 for s in trace.steps) and trace.samples_per_s() > 0
    own = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["loss"] for r in own] == [s.loss for s in trace.steps]  # its rows: the window's summed loss
    stopped, proc = traced(tmp_path / "b", ["--batch-size", "8", "--accum", "4", "--lr", "0.1"], stop=3, grads=(1,))
    assert len(stopped.steps) == 3 and len(proc.stdout.splitlines()) == 2
    start = torch.load(tmp_path / "b" / "start.pt")
    end = torch.load(tmp_path / "b" / "state.pt")
    assert set(start) == set(end) and not torch.equal(start["0.weight"], end["0.weight"])
    grad = torch.load(tmp_path / "b" / "grad-1.pt")
    assert set(grad) == set(end) and grad["0.weight"].shape == end["0.weight"].shape


def test_a_clip_by_its_total_norm_is_seen_as_clip_grad_norm_is(tmp_path):
    """Accelerate (the Trainer's) clips by get_total_norm and clip_grads_with_norm_: the same clip, and the norm
    before it, as clip_grad_norm_'s. At 0.01 every step is cut, so a norm read after the clip would be 0.01."""
    args = ["--batch-size", "8", "--accum", "4", "--lr", "0.1", "--clip", "0.01"]
    by_norm, _ = traced(tmp_path / "n", args, stop=3)
    by_total, _ = traced(tmp_path / "t", [*args, "--clip-api", "total"], stop=3)
    assert [s.events for s in by_total.steps] == [s.events for s in by_norm.steps] == ["ZFBFBFBFBCS"] * 3
    assert [s.clip for s in by_total.steps] == [0.01] * 3
    assert [s.grad_norm for s in by_total.steps] == pytest.approx([s.grad_norm for s in by_norm.steps], rel=1e-12)
    assert all(s.grad_norm > 0.1 for s in by_total.steps)


def test_a_zero_grad_inside_the_window_and_a_step_per_micro_batch_are_seen(tmp_path):
    trace, _ = traced(tmp_path / "z", ["--batch-size", "8", "--accum", "4", "--lr", "0.1", "--mistake", "zero_grad"],
                      stop=2)
    assert all(s.zero_grad_within() for s in trace.steps)
    trace, _ = traced(tmp_path / "s", ["--batch-size", "8", "--accum", "4", "--lr", "0.1", "--mistake",
                                       "step_per_micro", "--rows", "window"], stop=5)
    assert [s.micro_batches for s in trace.steps] == [1] * 5 and trace.observed() == (8, 1)


def test_the_environments_own_sitecustomize_still_runs(tmp_path):
    """A sitecustomize that was on the path before batchsweep's runs first, as it would without batchsweep."""
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITE'] = 'ran'\n")
    (tmp_path / "check.py").write_text("import os, sys\nprint(os.environ.get('OWN_SITE'), "
                                       "sys.modules['sitecustomize'].__file__)\n")
    env = {**os.environ, **observed.environment(tmp_path, pythonpath=str(own))}
    out = subprocess.run([sys.executable, str(tmp_path / "check.py")], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    ran, ours = out.stdout.split()
    assert ran == "ran" and ours.endswith("tracer/sitecustomize.py")


def test_a_script_without_torch_leaves_no_trace(tmp_path):
    (tmp_path / "plain.py").write_text("print('no torch here')\n")
    env = {**os.environ, **observed.environment(tmp_path)}
    out = subprocess.run([sys.executable, str(tmp_path / "plain.py")], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == "no torch here\n"
    assert observed.read(tmp_path) is None


DDP_LOOP = '''import contextlib, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for window in range(3):
    for micro in range(4):  # k = 4 micro-batches of 8, the gradient all-reduced at the last one only
        with model.no_sync() if micro < 3 else contextlib.nullcontext():
            (model(torch.randn(8, 4)).pow(2).mean() / 4).backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_every_rank_of_a_torchrun_command_is_observed_and_rank_0_read(tmp_path):
    """torchrun's workers inherit PYTHONPATH: each rank writes its own trace; what is read back is rank 0's."""
    (tmp_path / "ddp.py").write_text(DDP_LOOP)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **observed.environment(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--log-dir", str(tmp_path / "logs"), str(tmp_path / "ddp.py")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name.split("-")[1] for p in tmp_path.glob("trace-r*.jsonl")) == ["r0", "r1"]
    trace = observed.read(tmp_path)
    assert len(trace.steps) == 3 and trace.observed() == (8, 4)


@pytest.mark.slow
def test_ranks_started_by_mp_spawn_are_named_and_measure_no_noise_scale(tmp_path):
    """PyTorch's tutorial pattern: torch.multiprocessing.spawn passes each rank as an argument, not in RANK. Each
    rank's trace is named by its process group, so rank 0's is the one read, and neither measures a noise scale
    (a micro-batch's gradient is the rank's own only until the window's all-reduce)."""
    import socket

    with socket.socket() as s:  # a free port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tmp_path / "spawn"
    folder.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **observed.environment(folder, noise=True)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "programs" / "plain.py"), "--batch-size", "8",
                           "--accum", "2", "--case", "spawn", "--epochs", "1", "--port", str(port)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name.split("-")[1] for p in folder.glob("trace-*.jsonl"))
    assert names == ["r0", "r1"], names
    trace = observed.read(folder)
    assert trace.observed() == (8, 2) and not any(s.micro_sq for s in trace.steps)


# An environment's own sitecustomize that takes APIs out of torch as its import ends (before batchsweep's tracer
# installs itself, inside the same import), so that this torch lacks them as an older one does.
OLD_TORCH = '''import importlib.abc, sys
GONE = {gone!r}

class Older(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = next(s for s in (f.find_spec(name, path, target) for f in sys.meta_path if hasattr(f, "find_spec"))
                    if s is not None)
        real = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return real.create_module(spec)

            def exec_module(self, module):
                spec.loader = module.__loader__ = real
                real.exec_module(module)
                for dotted in GONE:
                    owner, name = dotted.rsplit(".", 1)
                    delattr(sys.modules.get(owner) or eval(owner, {{"torch": module}}), name)

        spec.loader = Loader()
        return spec

sys.meta_path.insert(0, Older())
'''
SMALL_LOOP = '''import torch
from torch.nn.modules import module
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    opt.zero_grad()
    for micro in range(2):
        (model(torch.randn(8, 4)).pow(2).mean() / 2).backward()
    opt.step()
print("trained", len(module._global_forward_hooks), torch.autograd.backward.__module__)
'''
# What torch 2.2 lacks of what the tracer touches (torch.amp.GradScaler came in 2.3, get_total_norm and
# clip_grads_with_norm_ in 2.6; torch.compiler.is_compiling, 2.3 too, stays: today's torch imports it itself), and
# what torch 1.13 lacks: the optimizer's global hooks (2.0).
TORCH_2_2 = ("torch.amp.GradScaler", "torch.nn.Module.compile", "torch.nn.utils.get_total_norm",
             "torch.nn.utils.clip_grads_with_norm_")
TORCH_1_13 = ("torch.optim.optimizer.register_optimizer_step_pre_hook",
              "torch.optim.optimizer.register_optimizer_step_post_hook")


def run_under_older_torch(tmp_path, gone: tuple[str, ...]):
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text(OLD_TORCH.format(gone=gone))
    (tmp_path / "loop.py").write_text(SMALL_LOOP)
    folder = tmp_path / "trace"
    folder.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **observed.environment(folder, pythonpath=str(own))}
    proc = subprocess.run([sys.executable, str(tmp_path / "loop.py")], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split(), folder


def test_the_tracer_observes_a_torch_without_what_came_in_2_3(tmp_path):
    """Installed inside the script's own `import torch`, where GradScaler lives in torch.cuda.amp only and
    Module.compile does not exist: every window seen as on today's torch."""
    said, folder = run_under_older_torch(tmp_path, TORCH_2_2)
    assert said[:2] == ["trained", "0"]  # (the script's own view: the tracer's global forward hook is its own)
    trace = observed.read(folder)
    assert [s.events for s in trace.steps] == ["ZFBFBS"] * 3 and trace.observed() == (8, 2)
    assert observed.unobservable(folder) is None


def test_a_torch_without_the_optimizers_hooks_runs_the_script_unobserved_and_says_why(tmp_path):
    """Where a hook API is missing (torch before 2.0), the script trains as it would without batchsweep, with none
    of the hooks put in before the one that failed left behind (no global forward hook, torch's own backward),
    and one line in the trace folder names the torch and what it lacks."""
    said, folder = run_under_older_torch(tmp_path, TORCH_1_13)
    assert said == ["trained", "0", "torch.autograd"]
    assert observed.read(folder) is None
    why = observed.unobservable(folder)
    assert why.startswith(f"the tracer cannot observe torch {torch.__version__}: AttributeError") and \
        "register_optimizer_step_pre_hook" in why


def spread_model(device: str) -> torch.nn.Module:
    """Two halves, the second on `device` (an offloaded half, as device_map="auto" places them), each with its own
    loss term, in float64."""
    class Spread(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.near = torch.nn.Linear(4, 3, dtype=torch.float64)
            self.far = torch.nn.Linear(4, 2, dtype=torch.float64, device=device)

        def forward(self, x):
            return self.near(x).pow(2).mean(), self.far(x.to(device)).pow(2).mean()

    torch.manual_seed(0)
    return Spread()


DEVICES = ["meta", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="no CUDA device"))]


@pytest.mark.parametrize("device", DEVICES)
def test_the_noise_scale_of_a_model_spread_over_two_devices_is_taken_per_device(device, monkeypatch, tmp_path):
    """A measured window's micro-batches on a model with gradients on the CPU and on a second device (meta stands
    in for a GPU on a machine without one: it runs every operation with no values): the tracer's work after each
    backward() and before the step does not fail, as stacking one device's norms with another's did, and gives
    one sum of squares per device, the CPU's exactly that micro-batch's own gradient's; on a GPU, the whole sum
    is the one over every parameter."""
    monkeypatch.syspath_prepend(str(observed.FOLDER))
    import batchsweep_trace as tracing

    monkeypatch.setenv("BATCHSWEEP_TRACE_NOISE", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tracer = tracing.Tracer(str(tmp_path))
    model = spread_model(device)
    tracer.model, tracer.steps = model, tracing.NOISE_EVERY - 1  # the window of the next step is measured
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {}
    for micro in range(3):
        torch.autograd.backward(list(model(torch.randn(8, 4, dtype=torch.float64))))
        tracer.after_backward()
        own = [p.grad - before.get(name, 0) for name, p in model.named_parameters()]
        before = {name: p.grad.clone() for name, p in model.named_parameters()}
        parts = tracer.micro_sq[-1]
        assert sorted(str(part.device) for part in parts) == sorted({"cpu", str(torch.device(device))})
        cpu = next(part for part in parts if part.device.type == "cpu")
        assert float(cpu) == pytest.approx(sum(float(g.pow(2).sum()) for g in own if g.device.type == "cpu"),
                                           rel=1e-12)
        if device != "meta":  # (meta holds no values to add up)
            assert tracing.plain(parts) == pytest.approx(sum(float(g.pow(2).sum()) for g in own), rel=1e-12)
    norm = tracing.grad_norm(opt)
    assert len(norm) == 2 and norm.root
    if device != "meta":
        assert tracing.plain(norm) == pytest.approx(
            float(sum(p.grad.pow(2).sum().cpu() for p in model.parameters())) ** 0.5, rel=1e-12)


def test_modules_random_by_kind_include_those_holding_a_probability_in_training_mode():
    """Dropout of any kind, and any module in training mode whose p, dropout or drop_prob is a probability above
    0 (torchvision's StochasticDepth, nn.MultiheadAttention(dropout=...), timm's DropPath), is random by kind;
    one in eval mode, one at 0, and a p that is no probability (a pooling's norm) are not."""
    sys.path.insert(0, str(ROOT / "sweeps" / "launch" / "tracer"))
    try:
        from batchsweep_trace_tensors import randomness
    finally:
        sys.path.pop(0)

    class StochasticDepth(torch.nn.Module):  # (torchvision's keeps p as a float, as this one does)
        def __init__(self, p):
            super().__init__()
            self.p = p

    frozen = torch.nn.Dropout(0.5).eval()
    model = torch.nn.ModuleDict({"attention": torch.nn.MultiheadAttention(8, 2, dropout=0.1), "depth":
                                 StochasticDepth(0.2), "drop": torch.nn.AlphaDropout(0.3), "off": torch.nn.Dropout(0),
                                 "frozen": frozen, "pool": torch.nn.LPPool1d(2, 2), "gem": StochasticDepth(3.0)})
    modules, fields = randomness([model])
    assert modules == ["attention: MultiheadAttention(dropout=0.1)", "depth: StochasticDepth(p=0.2)",
                       "drop: AlphaDropout(p=0.3)"] and fields == []
