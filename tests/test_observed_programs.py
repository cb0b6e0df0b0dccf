"""[program] trials as the tracer observes them: a script that prints only text is swept on the train_loss it
backwards, its noise scale measured from batches drawn with replacement; a GAN's two optimizers are each their
own windows, so the trial is not taken for one that does not accumulate as asked."""
import pytest

from tests.conftest import ROOT
from tests.test_sweeps import child_runs, stores, sweep


@pytest.mark.slow
def test_a_script_that_prints_only_text_is_swept_on_its_observed_train_loss(tmp_path):
    """examples/audit/gpt_sweep.toml's loop (nanoGPT's way: text lines, no JSON, no MLflow, torch.randint batches):
    4 trials complete on `train_loss`, the sum of each window's backwarded losses (its mean loss: the script
    divides by k) at the end of training, each window's at its step, and the k = 4 trials with a noise scale
    (micro-batches drawn with replacement: no finite-set correction, no DataLoader needed)."""
    study = (ROOT / "examples/audit/gpt_sweep.toml").read_text().replace('"gpt_subject.py"',
                                                                          f'"{ROOT}/examples/audit/gpt_subject.py"')
    path = tmp_path / "gpt_sweep.toml"
    path.write_text(study.replace('"--max-iters", "40"', '"--max-iters", "16"'))
    proc = sweep(tmp_path, "--study", str(path), "--no-report")
    assert proc.returncode == 0, proc.stderr
    _, client = stores(tmp_path)
    runs, _ = child_runs(client, "gpt_text")
    assert len(runs) == 4 and all(r.info.status == "FINISHED" for r in runs)
    for run in runs:
        k = int(run.data.params["accum_steps"])
        tags, metrics = run.data.tags, run.data.metrics
        assert (tags["observed_physical_batch"], tags["observed_accum_steps"]) == ("4", str(k)), tags
        assert "config_mismatch" not in tags
        windows = client.get_metric_history(run.info.run_id, "window_loss")
        assert [m.step for m in sorted(windows, key=lambda m: m.step)] == list(range(1, 17))
        # the mean of the last tenth of the windows (1 of 16 here), not one value picked anew
        assert metrics["train_loss"] == pytest.approx(max(windows, key=lambda m: m.step).value)
        assert 0 < metrics["train_loss"] < 4  # a cross-entropy over 32 tokens starts near ln 32 = 3.47
        assert ("noise_scale" in metrics) == (k == 4), metrics
        if k == 4:
            assert metrics["noise_scale"] > 0 and "not measured" not in tags.get("warnings", "")


@pytest.mark.slow
def test_a_gans_two_optimizers_are_each_their_own_windows(tmp_path):
    """A discriminator that backwards its real and fake losses apart (2k calls a window) and a generator (k): at
    k = 1 and k = 2 the generator's windows hold k micro-batches, so no trial is tagged config_mismatch (every
    GAN trial at k = 1 was: `accum_steps 1 passed, 3 observed`)."""
    path = tmp_path / "gan.toml"
    path.write_text(f'''name = "gan"
[fixed]
base_lr = 0.05
[grid]
physical_batch = [8]
accum_steps = [1, 2]
[objective]
metrics = ["train_loss"]
directions = ["minimize"]
[program]
command = ["{{python}}", "{ROOT}/tests/programs/plain.py", "--batch-size", "{{physical_batch}}", "--accum",
           "{{accum_steps}}", "--lr", "{{lr}}", "--seed", "{{seed}}", "--case", "gan", "--epochs", "1"]
''')
    proc = sweep(tmp_path, "--study", str(path), "--no-report")
    assert proc.returncode == 0, proc.stderr
    _, client = stores(tmp_path)
    runs, _ = child_runs(client, "gan")
    assert sorted(int(r.data.tags["observed_accum_steps"]) for r in runs) == [1, 2]
    assert not any("config_mismatch" in r.data.tags for r in runs)
