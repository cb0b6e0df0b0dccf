"""A study's trained models: one checkpoint folder per configuration, so that a killed trial resumes when its
point runs again (on any machine that shares the folder), and at the end of an invocation its best trials'
models in MLflow, from their last checkpoints."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import optuna
import torch
from optuna.trial import TrialState

from trainers import CHECKPOINT_FILE as FILE
from trainers import HOW_NOT_WHAT, TrainConfig, prepare

from .outcomes import OUTCOMES, outcome_of

RUN_ID_FILE = "mlflow_run_id"  # the run of the trial that last trained in the folder


def folder_of(inv, config: TrainConfig, trial_number: int) -> Path:
    """A trial's checkpoint folder, named by a digest of what it computes (not of how this machine reads its
    data), never by text a user gave beyond the checked study name. A grid point's folder is the same in every
    invocation, so that a killed trial resumes; a sampler's trial has its own (a sampler draws new values
    rather than repeat a killed trial's)."""
    what = {k: v for k, v in dataclasses.asdict(config).items() if k not in HOW_NOT_WHAT}
    if inv.study.sampler != "grid":
        what["optuna_trial"] = trial_number
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]
    return Path(inv.checkpoint_dir) / inv.study_name / digest


def resumes(folder: Path) -> str | None:
    """The MLflow run of the killed trial whose checkpoint this trial goes on from, or None."""
    link = folder / RUN_ID_FILE
    if (folder / FILE).exists() and link.exists():
        return link.read_text().strip() or None
    return None


def claim(folder: Path, run_id: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RUN_ID_FILE).write_text(run_id)


def chosen(trials: list[optuna.trial.FrozenTrial], directions: tuple[str, ...], policy: str) -> list:
    """The trials whose models are kept: all, the best by the single objective, or the Pareto front."""
    if policy != "best" or not trials:
        return trials if policy == "all" else []
    signs = [1.0 if d == "maximize" else -1.0 for d in directions]
    score = [[s * v for s, v in zip(signs, t.values)] for t in trials]
    if len(directions) == 1:
        return [max(zip(score, trials), key=lambda pair: pair[0][0])[1]]

    def dominated(a: list[float]) -> bool:
        return any(all(x >= y for x, y in zip(b, a)) and b != a for b in score)

    return [t for s, t in zip(score, trials) if not dominated(s)]


def mlflow_pytorch():
    """mlflow.pytorch, without the Lightning it imports, where Lightning is installed, for a checkpoint callback
    that batchsweep never uses (seconds at the end of every study). A Lightning that this process imported
    already (a trial run in it) is left as it is."""
    blocked = "mlflow.pytorch" not in sys.modules and "pytorch_lightning" not in sys.modules
    if blocked:
        sys.modules["pytorch_lightning"] = None  # the ImportError that mlflow.pytorch takes for "not installed"
    try:
        return importlib.import_module("mlflow.pytorch")
    finally:
        if blocked:
            del sys.modules["pytorch_lightning"]


