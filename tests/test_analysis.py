import json
import os
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from analysis.figures import all_figures, best_lr
from analysis.findings import summarize
from analysis.render import write_report
from analysis.runs import StudyRuns, aggregate, load_study
from tests.conftest import run_script
from tests.test_sweeps import TINY, sweep

KS = (1, 2, 4, 8, 16)


def synthetic(accuracy) -> pd.DataFrame:
    """An accum_lr-shaped frame: accuracy(rule, B, kind, seed) gives each trial's val_acc."""
    rows = []
    for seed in (0, 1, 2):
        for rule in ("none", "linear", "sqrt"):
            for k in KS:
                for b, kk, kind in ((32, k, "accumulated" if k > 1 else "true batch"), (32 * k, 1, "true batch")):
                    if kind == "true batch" and kk == 1 and b == 32 and k > 1:
                        continue
                    rows.append(dict(run_id=f"{seed}-{rule}-{b}-{kk}", status="FINISHED", physical_batch=b,
                                     accum_steps=kk, effective_batch=b * kk, lr_rule=rule, seed=seed, epochs=2,
                                     model="cnn1d", dataset="mnist1d", device_name="cpu", batch=kind,
                                     bn_momentum_rule="default", memory_source="saved_tensors",
                                     peak_memory_bytes=1000.0 + 100 * b, samples_per_s=1000.0 * b ** 0.5,
                                     val_acc=accuracy(rule, b * kk, kind, seed), reason=None))
    return pd.DataFrame(rows).drop_duplicates("run_id")


def flat(rule, B, kind, seed):
    return 0.95 + 0.001 * seed


def test_planted_gap_shows_up_in_the_summary():
    def planted(rule, B, kind, seed):
        return flat(rule, B, kind, seed) - (0.021 if rule == "linear" and B == 512 else 0.0)

    sentences = " ".join(summarize(synthetic(planted)))
    assert "The linear LR rule stayed within 0.5 points of B = 32 up to B = 256; at B = 512 it lost 2.1 points" \
        in sentences
    assert "The sqrt LR rule stayed within 0.5 points of B = 32 up to B = 512." in sentences
    assert "the best rule was none (95.1%), then sqrt (95.1%), then linear (93.0%)" in sentences
    # Without the plant, no rule loses anything.
    assert "lost" not in " ".join(summarize(synthetic(flat)))


def test_planted_accumulation_gap_is_named():
    def planted(rule, B, kind, seed):
        return flat(rule, B, kind, seed) - (0.04 if kind == "accumulated" and B == 128 and rule == "sqrt" else 0)

    sentences = " ".join(summarize(synthetic(planted)))
    assert "the largest gap was 4.0 points (true batch ahead) at lr_rule = sqrt, effective_batch = 128" in sentences


def test_seed_aggregation_gives_mean_and_t_interval():
    stats = aggregate(synthetic(flat), ["lr_rule", "effective_batch", "batch"], "val_acc")
    row = stats[(stats.lr_rule == "none") & (stats.effective_batch == 64) & (stats.batch == "accumulated")].iloc[0]
    assert row["n"] == 3 and row["mean"] == pytest.approx(0.951)
    # values 0.950, 0.951, 0.952: sd 0.001, t(0.975, 2) = 4.303
    assert row["ci95"] == pytest.approx(4.303 * 0.001 / 3 ** 0.5, rel=1e-3)


def test_figures_from_a_synthetic_frame(tmp_path):
    trials = synthetic(flat)
    history = pd.DataFrame([dict(run_id=r, epoch=e, val_acc=0.5 + 0.2 * e) for r in trials.run_id for e in (1, 2)])
    names = [f.name for f in all_figures(trials, history)]
    assert names == ["accuracy_vs_batch", "memory_vs_batch", "throughput", "learning_curves"]
    page = write_report([StudyRuns("synthetic", trials, history, None, "sqlite:///nowhere")], tmp_path)
    assert page.read_text().count("<img") == 4
    assert all((tmp_path / f"{n}.png").stat().st_size > 1000 for n in names)


def test_lr_exponent_is_fitted():
    rows = [dict(run_id=f"{b}-{lr}", status="FINISHED", effective_batch=b, base_lr=lr, physical_batch=32,
                 accum_steps=b // 32, seed=0, epochs=2, model="mlp", dataset="d", device_name="cpu",
                 val_acc=1 - abs(lr - 0.05 * (b / 32) ** 0.7) / 10, reason=None)
            for b in (32, 64, 128, 256) for lr in [0.05 * (b / 32) ** 0.7 * f for f in (0.5, 1.0, 2.0)]]
    best, alpha = best_lr(pd.DataFrame(rows))
    assert alpha == pytest.approx(0.7, abs=1e-6)
    assert "grew as B^0.70" in " ".join(summarize(pd.DataFrame(rows)))


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    folder = tmp_path_factory.mktemp("study")
    proc = sweep(folder, *TINY, "--n-trials", "8", "--epochs", "2", "--seeds", "2")  # 4 points: B = 32 and 64
    assert proc.returncode == 0, proc.stderr
    return folder


