"""Trials placed on GPUs by memory (sweeps/gpus/placement.py), on simulated GPUs: a list of devices and their memory
sizes, shared by threads and by worker processes as the GPUs of one machine would be. No GPU is needed."""
import dataclasses
import logging
import math
import multiprocessing
import os
import threading
import time

import pytest
import torch

from batchsweep.sweeps.gpus.placement import CONTEXT_BYTES, SHAPE, Gpu, Ledger, Placement, place
from batchsweep.sweeps.gpus.planner import Fit
from batchsweep.trainers import TrainConfig

GIB = 2 ** 30


def until(condition, what: str) -> None:
    """Wait for a state of the ledger (not for time to pass): the test fails if it never comes."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def in_thread(fn):
    box = {}

    def body():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            box["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, box


def test_workers_are_placed_round_robin_and_each_gpu_keeps_room_for_its_workers_contexts():
    gpus = [Gpu("2", "simulated A", 16 * GIB, "uuid-a"), Gpu("5", "simulated B", 8 * GIB, "uuid-b")]
    placements = place(5, gpus, "sqlite:///unused.db", program=False)
    assert [p.gpu.index for p in placements] == ["2", "5", "2", "5", "2"]
    assert [p.gpu.uuid for p in placements] == ["uuid-a", "uuid-b", "uuid-a", "uuid-b", "uuid-a"]
    ledger = placements[0].ledger
    assert all(p.ledger is ledger for p in placements)
    assert ledger.capacities == [16 * GIB - 3 * CONTEXT_BYTES, 8 * GIB - 2 * CONTEXT_BYTES]


def test_a_gpu_offers_what_other_processes_left_free_and_a_full_one_runs_a_trial_at_a_time():
    from batchsweep.sweeps.gpus.placement import free_now, nvml_handle

    busy = Gpu("0", "simulated, half used by another process", 16 * GIB, "uuid", free_bytes=8 * GIB)
    full = Gpu("1", "simulated, smaller than its workers' contexts", 2 * GIB)
    placements = place(4, [busy, full], "sqlite:///unused.db", program=False)
    ledger = placements[0].ledger
    assert ledger.capacities == [8 * GIB - 2 * CONTEXT_BYTES, 1]
    config = TrainConfig(model="mlp")
    shape = TrainConfig(**{name: getattr(config, name) for name in SHAPE})
    placements[1].fits[shape] = placements[3].fits[shape] = Fit(GIB, 0, "simulated", "cuda_allocator", [])
    assert placements[1].need(config, 8) == (1, False)
    first = ledger.hold(1, 1)
    thread, second = in_thread(lambda: ledger.hold(3, placements[3].need(config, 8)[0]))
    until(lambda: ledger.waiting(1) == 1, "the second trial never asked")
    assert not second  # no room beside the first
    ledger.release(first)
    thread.join(30)
    ledger.release(second["value"])
    assert ledger.peak(1) == 1
    assert nvml_handle("not a GPU") is None and free_now("not a GPU") is None  # NVML cannot say: the whole GPU


def test_trials_start_in_turn_when_their_memory_fits_and_know_whether_they_shared():
    ledger = Ledger([10 * GIB], [0, 0, 0])  # three workers' slots on one GPU
    a = ledger.hold(0, 6 * GIB)
    b_thread, b = in_thread(lambda: ledger.hold(1, 6 * GIB))  # 6 + 6 > 10: waits for a
    until(lambda: ledger.waiting(0) == 1, "b never asked")
    c_thread, c = in_thread(lambda: ledger.hold(2, 3 * GIB))  # fits beside a, but asked after b: waits behind it
    until(lambda: ledger.waiting(0) == 2, "c never asked")
    assert not b and not c
    assert not ledger.release(a).shared  # nothing started while it ran
    b_thread.join(30)
    c_thread.join(30)
    b, c = b["value"], c["value"]
    assert ledger.peak(0) == 9 * GIB  # b and c together; a and b never
    assert ledger.release(c).shared and ledger.release(b).shared
    alone = ledger.hold(0, 20 * GIB)  # more than the GPU has: it starts when the GPU is empty, and runs alone
    small_thread, small = in_thread(lambda: ledger.hold(1, 1))
    until(lambda: ledger.waiting(0) == 1, "the small trial never asked")
    assert not small and not ledger.release(alone).shared
    small_thread.join(30)
    ledger.release(small["value"])


def test_a_trial_that_must_run_alone_waits_for_an_empty_gpu():
    ledger = Ledger([10 * GIB], [0, 0])
    first = ledger.hold(0, 1)
    thread, alone = in_thread(lambda: ledger.hold(1, 1, alone=True))
    until(lambda: ledger.waiting(0) == 1, "the trial never asked")
    assert not alone
    ledger.release(first)
    thread.join(30)
    assert not ledger.release(alone["value"]).shared


def _worker(ledger, needs, slot, ran, checks):
    """A worker process's trials on its simulated GPU: each checks what the GPU holds while it holds."""
    gpu = ledger.gpu_of[slot]
    for n, need in enumerate(needs):
        lease = ledger.hold(slot, need)
        checks.put(ledger.peak(gpu) <= ledger.capacities[gpu])
        sum(range(20_000))  # a little work while holding
        ran.put((gpu, n, need))
        ledger.release(lease)


