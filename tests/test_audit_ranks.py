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


def study(folder, case: str, loss: str, launcher: str = "{world_size}"):
    path = folder / "ddp.toml"
    path.write_text(f'''name = "ddp"
[program]
command = ["{{python}}", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "{launcher}",
           "{DDP}", "--batch-size", "{{physical_batch}}", "--accum", "{{accum_steps}}", "--seed", "{{seed}}",
           "--case", "{case}", "--loss", "{loss}"]
''')
    return path


def audited(tmp_path, store, capsys, case: str, loss: str) -> tuple[int, str, dict]:
    code = main(["--study", str(study(tmp_path, case, loss)), "--physical-batch", "8", "--accum-steps", "4",
                 "--nproc", "2", "--tracking-uri", store, "--json", str(tmp_path / "audit.json")])
    out = capsys.readouterr().out
    return code, out, json.loads((tmp_path / "audit.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case, loss", [("plain", "sample"), ("plain", "token"), ("sync_everywhere", "sample"),
                                        ("rank_mean", "sample")])
def test_correct_ddp_loops_are_exact(case, loss, tmp_path, store, capsys):
    """The correct loop on samples and on padded tokens (the count all-reduced), no_sync() around backward() alone
    (a no-op: every micro-batch all-reduces, the same gradient), and a per-rank mean where every rank counts alike:
    the two ranks' weights equal, (b, k) on 2 ranks equal to (b*k, 1) on 2, and that equal to (b*k*2, 1) on one."""
    code, out, found = audited(tmp_path, store, capsys, case, loss)
    assert (code, found["verdicts"]) == (0, ["exact"]), out
    assert found["compared"]["(b*k, 1) on 2 ranks against (b*k*2, 1) on one rank"] <= 1e-10
    assert "every rank's weights agree with rank 0's" in " ".join(found["notes"])
    assert "ranks" in out.splitlines()[0].split() and ["one", "rank", "64", "1", "1"] in [
        line.split()[:5] for line in out.splitlines()]


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
    assert found["rank_update_ratio"] == pytest.approx(2, rel=1e-6) and found["rank_update_cosine"] > 1 - 1e-9


@pytest.mark.slow
def test_a_per_rank_token_mean_is_mean_of_rank_means(tmp_path, store, capsys):
    """Each rank divides by its own token count, and the ranks hold different counts: the update turns."""
    code, out, found = audited(tmp_path, store, capsys, "rank_mean", "token")
    assert (code, found["verdicts"]) == (1, ["mean_of_rank_means"]), out
    counts = [int(c) for c in found["rank_counts"].split(", ")]
    assert len(counts) == 2 and counts[0] != counts[1]
    assert found["rank_update_cosine"] < 1 - 1e-6


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
