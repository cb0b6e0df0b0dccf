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

from batchsweep.trainers import CHECKPOINT_FILE as FILE
from batchsweep.trainers import HOW_NOT_WHAT, TrainConfig, prepare

from ..stores.outcomes import OUTCOMES, outcome_of

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


def kept_as(metrics: tuple[str, ...], directions: tuple[str, ...], policy: str) -> str:
    """What chosen() kept, in words: a trial of the highest objective is one seed's run, not the configuration
    the report names best over the seeds."""
    if policy == "all":
        return "every trial (--log-models all)"
    if len(directions) == 1:
        return (f"the trial of the {'highest' if directions[0] == 'maximize' else 'lowest'} {metrics[0]}, one seed's "
                f"run (the report names the best configuration over the seeds)")
    return f"the trials on the Pareto front of {', '.join(metrics)}, each one seed's run"


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
                "model": config.model, "build": "batchsweep.trainers.prepare(TrainConfig(**config)).model, then "
                "load_state_dict(torch.load('state_dict.pt'))", "config": dataclasses.asdict(config)}, indent=2))
            kind = "state_dict"
        tracker.log_artifacts(run_id, str(target), "model")
    return kind


def _config_of(inv, trial) -> TrainConfig:
    values = dict(trial.user_attrs["config"])
    return inv.config(values, values.pop("seed"))


def _ended(inv, trials: list) -> list[optuna.trial.FrozenTrial]:
    """The trials whose point will not run again: complete or pruned, and failed ones of a sampler's search
    (it draws new values rather than repeat them); a failed or killed grid point resumes from its checkpoint."""
    states = [TrialState.COMPLETE, TrialState.PRUNED] + ([TrialState.FAIL] if inv.study.sampler != "grid" else [])
    return [t for t in trials if t.state in states]


def _candidates(inv, ended: list, invocation: str) -> list:
    """An invocation's complete trials whose models may still be logged at its end."""
    mine = [t for t in ended if t.state == TrialState.COMPLETE and t.user_attrs.get("invocation") == invocation]
    return chosen(mine, inv.study.directions, inv.log_models)


class Cleanup:
    """A study's checkpoint folders, as one process sees them: which still serve and which go. A finished
    trial's folder, a folder removed for a finished trial, and an invocation that ended never change, so each
    is worked out once: what a trial costs here does not grow with the study."""

    def __init__(self, inv, storage, tracker):
        self.inv, self.storage, self.tracker = inv, storage, tracker
        self.folders: dict[int, Path] = {}  # trial id -> its folder
        self.removed: set[int] = set()  # ended trials whose folder is gone
        self.ended_invocations: set[str] = set()

    def spare(self, invocation: str, trials: list | None = None) -> None:
        """After a trial: remove the checkpoints that no longer serve, so that a study holds about as many as it
        runs trials at once, plus each running invocation's best so far (for --log-models best; all for all).
        `trials`: those of the study's one Optuna study, as the worker just read them (None: read them)."""
        if self.inv.checkpoint_dir is None:
            return
        trials = self._trials(trials)
        self._remove(trials, self._needed(trials, self._live(trials, invocation) | {invocation}))

    def keep_models(self, invocation: str, say) -> None:
        """At the end of an invocation: log the models of its best (or all) complete trials from their last
        checkpoints, then remove the checkpoints of every trial whose point will not run again, but those that
        running trials and other running invocations still need."""
        inv = self.inv
        if inv.checkpoint_dir is None:
            return
        trials = self._trials()
        kept = _candidates(inv, _ended(inv, trials), invocation)
        why = kept_as(inv.study.metrics, inv.study.directions, inv.log_models)
        if kept:
            say(f"logging the model{'s' * (len(kept) > 1)} of {len(kept)} trial{'s' * (len(kept) > 1)} to MLflow: "
                f"{why}")
        for trial in kept:
            folder = self.folder(trial)
            if not (folder / FILE).exists():
                say(f"warning: the model of trial {trial.number} was not logged: its checkpoint {folder / FILE} is "
                    f"gone")
                continue
            try:
                kind = log_model(self.tracker, trial.user_attrs["mlflow_run_id"], _config_of(inv, trial), folder)
                self.tracker.log(trial.user_attrs["mlflow_run_id"], tags={"batchsweep.model": kind,
                                                                          "batchsweep.model_kept": why})
            except Exception as exc:
                say(f"warning: the model of trial {trial.number} was not logged ({type(exc).__name__}: {exc})")
        self._remove(trials, self._needed(trials, self._live(trials, invocation)))

    def folder(self, trial) -> Path:
        if trial._trial_id not in self.folders or not trial.state.is_finished():
            self.folders[trial._trial_id] = folder_of(self.inv, _config_of(self.inv, trial), trial.number)
        return self.folders[trial._trial_id]

    def _trials(self, read: list | None = None) -> list[optuna.trial.FrozenTrial]:
        """Every trial of the study that chose a point (a trial that yielded its point to another one chose
        none)."""
        if read is None:
            read = [t for name in self.inv.study_names()
                    for t in optuna.load_study(study_name=name, storage=self.storage).get_trials(deepcopy=False)]
        return [t for t in read if "config" in t.user_attrs and outcome_of(t) != OUTCOMES["duplicate"]]

    def _needed(self, trials: list, invocations: set[str]) -> set[Path]:
        """The folders that must stay: those of running trials (a point claimed twice shares one), and of the
        models that `invocations` may still log."""
        ended = _ended(self.inv, trials)
        keep = [t for t in trials if t.state == TrialState.RUNNING]
        keep += [t for i in invocations for t in _candidates(self.inv, ended, i)]
        return {self.folder(t) for t in keep}

    def _live(self, trials: list, mine: str) -> set[str]:
        """The invocations (parent runs) other than `mine` still running: on other machines that share the
        checkpoint folder too."""
        ids = {t.user_attrs["invocation"] for t in trials
               if t.state == TrialState.COMPLETE and "invocation" in t.user_attrs} - self.ended_invocations - {mine}
        live = set()
        for run_id in ids:
            try:
                running = self.tracker.client.get_run(run_id).info.status == "RUNNING"
            except Exception:  # deleted from the store, or the store failed: not live now, asked again next time
                continue
            (live.add if running else self.ended_invocations.add)(run_id)
        return live

    def _remove(self, trials: list, needed: set[Path]) -> None:
        for trial in _ended(self.inv, trials):
            if trial._trial_id in self.removed:
                continue
            folder = self.folder(trial)
            if folder not in needed:
                shutil.rmtree(folder, ignore_errors=True)
                self.removed.add(trial._trial_id)