def test_worker_processes_sharing_a_simulated_gpu_never_overcommit_it_and_run_every_trial_once():
    ctx = multiprocessing.get_context("spawn")
    ledger = Ledger([6 * GIB], [0, 0], ctx)
    ran, checks = ctx.Queue(), ctx.Queue()
    needs = [[(1 + (7 * i + w) % 5) * GIB for i in range(30)] for w in range(2)]
    procs = [ctx.Process(target=_worker, args=(ledger, needs[w], w, ran, checks)) for w in range(2)]
    for proc in procs:
        proc.start()
    done = [ran.get(timeout=120) for _ in range(60)]
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    assert sorted(done) == sorted((0, n, need) for w in range(2) for n, need in enumerate(needs[w]))
    assert all(checks.get(timeout=10) for _ in range(60))
    assert 0 < ledger.peak(0) <= 6 * GIB and ledger.waiting(0) == 0


def _dies_holding(ledger, held):
    ledger.hold(0, 8 * GIB)
    held.set()
    os._exit(9)  # as the kernel's out-of-memory killer would end it: no release


def test_a_worker_that_died_holding_memory_frees_it():
    ctx = multiprocessing.get_context("spawn")
    ledger = Ledger([10 * GIB], [0, 0], ctx)
    held = ctx.Event()
    proc = ctx.Process(target=_dies_holding, args=(ledger, held))
    proc.start()
    assert held.wait(120)
    proc.join(60)
    thread, lease = in_thread(lambda: ledger.hold(1, 8 * GIB))
    thread.join(30)
    assert not ledger.release(lease["value"]).shared and ledger.peak(0) == 8 * GIB


SIMULATED = Gpu("0", "simulated", 10 * GIB)


def placement(ledger, slot, program=False) -> tuple[Placement, TrainConfig]:
    """A worker's placement whose memory model is given (the fit a batch_memory study or a probe would give):
    1 GiB + 10 MiB per sample."""
    config = TrainConfig(model="mlp", physical_batch=100)
    shape = TrainConfig(**{name: getattr(config, name) for name in SHAPE})
    fits = {shape: Fit(GIB, 10 * 2 ** 20, "simulated", "cuda_allocator", [])}
    return Placement(slot, SIMULATED, ledger, "sqlite:///unused.db", program, fits), config


def test_an_out_of_memory_beside_another_trial_runs_again_alone_and_only_then_counts():
    ledger = Ledger([10 * GIB], [0, 0])
    first, config = placement(ledger, 0)
    second, _ = placement(ledger, 1)
    go, first_tags = threading.Event(), {}
    first_thread, first_done = in_thread(lambda: first.run(config, 100, lambda: go.wait(60) and "first",
                                                           lambda: None, first_tags))
    until(lambda: ledger.peak(0) > 0, "the first trial never started")
    attempts, again, tags = [], [], {}

    def train():
        attempts.append(1)
        if len(attempts) == 1:  # beside the first trial: the GPU's memory was not what the fit said
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return "second"

    second_thread, second_done = in_thread(lambda: second.run(config, 100, train, lambda: again.append(1), tags))
    until(lambda: again and ledger.waiting(0) == 1, "the second trial never asked to run alone")
    assert len(attempts) == 1  # it waits for the first to end
    go.set()
    first_thread.join(30)
    second_thread.join(30)
    assert first_done["value"] == "first" and second_done["value"] == "second"
    need = math.ceil(1.25 * (GIB + 100 * 10 * 2 ** 20))  # the fit at b = 100, a quarter above it
    assert first_tags == {"gpu": "0", "gpu_memory_held_bytes": need, "shared_gpu": True}
    assert tags == {"gpu": "0", "gpu_memory_held_bytes": need, "shared_gpu": False, "retried_alone": True}
    assert ledger.peak(0) <= 10 * GIB

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory")

    alone_tags = {}
    with pytest.raises(torch.OutOfMemoryError):  # out of memory alone: that is the trial's outcome
        second.run(config, 100, oom, lambda: again.append(2), alone_tags)
    assert again == [1] and alone_tags["shared_gpu"] is False and "retried_alone" not in alone_tags


