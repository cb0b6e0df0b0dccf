"""What a script prints: its JSON lines as metric rows under names MLflow takes, and where each row is placed in
the trial's run, so that a metric's last logged value is its final one (the objective)."""
from __future__ import annotations

import json
import math
import posixpath
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

TAIL_LINES = 20  # of stderr, kept for the error tag


@dataclass
class Output:
    """What a script printed, kept as it comes (so that a script stopped half-way still has its log)."""

    lines: list[str] = field(default_factory=list)  # stdout and stderr, in the order they came
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))  # of stderr
    rows: list[dict[str, float]] = field(default_factory=list)  # its JSON rows with numbers, as parse_row reads them
    renamed: dict[str, str] = field(default_factory=dict)  # a printed name MLflow refuses -> the name logged
    watched: tuple[str, ...] = ()  # the objective's metrics: a row where one is no number is a warning
    highest: dict[str, float] = field(default_factory=dict)  # the highest epoch and step printed so far
    problems: dict[str, list] = field(default_factory=dict)  # what is wrong with rows: [the first's sentence, count]

    @property
    def final(self) -> dict[str, float]:
        """Each metric's final value, as placed (see place)."""
        return place(self.rows).final

    def notes(self) -> list[str]:
        renamed = [f"the script's metric {name!r} is logged as {logged!r}: " +
                   (f"batchsweep measures {name!r} itself" if name in MEASURED else
                    f"MLflow takes letters, digits and _ - . : / and spaces in a name of at most {NAME_LENGTH}")
                   for name, logged in self.renamed.items()]
        return renamed + counted(self.problems) + place(self.rows).notes

    def row(self, line: str) -> dict[str, float] | None:
        """A printed line as a metric row (see parse_row), kept in `rows`."""
        raw = json_object(line)
        if raw is None:
            return None
        shown = brief(line)
        for name in (*self.watched, "epoch", "step"):
            if name in raw and name not in numbers(raw):
                self._problem(name, f"the script printed {name} as {raw[name]!r}, not a number, in the row {shown}: "
                                    f"it is not logged; print {name} as a number")
        row = parse_row(line, self.renamed)
        if row is None:
            return None
        for index in ("epoch", "step"):  # (NaN and Infinity parse as numbers: no MLflow step)
            if index in row and not math.isfinite(row[index]):
                self._problem(index, f"the script printed {index} as {row.pop(index)!r}, not a finite number, in "
                                     f"the row {shown}: it is not logged; print {index} as a number")
        for index in ("epoch", "step"):
            if index in row and row[index] < self.highest.get(index, -math.inf):
                self._problem(f"{index} order", f"the script printed {index} {row[index]:g} after {index} "
                                                f"{self.highest[index]:g} (the row {shown}): a metric's final value "
                                                f"is its value at the latest {index}")
            self.highest[index] = max(row.get(index, -math.inf), self.highest.get(index, -math.inf))
        self.rows.append(row)
        return row

    def _problem(self, kind: str, sentence: str) -> None:
        _note(self.problems, kind, sentence)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def brief(line: str) -> str:
    line = line.strip()
    return line if len(line) <= 120 else line[:117] + "..."


def counted(problems: dict[str, list]) -> list[str]:
    """Each kind of problem's first sentence, and how many more rows had it."""
    return [first + (f" ({n - 1} more row{'s' * (n > 2)} like it)" if n > 1 else "") for first, n in problems.values()]


@dataclass
class Placed:
    """A script's rows placed, each metric on one scale: its whole epochs where any row gives it one (the report
    reads curves by epoch), else its steps, else none (a value printed once, at the end)."""

    history: list[dict[str, float]]  # the rows as logged: {"epoch": e, ...} or {"step": s, ...}
    final: dict[str, float]  # each metric's value at its last epoch (or step): MLflow's latest, the objective
    notes: list[str]


def index_of(row: dict[str, float]) -> tuple[str, int] | None:
    """Where a row stands: ("epoch", e) at a whole epoch, ("step", s) at a step; None for a row with neither, and
    for a fraction of an epoch without a step (no whole step of any scale)."""
    epoch = row.get("epoch")
    if epoch is not None and float(epoch).is_integer():
        return "epoch", int(epoch)
    if "step" in row:
        return "step", int(row["step"])
    return None