def log_model(tracker, run_id: str, config: TrainConfig, folder: Path) -> str:
    """The model of a trial's last checkpoint into its run's artifacts, under `model/`: MLflow's PyTorch
    flavour (torch.export's format, with a signature and an input example), or where the model does not export,
    its state dict and the factory that builds it. Returns which of the two."""
    from mlflow.models import infer_signature

    prepared = prepare(dataclasses.replace(config, device="cpu"))
    model = prepared.model.eval()
    model.load_state_dict(torch.load(folder / FILE, map_location="cpu", weights_only=True)["model"])
    example = prepared.data.example(2)
    with tempfile.TemporaryDirectory() as scratch:
        target = Path(scratch) / "model"
        try:
            if not isinstance(example, torch.Tensor):  # keyword inputs: the flavour's signature takes one array
                raise TypeError("keyword inputs")
            with torch.no_grad():
                output = model(example)
            mlflow_pytorch().save_model(model, str(target), input_example=example.numpy(),
                                        signature=infer_signature(example.numpy(), output.numpy()),
                                        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"])
            kind = "pytorch"
        except Exception:  # e.g. a model that torch.export cannot trace: the weights and how to build them
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            torch.save(model.state_dict(), target / "state_dict.pt")
            (target / "model.json").write_text(json.dumps({
                "model": config.model, "build": "trainers.loop.prepare(TrainConfig(**config)).model, then "
                "load_state_dict(torch.load('state_dict.pt'))", "config": dataclasses.asdict(config)}, indent=2))
            kind = "state_dict"
        tracker.log_artifacts(run_id, str(target), "model")
    return kind


def _config_of(inv, trial) -> TrainConfig:
    values = dict(trial.user_attrs["config"])
    return inv.config(values, values.pop("seed"))


def _folder(inv, trial) -> Path:
    return folder_of(inv, _config_of(inv, trial), trial.number)


def _trials(inv, storage) -> list[optuna.trial.FrozenTrial]:
    """Every trial of the study that chose a point (a trial that yielded its point to another one chose none)."""
    return [t for name in inv.study_names() for t in optuna.load_study(study_name=name, storage=storage)
            .get_trials(deepcopy=False) if "config" in t.user_attrs and outcome_of(t) != OUTCOMES["duplicate"]]


def _ended(inv, trials: list) -> list[optuna.trial.FrozenTrial]:
    """The trials whose point will not run again: complete or pruned, and failed ones of a sampler's search
    (it draws new values rather than repeat them); a failed or killed grid point resumes from its checkpoint."""
    states = [TrialState.COMPLETE, TrialState.PRUNED] + ([TrialState.FAIL] if inv.study.sampler != "grid" else [])
    return [t for t in trials if t.state in states]


def _candidates(inv, ended: list, invocation: str) -> list:
    """An invocation's complete trials whose models may still be logged at its end."""
    mine = [t for t in ended if t.state == TrialState.COMPLETE and t.user_attrs.get("invocation") == invocation]
    return chosen(mine, inv.study.directions, inv.log_models)


def _needed(inv, trials: list, invocations: set[str]) -> set[Path]:
    """The folders that must stay: those of running trials (a point claimed twice shares one), and of the models
    that `invocations` may still log."""
    ended = _ended(inv, trials)
    keep = [t for t in trials if t.state == TrialState.RUNNING]
    keep += [t for i in invocations for t in _candidates(inv, ended, i)]
    return {_folder(inv, t) for t in keep}


def _live_invocations(tracker, trials: list) -> set[str]:
    """The invocations (parent runs) still running: on other machines that share the checkpoint folder too."""
    ids = {t.user_attrs["invocation"] for t in trials
           if t.state == TrialState.COMPLETE and "invocation" in t.user_attrs}
    live = set()
    for run_id in ids:
        try:
            if tracker.client.get_run(run_id).info.status == "RUNNING":
                live.add(run_id)
        except Exception:  # a run deleted from the store: nothing to log for it
            pass
    return live


def _remove(inv, trials: list, needed: set[Path]) -> None:
    for trial in _ended(inv, trials):
        folder = _folder(inv, trial)
        if folder not in needed:
            shutil.rmtree(folder, ignore_errors=True)


def spare(inv, invocation: str, storage, tracker) -> None:
    """After a trial: remove the checkpoints that no longer serve, so that a study holds about as many as it
    runs trials at once, plus each running invocation's best so far (for --log-models best; all for all)."""
    if inv.checkpoint_dir is None:
        return
    trials = _trials(inv, storage)
    _remove(inv, trials, _needed(inv, trials, _live_invocations(tracker, trials) | {invocation}))


def keep_models(inv, tracker, invocation: str, storage, say) -> None:
    """At the end of an invocation: log the models of its best (or all) complete trials from their last
    checkpoints, then remove the checkpoints of every trial whose point will not run again, but those that
    running trials and other running invocations still need."""
    if inv.checkpoint_dir is None:
        return
    trials = _trials(inv, storage)
    kept = _candidates(inv, _ended(inv, trials), invocation)
    if kept:
        say(f"logging the models of {len(kept)} trial{'s' * (len(kept) > 1)} to MLflow ({inv.log_models})")
    for trial in kept:
        folder = _folder(inv, trial)
        if not (folder / FILE).exists():
            say(f"warning: the model of trial {trial.number} was not logged: its checkpoint {folder / FILE} is gone")
            continue
        try:
            kind = log_model(tracker, trial.user_attrs["mlflow_run_id"], _config_of(inv, trial), folder)
            tracker.log(trial.user_attrs["mlflow_run_id"], tags={"batchsweep.model": kind})
        except Exception as exc:
            say(f"warning: the model of trial {trial.number} was not logged ({type(exc).__name__}: {exc})")
    _remove(inv, trials, _needed(inv, trials, _live_invocations(tracker, trials) - {invocation}))