def test_a_trial_holds_its_predicted_peak_and_a_programs_trial_its_gpu_alone():
    ledger = Ledger([10 * GIB], [0, 0])
    placed, config = placement(ledger, 0)
    assert placed.need(config, 400) == (math.ceil(1.25 * (GIB + 400 * 10 * 2 ** 20)), False)  # e.g. a twin at b*k
    assert placed.need(config, 10_000) == (10 * GIB, False)  # more than the GPU: it starts when the GPU is empty
    program, _ = placement(ledger, 1, program=True)
    assert program.need(config, 100) == (10 * GIB, True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the flag is valid here")
def test_workers_per_gpu_without_a_gpu_is_one_line(tmp_path, monkeypatch, capsys):
    from batchsweep.sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["--workers-per-gpu", "2", "--dry-run"]) == 2
    assert capsys.readouterr().err == ("error: --workers-per-gpu places workers on GPUs: give it without --workers, "
                                       "on a machine where torch sees a GPU (none is visible here: use --workers)\n")


@pytest.mark.slow
def test_a_study_on_simulated_gpus_places_each_trial_and_tags_its_placement(tmp_path, monkeypatch):
    """Two worker processes on one simulated GPU: every point runs once, and every trial's run says where it
    ran, the memory held for it and whether it shared the GPU."""
    import optuna
    from mlflow import MlflowClient

    from batchsweep.sweeps.cli import build_invocation, parse_args
    from batchsweep.sweeps.trials.driver import run_invocation

    monkeypatch.chdir(tmp_path)  # the workers import tests.factories from the path they inherit
    args = parse_args(["--model", "mlp", "--dataset", "tests.factories:blobs1k", "--epochs", "1", "--seeds", "1",
                       "--set", "warmup_epochs=0", "--log-models", "none", "--n-trials", "4", "--system-metrics"])
    inv = build_invocation(args)
    assert run_invocation(inv, 2, [Gpu("0", "simulated", 2 * CONTEXT_BYTES + GIB, "simulated-uuid")]) == 0
    trials = [t for t in optuna.load_study(study_name="accum_lr", storage=inv.storage).trials
              if t.user_attrs.get("reason") != "duplicate"]
    assert len(trials) == 4 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert len({str(t.user_attrs["config"]) for t in trials}) == 4
    client = MlflowClient(inv.tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("accum_lr").experiment_id],
                              "tags.`mlflow.parentRunId` != ''")
    assert len(runs) == 4
    for run in runs:
        tags = run.data.tags
        assert tags["gpu"] == "0" and tags["shared_gpu"] in ("True", "False"), tags
        assert 0 < int(tags["gpu_memory_held_bytes"]) <= GIB


def test_the_workers_of_a_gpu_share_one_probe(monkeypatch, data_dir, tmp_path):
    """A probe holds its GPU alone, so the GPU's other workers take its fit instead of each probing in turn;
    another GPU, or another shape of memory, is probed for itself."""
    import batchsweep.sweeps.gpus.planner as planner

    probed = []

    def counted(shape):
        probed.append((shape.model, shape.device))
        return real(shape)

    real = planner.measure
    monkeypatch.setattr(planner, "measure", counted)
    ledger = Ledger([10 * GIB, 10 * GIB], [0, 0, 1])
    first, second, third = (Placement(slot, Gpu(str(gpu), "simulated", 10 * GIB), ledger,
                                      f"sqlite:///{tmp_path}/mlflow.db") for slot, gpu in ((0, 0), (1, 0), (2, 1)))
    config = TrainConfig(model="mlp", dataset="mnist1d", data_dir=data_dir, physical_batch=32, device="cpu")
    held = first.need(config, 32)
    assert probed == [("mlp", "cpu")] and 0 < held[0] < GIB
    assert second.need(config, 32) == held and second.need(config, 512) == first.need(config, 512)
    assert len(probed) == 1 and ledger.waiting(0) == 0
    assert third.need(config, 32) == held and len(probed) == 2  # GPU 1's own probe (the same numbers on a CPU)
    assert second.need(dataclasses.replace(config, model="cnn1d"), 32) != held and len(probed) == 3


