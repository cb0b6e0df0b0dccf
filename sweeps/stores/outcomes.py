"""How a trial can end, in one table: its state in Optuna, its status in MLflow, and whether its point runs again.

A finished trial carries its outcome's name as the user attribute and MLflow tag `reason` (none when complete)
and its Optuna state as the tag `state`.
"""
from __future__ import annotations

from dataclasses import dataclass

from optuna.trial import FrozenTrial, TrialState


@dataclass(frozen=True)
class Outcome:
    name: str
    state: TrialState  # in Optuna
    status: str | None  # of the trial's MLflow run (None: the trial has no run)
    retry: str  # "now": another worker may take the point at once; "later": the next invocation runs it again;
    #             "never": the point is done
    infeasible: bool  # recorded as a broken Optuna constraint (trial.set_constraint), so that TPE and NSGA-II
    #                   leave the neighbourhood
    means: str


OUTCOMES = {o.name: o for o in [
    Outcome("complete", TrialState.COMPLETE, "FINISHED", "never", False, "trained to the end"),
    Outcome("record_error", TrialState.COMPLETE, "FAILED", "never", False,
            "trained to the end; recording it in MLflow failed (its result is in Optuna)"),
    Outcome("pruned", TrialState.PRUNED, "KILLED", "never", False, "stopped early by the pruner"),
    Outcome("diverged", TrialState.PRUNED, "FAILED", "never", True, "the training loss became non-finite"),
    Outcome("oom", TrialState.PRUNED, "FAILED", "never", True, "out of memory"),
    Outcome("invalid", TrialState.PRUNED, "FAILED", "never", True,
            "the configuration cannot run or breaks one of the study's constraints"),
    Outcome("error", TrialState.FAIL, "FAILED", "later", False, "raised an error"),
    Outcome("clash", TrialState.FAIL, "FAILED", "later", False,
            "wrote a file that a trial running at the same time wrote too: its result may be the other's"),
    Outcome("interrupted", TrialState.FAIL, "KILLED", "later", False, "stopped by Ctrl-C or a signal"),
    Outcome("duplicate", TrialState.PRUNED, None, "now", False, "another trial holds the same point"),
]}


INTERRUPTED = OUTCOMES["interrupted"]  # also what the runs of a process that died end as, whatever killed it


def outcome_of(trial: FrozenTrial) -> Outcome | None:
    """A finished trial's outcome; None while it runs."""
    reason = trial.user_attrs.get("reason")
    if reason in OUTCOMES:
        return OUTCOMES[reason]
    return {TrialState.COMPLETE: OUTCOMES["complete"], TrialState.PRUNED: OUTCOMES["pruned"],
            TrialState.FAIL: OUTCOMES["error"]}.get(trial.state)


def holds(trial: FrozenTrial) -> bool:
    """Whether a trial holds its point: running it, or done with it for good."""
    if trial.state == TrialState.RUNNING:
        return True
    outcome = outcome_of(trial)
    return outcome is not None and outcome.retry == "never"
