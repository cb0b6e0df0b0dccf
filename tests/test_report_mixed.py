"""A study that mixes a model without BatchNorm with one that has it: the views of the search and the memory and
throughput figures count the runs of the model without under its BN momentum rules once, as the findings do; and a
study that varies the norm says which norm did better at each B, or that its seeds cannot tell."""
import math

from batchsweep.analysis.figures import candidates
from batchsweep.analysis.findings import one_bn_rule
from batchsweep.analysis.space import importance, memory_front, parallel_coordinates
from tests.test_recommend_edges import _study
from tests.test_report_no_batchnorm import NOTE, VARIED

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
    said = "mlp has no BatchNorm, so its runs under the BN momentum rules count as one configuration"
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
