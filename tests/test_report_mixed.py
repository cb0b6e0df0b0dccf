"""A study that mixes a model without BatchNorm with one that has it: the views of the search and the memory and
throughput figures count the runs of the model without under its BN momentum rules once, as the findings do; and a
study that varies the norm says which norm did better at each B, or that its seeds cannot tell."""
import math

from batchsweep.analysis.figures import candidates
from batchsweep.analysis.findings import one_bn_rule, summarize
from batchsweep.analysis.space import importance, memory_front, parallel_coordinates
from tests.test_recommend_edges import _study
from tests.test_report_no_batchnorm import NOTE, VARIED, _bn_grid

RULES = ("default", "scaled", "matched")


def _crossed() -> list[dict]:
    """cnn1d (BatchNorm, bn_mean_error logged) and mlp (none: the trainer's note), each BN rule at every b and k:
    mlp's runs under the three rules identical."""
    rows = []
    for model in ("cnn1d", "mlp"):
        for seed in (0, 1, 2):
            for b in (32, 64):
                for k in (1, 4):
                    for i, rule in enumerate(RULES):
                        shift = 0.003 * i * (k > 1) if model == "cnn1d" else 0.0
                        value = 0.9 - 0.02 * math.log2(b * k / 32) + 0.002 * seed + shift - 0.4 * (model == "mlp")
                        rows.append(dict(
                            seed=seed, physical_batch=b, accum_steps=k, effective_batch=b * k, base_batch=32,
                            bn_momentum_rule=rule, lr_rule="sqrt", model=model, norm="batch", status="FINISHED",
                            reason=None, run_id=f"{model}{len(rows)}", val_acc=round(value, 3),
                            peak_memory_bytes=1e3 * b * (2 if model == "cnn1d" else 1), samples_per_s=1e3 * b + seed,
                            memory_source="saved_tensors",
                            warnings=NOTE.format(rule=rule, model=model) if model == "mlp" and rule != "default"
                            else None, **({"bn_mean_error": 0.01} if model == "cnn1d" else {})))
    return rows


def test_the_views_of_the_search_count_a_model_without_batchnorm_once_under_its_bn_rules():
    """The memory front read 'the best of the 16 configurations': mlp's runs under default, scaled and matched at
    k = 4 as three configurations (8 for its 4 ran), importance 'from 72 finished trials' and the parallel
    coordinates drew 72 lines, where 48 ran distinctly."""
    study = _study(_crossed(), (*VARIED, "model"))
    said = "mlp has no BatchNorm, so its runs under the BN momentum rules count as one configuration, one run per configuration and seed"
    front = memory_front(study).finding
    assert "of the 12 configurations" in front and said in front, front
    assert "BN scaled, model = mlp" not in front and "BN matched, model = mlp" not in front, front
    found = importance(study).finding
    assert "from 48 finished trials" in found and said in found, found
    assert parallel_coordinates(study).context.endswith("48 trials"), parallel_coordinates(study).context


def test_the_memory_and_throughput_figures_count_a_model_without_batchnorm_once():
    """mlp's memory and throughput figures drew its 36 runs under three rules ('36 trials'), its findings 12."""
    study = _study([r for r in _crossed() if r["model"] == "mlp"], VARIED)
    compared = one_bn_rule(study.trials, study.varied)[0]
    drawn = {f.name: f for f in (draw() for draw in candidates(study.trials, study.history, None, None, compared))
             if f is not None}
    for name in ("memory_vs_batch", "throughput"):
        assert drawn[name].context.endswith("12 trials"), (name, drawn[name].context)


def _norms(shift: float) -> list[dict]:
    """A study of the norm (batch against group on cnn1d, no BN rule varied): group `shift` off batch at every B."""
    rows = []
    for norm, off in (("batch", 0.0), ("group", shift)):
        rows += [{**r, "norm": norm, "run_id": norm + r["run_id"], "val_acc": round(r["val_acc"] + off, 3)}
                 for r in _bn_grid("cnn1d", norm, False, measured=norm == "batch") if r["bn_momentum_rule"] == "default"]
    return rows


def _norm_line(shift: float) -> str:
    study = _study(_norms(shift), ("physical_batch", "accum_steps", "norm"))
    return next((s for s in summarize(study.trials, study.history, None, None, study.varied)
                 if s.startswith("The norms at each B")), "")