def place(rows: list[dict[str, float]]) -> Placed:
    """The rows a script printed, placed so that the last value of each metric in MLflow's history is its final
    value. A metric that any row gives at a whole epoch is logged at its epochs, and its final value is that of
    its last epoch (the last printed at that epoch); its rows at a step between epochs (`{"epoch": 1.5, "step":
    150}`) are within an epoch: logged as step_<name> at their step, as the trainer logs its evaluations within
    epochs. A metric with steps alone is logged at its steps. A row that cannot be placed on its metric's scale
    (no whole epoch and no step) is neither logged nor final: each is a note. A metric printed in rows with
    neither, alone, is final as last printed."""
    scales: dict[str, str] = {}
    for row in rows:
        index = index_of(row)
        for name in row:
            if index and name not in ("epoch", "step") and scales.get(name) != "epoch":
                scales[name] = index[0]
    history, final, at, notes = [], {}, {}, {}
    logged_at: dict[tuple, dict[str, float]] = {}  # (name, scale, index) -> the history row that holds it
    for row in rows:
        index = index_of(row)
        names = [n for n in row if n not in ("epoch", "step")]
        if index is None:
            lost = [n for n in names if n in scales]
            final.update({n: row[n] for n in names if n not in scales})
            if lost:
                where = f"epoch {row['epoch']:g} without a step" if "epoch" in row else "neither epoch nor step"
                them = "it" if len(lost) == 1 else "them"
                _note(notes, "unplaced", f"the script printed {', '.join(lost)} in a row with {where} "
                                         f"({row_text(row)}), where other rows give {them} at "
                                         f"{'epochs' if scales[lost[0]] == 'epoch' else 'steps'}: it cannot be "
                                         f"placed among them, so it is kept in log.txt only and is not the final "
                                         f"value; print its epoch (or step) in the row, or give it a name of its own")
            continue
        out = {index[0]: index[1]}
        for name in names:
            logged = name
            if index[0] == "step" and scales[name] == "epoch":
                logged = f"step_{name}"
                _note(notes, "within", f"the script printed {name} at step {index[1]} between whole epochs "
                                       f"({row_text(row)}): logged as {logged} at its step, while {name} holds its "
                                       f"value at each whole epoch")
            earlier = logged_at.get((logged, *index))
            if earlier is not None:  # (MLflow's latest at one step would be the larger value, not the later)
                del earlier[logged]
                _note(notes, "again", f"the script printed {name} twice at {index[0]} {index[1]} "
                                      f"({row_text(row)}): the later value is logged")
            out[logged], logged_at[(logged, *index)] = row[name], out
            if logged == name and index[1] >= at.get(name, -math.inf):
                final[name], at[name] = row[name], index[1]
        history.append(out)
    return Placed([r for r in history if len(r) > 1], final, counted(notes))


def row_text(row: dict[str, float]) -> str:
    return brief(json.dumps({k: int(v) if float(v).is_integer() and k in ("epoch", "step") else v
                             for k, v in row.items()}))


def _note(notes: dict[str, list], kind: str, sentence: str) -> None:
    notes.setdefault(kind, [sentence, 0])[1] += 1


# MLflow refuses a metric name with other characters than these, longer than 250, or that is not a plain relative
# path ("a//b", "../a", "/a"): one such name in a batch fails the whole trial's record.
REFUSED = re.compile(r"[^/\w.\- :]+")
NAME_LENGTH = 250
MEASURED = ("wall_time_s", "peak_memory_bytes")  # what batchsweep measures of a script: its own go under script/


def _refused(name: str) -> bool:
    norm = posixpath.normpath(name)
    return bool(REFUSED.search(name)) or len(name) > NAME_LENGTH or norm != name or norm.startswith(("..", "/")) \
        or norm == "."


def storable(name: str) -> str:
    """The name under which a script's metric is logged: its own where MLflow takes it; else each run of refused
    characters as "_" ("acc(%)" is "acc_"), "/" too where the name would be a path, cut to 250 characters."""
    if not _refused(name):
        return name
    fixed = REFUSED.sub("_", name)
    if _refused(fixed[:NAME_LENGTH]):
        fixed = fixed.replace("/", "_")
    if _refused(fixed[:NAME_LENGTH]):  # "", "." or "..x"
        fixed = "_" + fixed
    return fixed[:NAME_LENGTH]


def numbers(row: dict[str, Any]) -> dict[str, float]:
    """A JSON row's numeric values (true/false are not numbers here)."""
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def json_object(line: str) -> dict[str, Any] | None:
    """A line that is a JSON object, as a dict; None for any other line."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def parse_row(line: str, renamed: dict[str, str]) -> dict[str, float] | None:
    """A line of stdout that is a JSON object with numbers in it, under names MLflow takes and batchsweep's
    measurements do not (`renamed` gets each name that had to change); None for any other line."""
    row = json_object(line)
    if row is None:
        return None
    values = {}
    for name, value in numbers(row).items():
        logged = f"script/{name}" if name in MEASURED else storable(name)
        values[logged] = value
        if logged != name:
            renamed[name] = logged
    return values or None
