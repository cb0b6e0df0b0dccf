"""Steps to the target per BN momentum rule (targets.py): at k = 1 every rule is the default momentum, which the
grid runs under default alone, so those runs (B = 32 and the true-batch twins) count in every rule's series."""
import pandas as pd

from batchsweep.analysis.figures import steps_vs_batch
from batchsweep.analysis.targets import steps
from tests.test_report_no_batchnorm import _bn_grid, _history
from tests.test_report_zipped import _zipped


def _lines(rows: list[dict]) -> dict[str, str]:
    said = steps(pd.DataFrame(rows), _history(rows))
    return {s.split(" ")[1].strip(","): s for s in said if s.startswith("For ")}


def test_the_runs_at_k_1_count_in_every_bn_rule_s_series():
    """bn_momentum: 'For scaled (...), only B = 128 reached it; B_crit could not be fitted', where B = 32 and the
    true batches at 128 and 512 (under default) are scaled's runs at k = 1 as much as default's."""
    lines = _lines(_bn_grid("cnn1d", "batch", False, measured=True))
    assert set(lines) == {"default", "scaled", "matched"}, lines
    for rule, line in lines.items():
        assert "from 15 runs at B = 32 to 512" in line, line


def test_a_bn_rule_zipped_with_the_weight_decay_counts_the_runs_at_k_1_at_its_own():
    """Each rule with its own weight decay, every k = 1 run labelled default and no varied fields known: each
    rule's series holds the k = 1 runs at its weight decay alone (3 at B = 32), not every one's (9)."""
    lines = _lines([{**r, "val_acc": r["val_acc"] + 0.1 * (r["weight_decay"] > 0)} for r in _zipped()])
    assert set(lines) == {"default", "scaled", "matched"}, lines
    for rule, line in lines.items():
        assert "from 15 runs at B = 32 to 512" in line, line


def test_the_steps_figure_draws_every_bn_rule_from_b_32():
    """The figure drew scaled and matched from B = 128 (their k = 1 runs given to default alone)."""
    rows = _bn_grid("cnn1d", "batch", False, measured=True)
    figure = steps_vs_batch(pd.DataFrame(rows), _history(rows))
    drawn = {line.get_label(): list(line.get_xdata()) for line in figure.figure.axes[0].get_lines()}
    for rule in ("default", "scaled", "matched"):
        assert drawn[rule] == [32, 128, 512], drawn