def test_a_study_of_the_norm_says_which_norm_did_better_at_each_b_or_that_none_was_shown_to():
    """Grouped by norm, the findings read each norm on its own and no line said which did better: batch 3 points
    above group at every B went unsaid. Equal runs are no win for either."""
    line = _norm_line(-0.03)
    for b in (32, 128, 512):
        assert f"at B = {b}, norm = batch did better (batch against group: 3.0 points higher, 95% CI" in line, line
    line = _norm_line(0.0)
    assert "did better (" not in line and line.count("no norm was shown to do better (batch and group had the same "
                                                    "mean; batch against group: equivalent within ±1 point") == 3, line
    noisy = [{**r, "val_acc": round(r["val_acc"] + (0.02 if r["seed"] == 1 else -0.01) * (r["norm"] == "group"), 3)}
             for r in _norms(-0.005)]
    study = _study(noisy, ("physical_batch", "accum_steps", "norm"))
    [line] = [s for s in summarize(study.trials, study.history, None, None, study.varied) if "norms at" in s]
    assert "did better (" not in line and "not resolved with 3 seeds" in line, line


def _norm_grid(cells: dict, varied: tuple[str, ...]) -> list[str]:
    """The norm sentence of a study of batch against group on cnn1d at b = 32 (k = 1, 4, 16) and the true batches
    128 and 512: `cells` maps (norm, LR rule, b, k) to the accuracy of seed 0 (seed s adds 0.002·s), None where the
    run diverged, "oom" where it ran out of memory."""
    rows = []
    for seed in (0, 1, 2):
        for (norm, rule, b, k), value in cells.items():
            done = isinstance(value, float)
            rows.append(dict(seed=seed, physical_batch=b, accum_steps=k, effective_batch=b * k, base_batch=32,
                             bn_momentum_rule="default", lr_rule=rule, model="cnn1d", norm=norm,
                             status="FINISHED" if done else "FAILED", reason=None if done else value or "diverged",
                             run_id=f"r{len(rows)}", peak_memory_bytes=1e3 * b,
                             val_acc=round(value + 0.002 * seed, 3) if done else None))
    study = _study(rows, varied)
    return [s for s in summarize(study.trials, study.history, None, None, study.varied) if "norms at each B" in s]


POINTS = ((32, 1), (32, 4), (128, 1), (32, 16), (512, 1))


def test_the_norms_are_compared_over_the_configurations_that_finished_under_both():
    """batch 2 points above group under both LR rules at every B; group's linear runs diverged at B = 512 alone.
    Every run counted read 'at B = 512, norm = group did better (group against batch: 2.0 points higher ... kept
    by Benjamini-Hochberg': batch's mean there held its linear runs (0.80), group's its sqrt runs alone (0.86)."""
    cells = {}
    for b, k in POINTS:
        cells.update({("batch", "sqrt", b, k): 0.88, ("batch", "linear", b, k): 0.80, ("group", "sqrt", b, k): 0.86,
                      ("group", "linear", b, k): None if b * k == 512 else 0.78})
    [line] = _norm_grid(cells, ("physical_batch", "accum_steps", "norm", "lr_rule"))
    assert "every run at a B counted" not in line and "norm = group did better" not in line, line
    for b in (32, 128, 512):
        assert f"at B = {b}, norm = batch did better (batch against group: 2.0 points higher, 95% CI" in line, line
    assert ("left out: b = 32, k = 16, linear, where group diverged in seeds 0, 1 and 2; b = 512, k = 1, linear, "
            "where group diverged in seeds 0, 1 and 2)") in line, line
    assert line.count("left out") == 1, line


def test_a_norm_whose_true_batch_ran_out_of_memory_is_compared_over_the_accumulated_runs_alone():
    """batch's true batch (b = 512) ran out of memory: batch at B = 512 was its accumulated runs (0.85) against
    group's over both kinds (0.875): 'group did better ... 2.5 points', where matched it is 2.0. Where no
    configuration is left, no verdict: 'not compared'."""
    cells = {}
    for b, k in POINTS:
        cells.update({("batch", "sqrt", b, k): "oom" if b == 512 else 0.85 if k > 1 else 0.90,
                      ("group", "sqrt", b, k): 0.87 if k > 1 else 0.88})
    [line] = _norm_grid(cells, ("physical_batch", "accum_steps", "norm"))
    assert ("at B = 512, norm = group did better (group against batch: 2.0 points higher, 95% CI +1.8 to +2.2 over "
            "3 seeds") in line, line
    assert "left out: b = 512, k = 1, where batch ran out of memory in seeds 0, 1 and 2)" in line, line
    del cells[("batch", "sqrt", 32, 16)], cells[("group", "sqrt", 32, 16)]
    [line] = _norm_grid(cells, ("physical_batch", "accum_steps", "norm"))
    assert line.endswith("; at B = 512, not compared: no configuration finished under both norms in one seed "
                         "(b = 512, k = 1, where batch ran out of memory in seeds 0, 1 and 2)."), line


