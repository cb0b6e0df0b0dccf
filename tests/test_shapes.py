"""Models and data as they are: mapping samples batched by the dataset's own collate function, a model called
with keyword arguments whose output carries `.logits`, a (sum, count) loss with nothing more, a test set read
through a loader, metrics of the user's own, and transformers models built from a config."""
import importlib.util
from dataclasses import replace

import pytest
import torch

from batchsweep.trainers import TrainConfig, train
from batchsweep.trainers.loop import prepare
from batchsweep.trainers.probes import Probe

from .test_workloads import rel_diff

SHAPED = dict(model="tests.factories:keyword_lm", dataset="tests.factories:hf_shaped",
              loss="tests.factories:shifted_ce", dtype="float64", optimizer="adamw", base_lr=3e-3,
              physical_batch=4, accum_steps=4, epochs=2)


class Widths(Probe):
    """The padded length of every training micro-batch."""

    def start(self, run):
        super().start(run)
        self.seen = []

    def after_micro(self, micro):
        self.seen.append(micro.x["input_ids"].shape[1])


def test_a_transformers_shaped_workload_is_exact_with_the_loss_own_count():
    # 50 sequences at B = 16 (three full windows and one of 2), padded per micro-batch to its longest: each
    # micro-batch counts its own tokens, and the loss says how many only after its forward.
    widths = Widths()
    a = train(TrainConfig(**SHAPED), probes=[widths])
    t = train(replace(TrainConfig(**SHAPED), physical_batch=16, accum_steps=1))
    assert len(set(widths.seen)) > 3  # micro-batches of their own lengths
    assert a.history[-1]["steps"] == t.history[-1]["steps"] == 2 * 4
    assert rel_diff(a.model, t.model) <= 1e-12
    assert a.metrics["train_loss"] == pytest.approx(t.metrics["train_loss"], rel=1e-12)
    # Token accuracy and top-5 over the shifted labels (vocabulary 20), read from `.logits`.
    assert 0 < a.metrics["val_acc"] <= a.metrics["val_top5"] <= 1
    assert a.metrics["val_acc"] == pytest.approx(t.metrics["val_acc"], abs=1e-12)
    from tests.factories import hf_shaped, pad

    _, test, _ = hf_shaped()
    batch = pad([test[i] for i in range(len(test))])
    with torch.no_grad():
        logits = a.model.eval()(batch["input_ids"], batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    counted = targets != -100
    by_hand = int(((logits[:, :-1].argmax(-1) == targets) & counted).sum()) / int(counted.sum())
    assert a.metrics["val_acc"] == pytest.approx(by_hand, abs=1e-12)  # scored after the shift
    assert any("noise scale is not measured with a loss without counts" in w for w in a.warnings)


def test_dividing_after_is_the_same_training_as_counting_first():
    # The same loss with counts(target) given divides each micro-batch as it comes: to rounding, the same.
    from tests import factories

    factories.shifted_ce_counted = lambda output, labels: factories.shifted_ce(output, labels)
    factories.shifted_ce_counted.counts = lambda labels: (labels[:, 1:] != -100).sum()
    after = train(TrainConfig(**SHAPED))
    first = train(TrainConfig(**{**SHAPED, "loss": "tests.factories:shifted_ce_counted"}))
    assert 0 < rel_diff(after.model, first.model) <= 1e-12 or rel_diff(after.model, first.model) == 0
    assert after.metrics["train_loss"] == pytest.approx(first.metrics["train_loss"], rel=1e-12)


def test_mapping_micro_batches_shrink_on_out_of_memory():
    # Above 4 sequences a micro-batch runs out of memory: from b = 16 it shrinks to 4, each padded micro-batch
    # cut on its own, and ends where (4, 4) from the start ends.
    config = TrainConfig(**{**SHAPED, "model": "tests.factories:keyword_lm_fits_4"})
    auto = train(replace(config, physical_batch=16, accum_steps=1, shrink_on_oom=True))
    direct = train(config)
    assert (auto.metrics["physical_batch_used"], auto.metrics["oom_retries"]) == (4, 2)
    assert rel_diff(auto.model, direct.model) <= 1e-12


def test_a_test_set_read_through_a_loader_gives_the_in_memory_metrics(data_dir):
    # 500 training samples and 1,000 test samples, evaluated in batches of 128 by indexing or through a loader.
    base = TrainConfig(model="mlp", dataset="tests.factories:big_test_in_memory", data_dir=data_dir, epochs=2,
                       eval_batch=128, metrics="tests.factories:margin")
    loader = replace(base, dataset="tests.factories:big_test_loader")
    assert prepare(loader).data.x_test is None  # never held: only its labels are
    a, b = train(base), train(loader)
    assert a.dataset["test_size"] == b.dataset["test_size"] == 1000
    for row_a, row_b in zip(a.history, b.history):
        for name in ("val_loss", "val_acc", "val_top5", "val_margin"):
            assert row_a[name] == pytest.approx(row_b[name], rel=1e-12), name
    assert a.metrics["val_top5"] >= a.metrics["val_acc"] > 0.2
    assert a.history[0]["val_margin"] != a.history[1]["val_margin"]


def test_a_gpt2_from_transformers_built_from_a_config_is_exact():
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    config = TrainConfig(model="hf:gpt2-tiny", dataset="pytext_hf", dtype="float64", optimizer="adamw",
                         base_lr=1e-3, physical_batch=4, accum_steps=4, epochs=1, max_steps=3, eval_batch=256)
    model = prepare(config).model
    assert type(model).__name__ == "GPT2LMHeadModel" and model.config.vocab_size == 256
    a, t = train(config), train(replace(config, physical_batch=16, accum_steps=1))
    assert a.metrics["steps"] == 3
    assert rel_diff(a.model, t.model) <= 1e-12
    assert a.metrics["train_loss"] == pytest.approx(t.metrics["train_loss"], rel=1e-12)
    assert 0 < a.metrics["val_acc"] < 1 and a.metrics["val_perplexity"] > 1


def test_the_token_loss_counts_only_the_labels_that_count():
    # Padded to 64, pytext's sequences hold 8 to 64 tokens: the loss is the mean over those, not over the
    # padded positions, in training and in evaluation alike.
    from batchsweep.trainers.losses import builtin

    logits = torch.zeros(2, 5, 7)  # uniform: every counted token costs ln 7
    target = torch.tensor([[1, 2, -100, -100, -100], [3, 4, 5, -100, -100]])
    total, count = builtin(logits, target)
    assert int(count) == 5 and float(total) / int(count) == pytest.approx(torch.log(torch.tensor(7.0)).item())


def test_a_metric_of_your_own_is_a_study_objective(tmp_path):
    # A study of the transformers-shaped workload whose objective is the user's metric; a misspelt one is
    # refused before anything runs, and without [fixed] metrics a val_ name is not taken on trust.
    import optuna
    from mlflow import MlflowClient

    from .test_sweeps import sweep

    study = """name = "own_metric"
[fixed]
model = "tests.factories:keyword_lm"
dataset = "tests.factories:hf_shaped"
loss = "tests.factories:shifted_ce"
metrics = "tests.factories:token_margin"
epochs = 3
optimizer = "adamw"
base_lr = 0.003
[grid]
physical_batch = [4]
accum_steps = [1, 4]
[objective]
metrics = ["val_token_margin"]
"""
    (tmp_path / "study.toml").write_text(study)
    proc = sweep(tmp_path, "--study", "study.toml", "--no-report", "--log-models", "none")
    assert proc.returncode == 0, proc.stderr
    trials = optuna.load_study(study_name="own_metric", storage=f"sqlite:///{tmp_path}/mlruns/optuna.db").trials
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    for trial in trials:
        history = client.get_metric_history(trial.user_attrs["mlflow_run_id"], "val_token_margin")
        assert [m.step for m in history] == [1, 2, 3] and history[-1].value == pytest.approx(trial.value)
    (tmp_path / "bad.toml").write_text(study.replace('"val_token_margin"', '"val_token_margn"').replace(
        'metrics = "tests.factories:token_margin"\n', ""))
    proc = sweep(tmp_path, "--study", "bad.toml", "--no-report")
    assert proc.returncode == 2 and "'val_token_margn' is not a metric its trials log" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("changes,message", [
    # (without the hf extra, which README's install leaves out, the missing package is the one line)
    ({"model": "hf:gpt5-huge"}, r"model 'hf:gpt5-huge': 'gpt5-huge' is neither a named config \(gpt2-tiny, "
                                r"llama-tiny\) nor a config.json or a folder holding one"
     if importlib.util.find_spec("transformers") else
     r"model 'hf:gpt5-huge' needs the transformers package: pip install -e '\.\[hf\]'$"),
    ({"metrics": "margin"}, r"metrics 'margin' is not an import path: give package.module:fn"),
    ({"label_key": "target"}, r"a sample is a mapping without the label key 'target' \(it has input_ids, "
                              r"attention_mask, labels\): set label_key to the entry that holds the target"),
    ({"metrics": "tests.factories:clashing"}, r"metric clashing returns 'acc', a name batchsweep logs itself: "
                                              r"rename it"),
    ({"loss": "tests.factories:shifted_ce_at"}, r"loss tests.factories:shifted_ce_at names a term 'ce@1', a name "
                                                r"MLflow cannot log: use letters, digits, spaces and _ - \. : "
                                                r"\(at most 200\)$"),
    ({"metrics": "tests.factories:recall_at"}, r"metric recall_at returns 'recall@5', a name MLflow cannot log: "
                                               r"use letters, digits, spaces and _ - \. : \(at most 200\)$"),
    ({"dataset": "tests.factories:four_parts"}, r"dataset factory 'tests.factories:four_parts' must return "
                                                r"\(train, test\) Datasets, or \(train, test, collate_fn\)"),
])
def test_models_and_data_that_do_not_fit_are_one_line(changes, message):
    from batchsweep.trainers import ConfigError

    with pytest.raises(ConfigError, match=message):
        train(TrainConfig(**{**SHAPED, "epochs": 1, **changes}))
