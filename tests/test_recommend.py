"""The recommendation at the top of a report (issue 95): made from the findings' own comparisons, saying how sure
each pick is, what to run where it cannot pick, and each study's report holding the sections its design
supports."""
import re

import numpy as np
import pandas as pd
import pytest

from batchsweep.analysis.findings import summarize
from batchsweep.analysis.recommend import recommend
from batchsweep.analysis.render import _table
from batchsweep.analysis.runs import StudyRuns
from batchsweep.analysis.space import importance, memory_front, parallel_coordinates
from batchsweep.sweeps.study.files import BUILTIN, read_file
from tests.test_report_findings import default_study

VARIED = ("physical_batch", "accum_steps", "lr_rule")


def accum_lr(seeds=(0, 1, 2)) -> StudyRuns:
    trials, history = default_study()
    trials = trials[trials.seed.isin(seeds)].assign(base_batch=32, memory_source="saved_tensors",
                                                    peak_memory_bytes=lambda t: t.physical_batch * 16e3 + 5e5)
    return StudyRuns("accum_lr", trials, history, None, "", varied=VARIED, run_as="--study accum_lr")


def test_each_pick_at_a_b_is_the_findings_own_comparison():
    """Per B: the rule of the best mean there with its ties, and its cost against B = 32 worded exactly as the
    findings word that rule's comparison (the same family of 12, the same interval), never a second computation."""
    study = accum_lr()
    lines = recommend(study)
    findings = summarize(study.trials, study.history)
    per_b = [line for line in lines if line.startswith("At B = ")]
    assert [line.split(":")[0] for line in per_b] == ["At B = 64", "At B = 128", "At B = 256", "At B = 512"]
    for line in per_b:
        rule = line.split("the ")[1].split(" LR rule")[0]
        b = line.split(":")[0].removeprefix("At B = ")
        cost = line.split("against B = 32: ")[1].split("; accumulating")[0]
        said = next(s for s in findings if s.startswith(f"The {rule} LR rule against B = 32"))
        assert f"at B = {b} " in said and cost.removesuffix(".") in said, (line, said)
        assert f"accumulating under the {rule} LR rule (b = 32, k = " in line  # (the picked rule's twins, named)
        # (a b is advised, with the planner, only where the twins were shown equivalent or resolved apart)
        assert ("plan --target-batch" in line) == ("; b: the largest that fits" in line or "; they differ" in line)
    # At B = 512 the findings name the best rule and its ties; so does the pick.
    at_512 = next(s for s in findings if s.startswith("At the largest batch"))
    best = re.search(r"the (\w+) rule had the highest mean", at_512)[1]
    assert per_b[-1].startswith(f"At B = 512: the {best} LR rule")
    # Nothing is called free that the findings do not show equivalent; the best is named with its ties.
    free = next(line for line in lines if "shown to cost less than 1 point" in line)
    found = re.match(r"The largest B shown to cost less than 1 point together with every B below it: "
                     r"B = (\d+) under the (\w+) LR rule, "
                     r"(equivalent .*?\)|[\d.]+ points (higher|lower), 95% CI .*?equivalence margin) ", free)
    if found:  # (this table: linear at B = 64, 0.6 points lower, 95% CI -0.9 to -0.2, inside the margin)
        said = next(s for s in findings if s.startswith(f"The {found[2]} LR rule against B = 32"))
        assert f"equivalent within ±1 point at B = {found[1]} " in said or f"at B = {found[1]} {found[3]}" in said
    else:
        assert free.startswith("No B above the smallest") and "equivalent within ±1 point at B" not in " ".join(findings)
    best_line = next(line for line in lines if line.startswith("The best accuracy: "))
    assert "cannot be told from it" in best_line and "biased upward" in best_line


def test_a_one_seed_study_says_what_to_run():
    [line] = recommend(accum_lr(seeds=(0,)))
    assert "With one seed no configuration can be told from another" in line
    assert "--study accum_lr --seeds 3`" in line and ("python sweeps/run.py" in line or "batchsweep run" in line)
    study = accum_lr(seeds=(0,))
    study.run_as = "--study my/study.toml --study-name mine"
    assert "--study my/study.toml --study-name mine --seeds 3`" in recommend(study)[0]


def test_a_program_studys_block_speaks_of_its_own_objective():
    """A [program] study of its own metric (val_f1, maximize), b crossed with the LR over 3 seeds: the best and its
    ties in val_f1; no LR-rule lines, as it has no rules."""
    rng = np.random.default_rng(0)
    rows = [{"physical_batch": b, "accum_steps": 1, "effective_batch": b, "lr": lr, "seed": s, "status": "FINISHED",
             "val_f1": 0.8 + (0.05 if lr == 0.01 else 0) + rng.normal(0, 0.002), "batchsweep.program": "train.py"}
            for b in (16, 32) for lr in (0.01, 0.1) for s in range(3)]
    study = StudyRuns("script", pd.DataFrame(rows), pd.DataFrame(), None, "", varied=("physical_batch", "lr"),
                      objectives=(("val_f1", "maximize"),))
    lines = recommend(study)
    assert len(lines) == 1 and lines[0].startswith("The best val_f1 (higher is better): ")
    assert "lr = 0.01" in lines[0] and "biased upward" in lines[0]
    assert "cannot be told from it (b = " in lines[0] or "resolved worse than it" in lines[0]