def _bn_beside_group() -> list[dict]:
    """batch under three BN rules at k = 4 (one at k = 1), group (no BatchNorm: no bn_mean_error) under the default
    alone; batch's scaled run at k = 4 diverged in seed 0, its default and matched finished there."""
    rows = []
    for seed in (0, 1, 2):
        for b, k in ((32, 1), (32, 4), (128, 1)):
            for norm in ("batch", "group"):
                for rule in RULES if norm == "batch" and k > 1 else ("default",):
                    failed = norm == "batch" and rule == "scaled" and k == 4 and seed == 0
                    value = 0.88 if norm == "batch" else 0.86
                    rows.append(dict(seed=seed, physical_batch=b, accum_steps=k, effective_batch=b * k, base_batch=32,
                                     bn_momentum_rule=rule, lr_rule="sqrt", model="cnn1d", norm=norm,
                                     status="FAILED" if failed else "FINISHED", reason="diverged" if failed else None,
                                     run_id=f"r{len(rows)}", val_acc=None if failed else value + 0.002 * seed,
                                     bn_mean_error=0.01 if norm == "batch" and not failed else None))
    return rows


def _norm_sentence(rows: list[dict], varied: tuple[str, ...]) -> str:
    study = _study(rows, varied)
    [line] = [s for s in summarize(study.trials, study.history, None, None, study.varied) if "norms at each B" in s]
    return line


def test_a_configuration_left_out_names_the_run_of_the_norm_that_did_not_finish():
    """The BN rule is no field of the configuration beside group (no BatchNorm), so batch's default, scaled and
    matched runs share a cell: it read 'left out: b = 32, k = 4, where batch diverged in seed 0', where batch's
    default and matched finished there. A run repeated in its cell, failed once and finished once, read the same."""
    rows = _bn_beside_group()
    line = _norm_sentence(rows, ("physical_batch", "accum_steps", "norm", "bn_momentum_rule"))
    assert "left out: b = 32, k = 4, where batch (BN scaled) diverged in seed 0)" in line, line
    repeated = [r for r in rows if r["status"] == "FINISHED"]
    [again] = [r for r in repeated if r["norm"] == "group" and r["effective_batch"] == 32 and r["seed"] == 2]
    repeated.append(dict(again, run_id="again", status="FAILED", reason="oom", val_acc=None))
    line = _norm_sentence(repeated, ("physical_batch", "accum_steps", "norm"))
    assert "left out: b = 32, k = 1, where one of group's 2 runs ran out of memory in seed 2)" in line, line
    # scaled's run repeated, both diverged: one label, counted ('batch (BN scaled and BN scaled)' before)
    [twice] = [r for r in rows if r["status"] == "FAILED"]
    line = _norm_sentence([*rows, dict(twice, run_id="twice")], ("physical_batch", "accum_steps", "norm",
                                                                  "bn_momentum_rule"))
    assert "left out: b = 32, k = 4, where batch (BN scaled ×2) diverged in seed 0)" in line, line