def test_loads_typed_frames_from_a_real_study(tiny_study):
    runs = load_study("accum_lr", f"sqlite:///{tiny_study}/mlruns/mlflow.db")
    t = runs.trials
    assert len(t) == 8 and set(t["seed"]) == {0, 1}
    assert t["effective_batch"].dtype.kind == "i" and t["lr"].dtype.kind == "f" and t["drop_last"].dtype == bool
    assert (t["effective_batch"] == t["physical_batch"] * t["accum_steps"]).all()
    assert list(runs.history.groupby("run_id")["epoch"].apply(list).iloc[0]) == [1, 2]
    assert runs.parent_run_id is not None


def test_report_command_and_compare(tiny_study):
    uri = f"sqlite:///{tiny_study}/mlruns/mlflow.db"
    proc = run_script("analysis/report.py", "--study", "accum_lr", "--tracking-uri", uri, cwd=tiny_study)
    assert proc.returncode == 0, proc.stderr
    folder = tiny_study / "reports/accum_lr"
    assert {"report.html", "report.md", "trials.csv", "accuracy_vs_batch.png"} <= {p.name for p in folder.iterdir()}
    md = (folder / "report.md").read_text()
    assert "## Findings: accum_lr" in md and "2 seeds; 2 epochs" in md
    assert "## Training health: accum_lr" in md and "health.png" in md
    # A second study under another name, then both side by side.
    assert sweep(tiny_study, *TINY, "--study", "batch_memory", "--n-trials", "3").returncode == 0
    proc = run_script("analysis/report.py", "--compare", "accum_lr", "batch_memory", "--tracking-uri", uri,
                      cwd=tiny_study)
    assert proc.returncode == 0, proc.stderr
    both = (tiny_study / "reports/accum_lr_vs_batch_memory/report.md").read_text()
    assert "## Findings: accum_lr" in both and "## Findings: batch_memory" in both
    assert "batch_memory-throughput.png" in both


@pytest.mark.parametrize("args,expected", [
    (["--study", "nothing"], "no study 'nothing'"),
    (["--study", "accum_lr", "--tracking-uri", "sqlite:////nonexistent/mlflow.db"], "no MLflow store at"),
])
def test_report_bad_input(tiny_study, args, expected):
    uri = ["--tracking-uri", f"sqlite:///{tiny_study}/mlruns/mlflow.db"] if "--tracking-uri" not in args else []
    proc = run_script("analysis/report.py", *args, *uri, cwd=tiny_study)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: ") and expected in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# Injected before the report's own content: collects console errors and checks every image once loaded.
PROBE = """<script>
window.__errors = [];
const error = console.error; console.error = (...a) => { window.__errors.push(a.join(' ')); error(...a); };
window.addEventListener('error', e => window.__errors.push(String(e.message || e.target.src || e)), true);
window.addEventListener('load', () => {
  const images = [...document.images].map(i => ({alt: i.alt, ok: i.complete && i.naturalWidth > 0}));
  const pre = document.createElement('pre'); pre.id = 'probe';
  pre.textContent = JSON.stringify({errors: window.__errors, images});
  document.body.appendChild(pre);
});
</script>"""


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path:
        return path
    if os.environ.get("CI"):
        pytest.fail("chromium is missing: .ci/run installs Debian's chromium")
    pytest.skip("headless Chromium is not installed here (apt-get install chromium)")


def test_html_report_opens_in_chromium_with_every_figure(tiny_study, tmp_path):
    browser = chromium()
    uri = f"sqlite:///{tiny_study}/mlruns/mlflow.db"
    assert run_script("analysis/report.py", "--study", "accum_lr", "--tracking-uri", uri, "--no-log",
                      "--out", str(tmp_path)).returncode == 0
    page = (tmp_path / "accum_lr/report.html").read_text()
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("<head>", "<head>" + PROBE, 1))
    out = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom",
                          probed.as_uri()], capture_output=True, text=True, timeout=120)
    dom = out.stdout
    assert '<pre id="probe">' in dom, out.stderr[-2000:]
    result = json.loads(dom.split('<pre id="probe">', 1)[1].split("</pre>", 1)[0].replace("&quot;", '"'))
    assert result["errors"] == []
    assert len(result["images"]) >= 3 and all(i["ok"] for i in result["images"]), result["images"]


def test_noise_scale_sentence_names_the_predicted_critical_batch():
    def falls_at_256(rule, B, kind, seed):
        return flat(rule, B, kind, seed) - (0.03 if B >= 256 else 0.0)

    trials = synthetic(falls_at_256)
    trials["noise_scale"] = trials["accum_steps"].map(lambda k: 250.0 if k > 1 else float("nan"))
    sentences = " ".join(summarize(trials))
    assert "The gradient noise scale at the last epoch was 250 (median of 36 trials with k ≥ 2" in sentences
    assert "first fell more than 0.5 points below B = 32 at B = 256" in sentences and "near that prediction" in sentences
    figure = all_figures(trials, pd.DataFrame())[0]
    assert figure.name == "accuracy_vs_batch" and "noise scale" in figure.title