def test_a_placed_trials_gpu_metrics_are_those_of_its_own_gpu(tmp_path, monkeypatch):
    """NVML numbers every GPU of the machine whatever CUDA_VISIBLE_DEVICES says: MLflow's GPU monitor, narrowed
    by the UUID that torch gave the placement, reads the trial's own GPU alone. No GPU here: MLflow's monitor
    of three simulated GPUs, and NVML's lookup by UUID over them."""
    import pynvml
    from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    from batchsweep.sweeps.gpus.placement import own_gpu

    nvml = {"GPU-aaaa": "handle 0", "GPU-bbbb": "handle 1", "GPU-cccc": "handle 2"}  # NVML prefixes its UUIDs

    def by_uuid(uuid):
        if uuid not in nvml:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return nvml[uuid]

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", by_uuid)
    monitor = SystemMetricsMonitor("run", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    gpus = GPUMonitor.__new__(GPUMonitor)  # (its __init__ asks NVML for the machine's GPUs)
    monitor.monitors.append(gpus)
    for uuid, handles in (("bbbb", ["handle 1"]), ("GPU-cccc", ["handle 2"]), ("dddd", list(nvml.values()))):
        gpus.gpu_handles = list(nvml.values())
        own_gpu(monitor, uuid)
        assert gpus.gpu_handles == handles, uuid  # one NVML does not know keeps every GPU, as MLflow logs them


def test_a_gpu_metric_nvml_cannot_read_is_warned_once_not_every_second(monkeypatch, caplog):
    """A MIG slice has no utilization or power of its own: MLflow's GPU monitor warns at every sample. No GPU
    here: the monitor's own collect_metrics over a simulated handle whose utilization NVML does not support."""
    import pynvml
    from mlflow.system_metrics.metrics.base_metrics_monitor import BaseMetricsMonitor
    from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

    from batchsweep.sweeps.stores.mlflow_store import quiet_library_logs

    def unsupported(handle):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    class Memory:
        used, total = 2 * GIB, 10 * GIB

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda handle: Memory)
    for name in ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPowerUsage"):
        monkeypatch.setattr(pynvml, name, unsupported)
    # A filter of its own, whatever this process logged before (what every command and worker process does first)
    monkeypatch.setattr(logging.getLogger("mlflow.system_metrics.metrics.gpu_monitor"), "filters", [])
    quiet_library_logs()
    gpus = GPUMonitor.__new__(GPUMonitor)  # (its __init__ asks NVML for the machine's GPUs)
    BaseMetricsMonitor.__init__(gpus)
    gpus.gpu_handles = ["mig slice"]
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            gpus.collect_metrics()
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and any("utilization" in m for m in warned) and any("power" in m for m in warned)
    assert len(gpus._metrics["gpu_0_memory_usage_percentage"]) == 5  # what NVML can read is still sampled


@pytest.mark.parametrize("room", ["fits", "too small"])
def test_a_fused_group_on_a_gpu_holds_its_members_peaks_together_or_trains_them_alone(tmp_path, monkeypatch, capsys,
                                                                                     room):
    """A fused group on a (simulated) GPU holds the sum of its members' predicted peaks, and each member's run
    says what was held for it and for the group; a group whose sum the GPU does not offer trains its members
    alone, each placed as a solo trial, after one line saying why."""
    import optuna
    from mlflow import MlflowClient

    from batchsweep.sweeps.cli import build_invocation, parse_args
    from batchsweep.sweeps.trials.driver import run_invocation

    monkeypatch.chdir(tmp_path)
    args = parse_args(["--model", "mlp", "--dataset", "tests.factories:blobs1k", "--epochs", "1", "--seeds", "1",
                       "--set", "warmup_epochs=0", "--log-models", "none", "--n-trials", "3", "--no-report"])
    inv = build_invocation(args)
    # One worker's context is taken off the GPU's memory: "too small" offers 1 byte, which one trial is given
    # (a trial larger than its GPU starts when the GPU is empty) but a group of three is not.
    total = CONTEXT_BYTES + (GIB if room == "fits" else 0)
    assert run_invocation(inv, 1, [Gpu("0", "simulated", total, "simulated-uuid")]) == 0
    trials = optuna.load_study(study_name="accum_lr", storage=inv.storage).trials
    assert len(trials) == 3 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    client = MlflowClient(inv.tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("accum_lr").experiment_id],
                              "tags.`mlflow.parentRunId` != ''")
    tags = [run.data.tags for run in runs]
    err = capsys.readouterr().err
    if room == "fits":
        assert all(t["fused_members"] == "3" for t in tags), tags
        held = [int(t["gpu_memory_held_bytes"]) for t in tags]
        assert all(0 < h for h in held) and {int(t["group_gpu_memory_held_bytes"]) for t in tags} == {sum(held)}
        assert "train alone" not in err
    else:
        assert all(t.get("fused_members", "0") == "0" and "group_gpu_memory_held_bytes" not in t for t in tags), tags
        assert all(t["gpu_memory_held_bytes"] == "1" for t in tags)
        assert "train alone: fused they would need 3 B, more than the 1 B this GPU offers" in err, err