def test_norms_that_share_a_configuration_at_a_b_are_compared_there_though_no_value_ran_under_every_norm():
    """batch and group shared sqrt at B = 128, batch and layer linear at B = 512; group never ran linear, layer never
    sqrt: it read 'not compared: no value of lr_rule ran under every norm (batch, group and layer), so they share no
    configuration', where batch is 4 points above group at B = 128 and 6 above layer at B = 512."""
    rows = []
    for seed in range(5):
        for (norm, rule, k), value in {("batch", "sqrt", 4): 0.88, ("group", "sqrt", 4): 0.84,
                                       ("batch", "linear", 16): 0.86, ("layer", "linear", 16): 0.80,
                                       ("batch", "sqrt", 1): 0.88, ("group", "sqrt", 1): 0.85,
                                       ("layer", "linear", 1): 0.83, ("batch", "linear", 1): 0.88}.items():
            rows.append(dict(seed=seed, physical_batch=32, accum_steps=k, effective_batch=32 * k, base_batch=32,
                             bn_momentum_rule="default", lr_rule=rule, model="cnn1d", norm=norm, status="FINISHED",
                             reason=None, run_id=f"r{len(rows)}", val_acc=round(value + 0.002 * seed, 3)))
    line = _norm_sentence(rows, ("physical_batch", "accum_steps", "norm", "lr_rule"))
    assert "at B = 128, norm = batch did better (batch against group: 4.0 points higher" in line, line
    assert "at B = 512, norm = batch did better (batch against layer: 6.0 points higher" in line, line
    # Three norms at every B, layer under linear alone: no configuration ran under all three at one B.
    at_32 = [r for r in rows if r["effective_batch"] == 32]  # (batch under both rules, group sqrt, layer linear)
    at_128 = [dict(r, physical_batch=128, accum_steps=1, effective_batch=128, run_id=r["run_id"] + "+")
              for r in at_32 if r["norm"] != "batch" or r["lr_rule"] == "sqrt"]
    rows = at_32 + at_128
    line = _norm_sentence(rows, ("physical_batch", "accum_steps", "norm", "lr_rule"))
    assert line == ("The norms at each B are not compared: at no B did one value of lr_rule run under every norm "
                    "that ran there (batch, group and layer in all), so no configuration ran under every norm at "
                    "one B."), line


def _lr_rows(lrs: list[float]) -> list[dict]:
    """batch (0.88) and group (0.86) at b = 32, k = 1 and 4, one run per base_lr of `lrs` in turn (seed i % 3)."""
    rows = []
    for i, lr in enumerate(lrs):
        k, norm = (1, 4)[i // 2 % 2], ("batch", "group")[i % 2]
        rows.append(dict(seed=i % 3, physical_batch=32, accum_steps=k, effective_batch=32 * k, base_batch=32,
                         bn_momentum_rule="default", lr_rule="sqrt", base_lr=lr, model="cnn1d", norm=norm,
                         status="FINISHED", reason=None, run_id=f"r{i}", val_acc=0.88 - 0.02 * (norm == "group")))
    return rows


def test_a_sampled_field_that_leaves_the_norms_no_configuration_in_common_is_said_once():
    """base_lr sampled, each trial its own value: at each B it read 'not compared: no configuration finished under
    both norms in one seed (k = 1, base_lr = 0.00346, where batch did not run in seed 0; …)', a clause per trial."""
    varied = ("physical_batch", "accum_steps", "norm", "base_lr")
    lrs = [round(1e-3 * 1.1 ** i, 6) for i in range(40)]
    line = _norm_sentence(_lr_rows(lrs), varied)
    assert line == ("The norms at each B are not compared: base_lr took a value of its own in each of the 40 trials, "
                    "and no value of it ran under both batch and group at one B, so no configuration ran under "
                    "both."), line
    line = _norm_sentence(_lr_rows(lrs + lrs[:2]), varied)  # (each run twice under its own norm)
    assert line.startswith("The norms at each B are not compared: base_lr took 40 values over 42 trials, and no "), line


def test_a_left_out_list_names_five_configurations_and_counts_the_rest():
    """Every configuration of a long grid of base_lr left out at B = 128 (group diverged there) was named."""
    rows = []
    for seed in (0, 1, 2):
        for k in (1, 4):
            for lr in [0.01 * (i + 1) for i in range(8)]:
                for norm in ("batch", "group"):
                    failed = norm == "group" and k == 4 and lr > 0.015
                    rows.append(dict(seed=seed, physical_batch=32, accum_steps=k, effective_batch=32 * k,
                                     base_batch=32, bn_momentum_rule="default", lr_rule="sqrt", base_lr=lr,
                                     model="cnn1d", norm=norm, status="FAILED" if failed else "FINISHED",
                                     reason="diverged" if failed else None, run_id=f"r{len(rows)}",
                                     val_acc=None if failed else 0.88 - 0.02 * (norm == "group") + 0.002 * seed))
    line = _norm_sentence(rows, ("physical_batch", "accum_steps", "norm", "base_lr"))
    assert ("left out: k = 4, base_lr = 0.02, where group diverged in seeds 0, 1 and 2; k = 4, base_lr = 0.03, "
            "where") in line, line
    assert "base_lr = 0.06, where group diverged in seeds 0, 1 and 2; and 2 more configurations)" in line, line
    assert "base_lr = 0.07" not in line, line
