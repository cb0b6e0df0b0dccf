"""`batchsweep audit --nproc 2` on the DDP catalog (tests/programs/ddp.py), 2 gloo ranks on the CPU: the mistakes
that ranks add named, and correct DDP loops `exact`."""
import json

import pytest

from batchsweep.sweeps.audit.command import main
from tests.conftest import ROOT

DDP = ROOT / "tests" / "programs" / "ddp.py"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('ranks')}/mlflow.db"


def study(folder, case: str, loss: str, launcher: str = "{world_size}", deal: str = "sample", extra=()):
    path = folder / "ddp.toml"
    more = "".join(f', "{arg}"' for arg in extra)
    path.write_text(f'''name = "ddp"
[program]
command = ["{{python}}", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "{launcher}",
           "{DDP}", "--batch-size", "{{physical_batch}}", "--accum", "{{accum_steps}}", "--seed", "{{seed}}",
           "--case", "{case}", "--loss", "{loss}", "--deal", "{deal}"{more}]
''')
    return path


def audited(tmp_path, store, capsys, case: str, loss: str, deal: str = "sample", extra=()) -> tuple[int, str, dict]:
    code = main(["--study", str(study(tmp_path, case, loss, deal=deal, extra=extra)), "--physical-batch", "8",
                 "--accum-steps", "4", "--nproc", "2", "--tracking-uri", store, "--json", str(tmp_path / "audit.json")])
    out, err = capsys.readouterr()
    if not (tmp_path / "audit.json").exists():  # an audit that ended before its verdict: say why it did
        pytest.fail(f"exit {code} and no verdict: {err[-3000:]}")
    return code, out, json.loads((tmp_path / "audit.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case, loss, deal, extra", [
    ("plain", "sample", "sample", ()), ("plain", "token", "sample", ()), ("plain", "token", "micro", ()),
    ("sync_everywhere", "sample", "sample", ()), ("rank_mean", "sample", "sample", ()),
    ("plain", "sample", "sample", ("--static-graph", "bootstrap", "--clip", "0.1"))])
def test_correct_ddp_loops_are_exact(case, loss, deal, extra, tmp_path, store, capsys):
    """The correct loop on samples and on padded tokens (the count all-reduced), also with micro-batches dealt to
    the ranks in turn (Accelerate's way: a rank's own samples differ between (b, k) and (b*k, 1), the windows as a
    whole do not), no_sync() around backward() alone (a no-op: every micro-batch all-reduces, the same gradient),
    a per-rank mean where every rank counts alike, and DDP(static_graph=True) with the run's first micro-batch
    synced (torch 2.14 then all-reduces every window), clipped: the two ranks' weights equal, (b, k) on 2 ranks
    equal to (b*k, 1) on 2, and that equal to (b*k*2, 1) on one."""
    code, out, found = audited(tmp_path, store, capsys, case, loss, deal, extra)
    assert (code, found["verdicts"]) == (0, ["exact"]), out
    assert found["compared"]["(b*k, 1) on 2 ranks against (b*k*2, 1) on one rank"] <= 1e-10
    assert "every rank's weights agree with rank 0's" in " ".join(found["notes"])
    assert "ranks" in out.splitlines()[0].split() and ["one", "rank", "64", "1", "1"] in [
        line.split()[:5] for line in out.splitlines()]
    assert ("tokens" in out) == (loss == "token")  # each rank's counts, where the ranks' differ


@pytest.mark.slow
def test_the_sync_switched_after_the_forward_is_grads_not_synced(tmp_path, store, capsys):
    """require_backward_grad_sync set after the model's call (build-nanogpt #30): DDP read it in the forward, so
    the window's last backward stays local and the ranks' weights part at the first update."""
    code, out, found = audited(tmp_path, store, capsys, "sync_after_forward", "sample")
    assert (code, found["verdicts"]) == (1, ["grads_not_synced"]), out
    assert found["rank_first_parting"] == 1 and found["rank_rel_diff"] > 1e-3
    assert "where the true batch's ranks agree" in found["sentence"]


@pytest.mark.slow
def test_a_loss_times_the_world_size_is_loss_scaled_by_world(tmp_path, store, capsys):
    """The accumulation is right (the two runs on 2 ranks agree); the update on 2 ranks is twice one rank's."""
    code, out, found = audited(tmp_path, store, capsys, "world_times", "sample")
    assert (code, found["verdicts"]) == (1, ["loss_scaled_by_world"]), out
    assert found["rank_first_differing_update"] == 1
    assert found["rank_gradient_ratio"] == pytest.approx(2, rel=1e-6) and found["rank_gradient_cosine"] > 1 - 1e-9
    assert "window's gradient (before any clipping) on 2 ranks is 2 x the global batch's" in found["sentence"]


@pytest.mark.slow
def test_batchnorm_across_ranks_says_the_reduction_cannot_be_told_not_that_it_passes(tmp_path, store, capsys):
    """BatchNorm in training mode normalizes each rank's own samples, so 2 ranks never equal one: a loss times the
    world size beside it passed with exit status 0. Nothing about the reduction can be told: exit status 2."""
    code, out, found = audited(tmp_path, store, capsys, "world_times", "sample", extra=("--bn", "yes"))
    assert code == 2 and "batchnorm_across_ranks" in found["verdicts"], out
    assert "cannot be told from these runs" in out and "BatchNorm frozen (eval mode)" in out, out


@pytest.mark.slow
def test_a_loss_over_the_global_count_under_clipping_is_loss_scaled_by_world_not_exact(tmp_path, store, capsys):
    """The loss over the window's count on all ranks but not times N: DDP's mean halves the gradient. Clipped at
    0.1, below both windows' gradient norms (about 0.3 and 0.6), in float32, the weights of 2 ranks and of one agree
    within float32's tolerance, which read `exact` before; the windows' gradients before the clip say 1/2."""
    code, out, found = audited(tmp_path, store, capsys, "global_mean", "sample",
                               extra=("--clip", "0.1", "--dtype", "float32"))
    assert (code, found["verdicts"]) == (1, ["loss_scaled_by_world"]), out
    assert found["compared"]["(b*k, 1) on 2 ranks against (b*k*2, 1) on one rank"] <= 1e-5
    assert found["rank_gradient_ratio"] == pytest.approx(0.5, rel=1e-4) and found["rank_gradient_cosine"] > 1 - 1e-6
    assert found["rank_weights_agree"] == pytest.approx(0.1)
    assert "clip_grad_norm_ at 0.1 cut both windows' gradients to that norm" in found["sentence"]


@pytest.mark.slow
def test_a_sync_that_counts_to_k_is_grads_not_synced_in_the_short_window_with_its_own_advice(
        tmp_path, store, capsys):
    """require_backward_grad_sync = micro_step == k - 1, as nanoGPT-style loops over islice(loader, k) write it: the
    epoch's last window (3 micro-batches of 4) never all-reduces, the full ones before it do. The advice is the
    short window's (test against the window's own length), not "switch the sync before the forward", which this
    loop already does."""
    code, out, found = audited(tmp_path, store, capsys, "sync_at_k", "sample")
    assert (code, found["verdicts"]) == (1, ["grads_not_synced"]), out
    assert (found["rank_first_parting"], found["rank_parting_window"]) == (4, 3)
    assert "micro_step == len(micro) - 1" in found["sentence"] and "before its forward" not in found["sentence"]


@pytest.mark.slow
def test_static_graph_with_no_sync_from_the_first_micro_batch_is_the_ranks_own_error_in_one_line(
        tmp_path, store, capsys):
    """DDP(static_graph=True) with no_sync() from the run's first micro-batch: torch 2.14.1 fails in that backward
    with an INTERNAL ASSERT (PyTorch #187732), so there is nothing to compare: the rank's own error, not
    torchrun's report of a failed child, in one line."""
    code = main(["--study", str(study(tmp_path, "plain", "sample", extra=("--static-graph", "yes"))),
                 "--physical-batch", "8", "--accum-steps", "4", "--nproc", "2", "--tracking-uri", store])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith("error: the accumulated run failed"), err
    assert "]: RuntimeError: expect_autograd_hooks_ INTERNAL ASSERT FAILED" in err, err


@pytest.mark.slow
@pytest.mark.parametrize("deal", ["sample", "micro"])
def test_a_per_rank_token_mean_is_mean_of_rank_means(deal, tmp_path, store, capsys):
    """Each rank divides by its own token count, and the ranks hold different counts: the update turns. With
    micro-batches dealt in turn, (b, k) and (b*k, 1) on 2 ranks differ too (each rank's mean is over other tokens in
    the two), which is the reduction's doing: said in a note, not named a mistake of the accumulation."""
    code, out, found = audited(tmp_path, store, capsys, "rank_mean", "token", deal)
    assert (code, found["verdicts"]) == (1, ["mean_of_rank_means"]), out
    counts = [int(c) for c in found["rank_counts"].split(", ")]
    assert len(counts) == 2 and counts[0] != counts[1]
    assert found["rank_gradient_cosine"] < 1 - 1e-6
    assert ("each rank holds other samples at (b, k)" in " ".join(found["notes"])) == (deal == "micro")
    assert found["runs"] == 3  # window 1's gradients from the three runs; no diagnosis of the accumulation
    ranks = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert len(ranks) == 2 and ranks[0][1:4] == ranks[1][1:4] and ranks[0][4] != ranks[1][4]  # tokens differ


def test_nproc_needs_a_launcher_that_takes_the_world_size(tmp_path, store, capsys):
    code = main(["--study", str(study(tmp_path, "plain", "sample", launcher="2")), "--physical-batch", "8",
                 "--accum-steps", "4", "--nproc", "2", "--tracking-uri", store])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "pass {world_size} to the launcher" in err


@pytest.mark.slow
def test_a_launcher_that_starts_fewer_ranks_than_asked_is_one_line(tmp_path, store, capsys):
    """{world_size} passed somewhere (here the environment), but the launcher starts one rank: no comparison of
    ranks that never ran, one line instead."""
    path = tmp_path / "one.toml"
    path.write_text(f'''name = "ddp-one"
[program]
command = ["{{python}}", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "{DDP}",
           "--batch-size", "{{physical_batch}}", "--accum", "{{accum_steps}}", "--seed", "{{seed}}"]
env = {{ WORLD = "{{world_size}}" }}
''')
    code = main(["--study", str(path), "--physical-batch", "8", "--accum-steps", "4", "--nproc", "2",
                 "--tracking-uri", store])
    err = capsys.readouterr().err
    assert code == 2 and "--nproc 2: the tracer saw 1 rank step" in err.strip().splitlines()[-1]


def test_the_windows_of_ranks_are_compared_as_a_whole():
    """Rank 0's steps, with the i-th micro-batches' sizes, the fingerprints and the tokens of every rank added up:
    what DDP's mean of the ranks' gradients steps on."""
    from batchsweep.sweeps.launch.observed import Step, Trace, merged

    zero = Trace(steps=[Step(1, "ZFBFBS", [4, 4], [0.1], fingerprint=[1.0, 2.0], tokens=10)])
    one = Trace(steps=[Step(1, "ZFBFBS", [4, 3], [0.1], fingerprint=[0.5, 4.0], tokens=7)])
    (step,) = merged({0: zero, 1: one})
    assert (step.samples, step.fingerprint, step.tokens, step.events) == ([8, 7], [1.5, 6.0], 17, "ZFBFBS")


def test_only_replicas_are_compared_with_rank_0():
    """Ranks that hold other tensors than rank 0 (shards) are not said to have parted."""
    import torch

    from batchsweep.sweeps.audit.ranks import parted
    from batchsweep.sweeps.audit.runs import ScriptRun

    run = ScriptRun("accumulated", 8, 4, 0, 0.1, 1, 2, state={"w": torch.ones(4, dtype=torch.float64)})
    run.others = {1: {"w": torch.ones(2, dtype=torch.float64)}}
    assert parted(run) is None
    run.others = {1: {"w": torch.tensor([1.0, 1.0, 1.0, 3.0], dtype=torch.float64)}}
    assert parted(run) == (1, pytest.approx(1.0))


def test_where_two_runs_part_update_1_is_asked_first():
    from batchsweep.sweeps.audit.ranks import first_apart

    asked = []

    def agree(steps):
        asked.append(steps)
        return steps < 6

    assert first_apart(agree, 12) == 6 and asked[0] == 1
    asked.clear()
    assert first_apart(lambda steps: asked.append(steps) or False, 12) == 1 and asked == [1]


def test_where_the_windows_gradients_part_is_checked_with_two_runs_and_update_1_with_none():
    """The traces' hint (the first window whose gradients differ): a later update costs a run before it and one at
    it, update 1 none (from one start, other gradients part the weights at once); a wrong hint is bisected."""
    from batchsweep.sweeps.audit.ranks import first_apart

    asked = []

    def agree(steps):
        asked.append(steps)
        return steps < 6

    assert first_apart(agree, 12, hint=6) == 6 and asked == [5, 6]
    asked.clear()
    assert first_apart(agree, 12, hint=1) == 1 and asked == []
    asked.clear()
    assert first_apart(agree, 12, hint=9) == 6 and asked[0] == 8


def test_the_verdicts_across_ranks_say_what_the_measurement_rests_on():
    """A short window's unsynced gradients get the short window's advice; a loss scale the clip hid from the
    weights is said of the windows' gradients, with the clip that hid it."""
    from batchsweep.sweeps.audit.verdicts import sentence

    short = {"rank_parted": 1, "rank_first_parting": 4, "rank_rel_diff": 0.0256, "steps_accumulated": 4,
             "rank_parting_window": 3}
    said = sentence("grads_not_synced", short)
    assert "holds 3 micro-batches, fewer than k" in said and "micro_step == len(micro) - 1" in said
    full = {key: v for key, v in short.items() if key != "rank_parting_window"}
    assert "before its forward" in sentence("grads_not_synced", full)
    scaled = {"nproc": 2, "rank_first_differing_update": 1, "rank_counts": "32, 32", "rank_gradient_ratio": 0.5,
              "rank_gradient_cosine": 1.0, "rank_gradient_difference": 0.5, "rank_weights_agree": 0.1}
    said = sentence("loss_scaled_by_world", scaled)
    assert said.startswith("the window's gradient (before any clipping) on 2 ranks is 0.5 x the global batch's")
    assert "clip_grad_norm_ at 0.1 cut both windows' gradients" in said
    unclipped = {key: v for key, v in scaled.items() if key != "rank_weights_agree"}
    assert "agree all the same" not in sentence("loss_scaled_by_world", unclipped)


@pytest.mark.slow
def test_batchsweeps_own_trainer_under_torchrun_is_exact(tmp_path, store, capsys):
    """A check of the check: trainers/train.py on 2 ranks (examples/audit/trainer_ddp.toml), its first 5 steps."""
    code = main(["--study", str(ROOT / "examples" / "audit" / "trainer_ddp.toml"), "--physical-batch", "8",
                 "--accum-steps", "4", "--steps", "5", "--nproc", "2", "--tracking-uri", store, "--json",
                 str(tmp_path / "audit.json")])
    found = json.loads((tmp_path / "audit.json").read_text())
    assert (code, found["verdicts"]) == (0, ["exact"]), capsys.readouterr().out
    assert found["compared"]["(b*k, 1) on 2 ranks against (b*k*2, 1) on one rank"] <= 1e-10