# What each built-in study's report shows of the generic sections, and whether it recommends per B. critical_batch
# and batch_warmup vary branch lengths and B together (one grid axis): no importance, no "best overall", no ★;
# equivalence's model and dataset are one axis, leaving k alone (one field: nothing to rank by importance; no
# Pareto front or best, where a k named without its model would average three models' runs);
# accum_lr's b and k move with B, so importance reads effective_batch and the rule.
SECTIONS = {
    "accum_lr": ({"importance", "parallel_coordinates", "memory_front"}, True),
    "adam_lr": ({"importance", "parallel_coordinates", "memory_front"}, True),
    "bn_momentum": (set(), False),  # its BN rules run only where k > 1: its own sections compare them
    "batch_memory": ({"importance", "parallel_coordinates", "memory_front"}, False),
    "lr_search": ({"importance", "parallel_coordinates", "memory_front"}, False),
    "equivalence": ({"parallel_coordinates"}, False),
    "critical_batch": (set(), False),
    "batch_warmup": (set(), False),
}


def built_in(name: str) -> StudyRuns:
    """The study's own points over its seeds (3 where it runs one), each trial a made-up accuracy and memory."""
    study = read_file(BUILTIN / f"{name}.toml")
    rng = np.random.default_rng(1)
    rows = []
    for point in study.points * study.trials_per_unit:
        row = {**study.fixed, **point}
        for field, param in study.tune.items():  # (a searched field: a value of its own in each trial)
            row[field] = float(rng.uniform(param.low, param.high))
        b, k = row.get("physical_batch", 32), row.get("accum_steps", 1)
        for seed in range(max(study.seeds, 3)):
            rows.append({**row, "seed": seed, "effective_batch": b * k, "status": "FINISHED",
                         "base_batch": row.get("base_batch", 32), "val_acc": 0.9 - 0.01 * np.log2(b * k)
                         + rng.normal(0, 0.003), "param_rel_diff": abs(rng.normal(1e-6, 1e-7)),
                         "peak_memory_bytes": 5e5 + 1.6e4 * b})
    trials = pd.DataFrame(rows)
    trials["batch"] = np.where(trials["accum_steps"] > 1, "accumulated", "true batch")
    return StudyRuns(name, trials, pd.DataFrame(), None, "", varied=study.varied,
                     objectives=tuple(zip(study.metrics, study.directions)), run_as=f"--study {name}")


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_each_built_in_study_shows_the_sections_its_design_supports(name):
    study = built_in(name)
    drawn = {fig.name for make in (importance, parallel_coordinates, memory_front) if (fig := make(study))}
    sections, per_b = SECTIONS[name]
    assert drawn == sections, drawn
    lines = recommend(study)
    assert any(line.startswith("At B = ") for line in lines) == per_b, lines
    if name == "lr_search":  # a search of the LR per B answers with the best LR against B and its exponent
        assert lines[0].startswith("The learning rate to use at each B: the best learning rate went from "), lines
    if not sections:  # no best overall anywhere: not in the block, not as a mark in the table
        assert not any(line.startswith("The best ") for line in lines) and "best or not told apart" not in _table(study)
    if name in ("critical_batch", "batch_warmup"):
        assert lines == ["Nothing here is a choice to recommend: the study varies no field as an independent choice "
                         "(its findings below answer its own question)."]


def test_a_batchnorm_study_names_the_momentum_rules_shown_to_match_the_true_batch():
    """bn_momentum's question: at each k, which BN rule gives the true batch's accuracy. A rule within 0.1 point
    of it in every seed is shown to match it (equivalent within ±1 point); one 3 points below is placed as resolved
    worse."""
    rows = []
    for seed, base in enumerate((0.950, 0.955, 0.948)):
        rows += [{"physical_batch": 128, "accum_steps": 1, "bn_momentum_rule": "default", "val_acc": base},
                 {"physical_batch": 32, "accum_steps": 4, "bn_momentum_rule": "default", "val_acc": base - 0.03},
                 {"physical_batch": 32, "accum_steps": 4, "bn_momentum_rule": "scaled", "val_acc": base - 0.001 * seed}]
        rows[-3:] = [{**r, "seed": seed, "status": "FINISHED", "effective_batch": r["physical_batch"] * r["accum_steps"]}
                     for r in rows[-3:]]
    trials = pd.DataFrame(rows)
    trials["batch"] = np.where(trials["accum_steps"] > 1, "accumulated", "true batch")
    study = StudyRuns("bn", trials, pd.DataFrame(), None, "", varied=VARIED[:2] + ("bn_momentum_rule",))
    [line] = [line for line in recommend(study) if line.startswith("BN momentum")]
    assert line.startswith("BN momentum at k = 4 (B = 128), against the true batch's final accuracy: scaled shown to "
                           "match it (scaled equivalent within ±1 point (-0.1 ± ")
    assert "; default resolved worse than it (default 3.0 points below" in line, line


def test_the_runs_note_keeps_whole_lines_within_mlflows_limit():
    """The recommendation made the default study's note 10,084 characters, which MLflow cut at 8,000 with a warning
    on the terminal: the note keeps whole lines, says how many more the report has, and ends with where it is."""
    from pathlib import Path

    from batchsweep.analysis.cli import NOTE_LIMIT, note

    text = note("accum_lr", [f"Use: line {i} " + "x" * 400 for i in range(25)], Path("/r/report.html"))
    assert len(text) <= NOTE_LIMIT and "more in the report)" in text
    assert text.endswith("Report: /r/report.html (and report/report.html in this run's artifacts).")
    assert note("s", ["one"], Path("r")) == ("Findings of study s:\n\n- one\n\nReport: r (and report/report.html in this "
                                            "run's artifacts).")
