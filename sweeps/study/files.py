"""Study files: a study in TOML (or a Python object of the same shape), validated before anything runs.

    python sweeps/run.py --study path/to/study.toml
    python sweeps/run.py --study package.module:STUDY     # a Study, or a dict shaped like the file
    python sweeps/run.py --study accum_lr                 # a built-in, one of sweeps/study/builtin/*.toml

Every problem is one ConfigError naming the file, the key and what to change.
"""
from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

# DERIVED: a constraint may name them
from batchsweep.trainers import DERIVED, FIELDS, MAX_COUNT, ConfigError, import_object

from ..commands import command
from ..launch.program import PLACEHOLDER, TOKEN, Program, fill, misread, stray_brace
from ..launch.rows import storable
from .search import PRUNERS, SAMPLERS
from .spec import (CONSTRAINT, DIRECTIONS, KINDS, LAUNCHERS, Constraint, Param, Study, check_name,
                      check_size)

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

BUILTIN = Path(__file__).resolve().parent / "builtin"
KEYS = {
    "": ("name", "summary", "seeds", "workers", "launcher", "fixed", "grid", "tune", "search", "objective",
         "program"),
    "search": ("sampler", "trials", "pruner", "twins", "constraints", "seed", "fuse"),
    "objective": ("kind", "metrics", "directions"),
    "tune": ("type", "low", "high", "log", "choices"),
    "program": ("command", "env", "cwd", "timeout_minutes"),
}


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN.glob("*.toml"))


def load(spec: str) -> Study:
    """A built-in study's name, a .toml path, or package.module:ATTR."""
    if spec.endswith(".toml") or "/" in spec or "\\" in spec:
        return read_file(Path(spec))
    if ":" in spec:
        return from_python(spec)
    if spec in builtin_names():
        return read_file(BUILTIN / f"{spec}.toml")
    raise ConfigError(f"unknown study {spec!r}: name a built-in one ({', '.join(builtin_names())}), a study file "
                      f"(path/to/study.toml) or package.module:STUDY (see --list)")


def read_file(path: Path) -> Study:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"study file {path} does not exist: check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read study file {path} ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc}): fix the syntax") from None
    return parse(data, str(path))


def from_python(spec: str) -> Study:
    obj = import_object(spec, "study")
    if isinstance(obj, Study):
        return obj
    if isinstance(obj, dict):
        return parse(obj, spec)
    module_name, _, attr = spec.partition(":")
    raise ConfigError(f"study {spec!r}: module {module_name!r} has no Study or dict named {attr!r}")


def parse(data: dict[str, Any], source: str) -> Study:
    """Check every key and value of a study file's content and build the Study."""
    def fail(key: str, problem: str) -> ConfigError:
        return ConfigError(f"{source}: {key}: {problem}")

    _unknown("", data, KEYS[""], fail)
    name = _typed(data, "name", str, fail, required=True)
    try:
        check_name(name)
    except ConfigError as exc:
        raise fail("name", str(exc)) from None
    search, objective = _table(data, "search", fail), _table(data, "objective", fail)
    _unknown("search", search, KEYS["search"], fail)
    _unknown("objective", objective, KEYS["objective"], fail)
    program = _program(data, source, fail) if "program" in data else None
    fixed, grid, tune, auto = _fields(data, fail, own=program is not None)
    sampler = _choice(search, "search.sampler", "sampler", tuple(SAMPLERS), "grid", fail)
    pruner = _choice(search, "search.pruner", "pruner", tuple(PRUNERS), "none", fail)
    kind, metrics, directions = _objective(objective, fail, program is not None)
    grid_fields = [f for key in grid for f in key.split("+")]
    _check_search(search, sampler, pruner, kind, metrics, tune, grid_fields, fail)
    twins = _typed(search, "twins", bool, fail, default=False, key="search.twins")
    if twins and not {"physical_batch", "accum_steps"} <= set(grid_fields):
        raise fail("search.twins", "a twin (b*k, 1) changes physical_batch and accum_steps: put both in [grid]")
    own = {f for f in [*fixed, *grid_fields, *tune] if f not in FIELDS}  # a [program] study's own fields
    constraints = tuple(_constraint(text, fail, own) for text in _strings(search, "search.constraints",
                                                                           "constraints", [], fail))
    study = Study(name=name, summary=_typed(data, "summary", str, fail, default=""), fixed=fixed, grid=grid,
                  tune=tune, sampler=sampler, trials=_count(search, "search.trials", "trials", 10, 100_000, fail),
                  pruner=pruner, twins=twins, constraints=constraints, kind=kind, metrics=metrics,
                  fuse=_typed(search, "fuse", bool, fail, default=True, key="search.fuse"),
                  directions=directions, seeds=_count(data, "seeds", "seeds", 1, 1000, fail),
                  workers=_count(data, "workers", "workers", 1, 256, fail),
                  sampler_seed=_count(search, "search.seed", "seed", 0, 2 ** 31 - 1, fail, low=0),
                  launcher=_choice(data, "launcher", "launcher", LAUNCHERS, "process", fail), auto_batch=auto,
                  source=source, program=program)
    check_size(study, study.seeds, "seeds in the file")
    if program:
        _check_program(study, fail)
    return study


def _table(data: dict, key: str, fail) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise fail(key, f"must be a table ([{key}]), got {_kind(value)}")
    return value


def _unknown(where: str, keys, allowed, fail) -> None:
    for key in keys:
        if key not in allowed:
            raise fail(f"{where}.{key}" if where else key, f"unknown key: the keys here are {', '.join(allowed)}")


def _fields(data: dict, fail, own: bool = False) -> tuple[dict[str, Any], dict[str, tuple], dict[str, Param], bool]:
    """[fixed], [grid] and [tune], each value of its field's type, each field in one table; and whether
    physical_batch is "auto" (each trial starts at b = its effective_batch and shrinks on out-of-memory).
    With `own` (a [program] study), a name that is no trainer field is the user's own, passed to the script."""
    fixed, grid_table = _table(data, "fixed", fail), _table(data, "grid", fail)
    auto = fixed.get("physical_batch") == "auto"
    fixed = {k: v for k, v in fixed.items() if not (auto and k == "physical_batch")}
    if auto and "effective_batch" in fixed:  # one target: a grid axis of one value
        grid_table = {"effective_batch": [fixed.pop("effective_batch")], **grid_table}

    def value_of(key: str, field: str, value: Any) -> Any:
        if own and field not in FIELDS and field not in DERIVED:
            return _own_value(key, value, fail, field)
        if field != "effective_batch":
            return _field_value(key, field, value, fail)
        if not auto:
            raise fail(key, "effective_batch is b x k x world_size: set physical_batch and accum_steps, or "
                            "physical_batch = \"auto\" in [fixed] with effective_batch as the target")
        if type(value) is not int or not 1 <= value <= MAX_COUNT:
            raise fail(key, f"must be a positive integer, got {_kind(value)} {value!r}")
        return value

    for key, value in fixed.items():
        value_of(f"fixed.{key}", key, value)
    grid = {key: _axis(key, values, value_of, fail) for key, values in grid_table.items()}
    tune = {key: _param(f"tune.{key}", key, spec, fail, own) for key, spec in _table(data, "tune", fail).items()}
    grid_fields = [f for key in grid for f in key.split("+")]
    if auto and "effective_batch" not in grid_fields:
        raise fail("fixed.physical_batch", "\"auto\" needs the target: effective_batch = B in [fixed] or [grid]")
    if auto and {"physical_batch", "accum_steps"} & (set(grid_fields) | set(tune) | set(fixed)):
        raise fail("fixed.physical_batch", "\"auto\" sets physical_batch and accum_steps itself: leave them out "
                                           "of [fixed], [grid] and [tune]")
    if len(set(grid_fields)) < len(grid_fields):
        raise fail("grid", "names a field in two axes: give each field one axis")
    tables = {"fixed": set(fixed), "grid": set(grid_fields), "tune": set(tune)}
    for first, second in (("fixed", "grid"), ("fixed", "tune"), ("grid", "tune")):
        both = tables[first] & tables[second]
        if both:
            raise fail(f"{second}.{sorted(both)[0]}", f"is also in [{first}]: give each field in one table only")
    return dict(fixed), grid, tune, auto


def _axis(key: str, values: Any, value_of, fail) -> tuple:
    """A [grid] axis: a list of values of one field, or of lists of values of fields that vary together
    (`"model+dataset" = [["mlp", "mnist1d"], ["gpt", "pytext"]]`)."""
    if not isinstance(values, list) or not values:
        raise fail(f"grid.{key}", f"must be a non-empty list of values, got {_kind(values)}")
    fields = key.split("+")
    if len(fields) == 1:
        axis = tuple(value_of(f"grid.{key}", key, v) for v in values)
    else:
        if not all(isinstance(v, list) and len(v) == len(fields) for v in values):
            raise fail(f"grid.{key}", f"each value must be a list of {len(fields)} values, one for each of "
                                      f"{', '.join(fields)}")
        axis = tuple(tuple(value_of(f"grid.{key}", f, x) for f, x in zip(fields, v)) for v in values)
    if len(set(axis)) < len(axis):
        raise fail(f"grid.{key}", "lists a value twice: list each once")
    return axis


def _objective(objective: dict, fail, program: bool) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """[objective]: the kind, and one direction per metric."""
    kind = _choice(objective, "objective.kind", "kind", KINDS, "program" if program else "train", fail)
    if (kind == "program") != program:
        raise fail("objective.kind", "a study with a [program] runs your script: leave kind out (it is \"program\")"
                   if program else "\"program\" runs your script: add a [program] table with its command")
    default_metric = "param_rel_diff" if kind == "equivalence" else "val_acc"
    metrics = tuple(_strings(objective, "objective.metrics", "metrics", [default_metric], fail))
    for name in metrics if program else ():  # (the trainer's own names are checked where they are made)
        if storable(name) != name:
            raise fail("objective.metrics", f"MLflow cannot hold a metric named {name!r} (it takes letters, digits "
                                            f"and _ - . : / and spaces): a script's {name!r} is logged as "
                                            f"{storable(name)!r}: put that name here")
    directions = tuple(_strings(objective, "objective.directions", "directions",
                                ["minimize" if kind == "equivalence" else "maximize"] * len(metrics), fail))
    if len(directions) != len(metrics) or not metrics:
        raise fail("objective.directions", f"give one direction per metric ({len(metrics)} metrics, "
                                           f"{len(directions)} directions)")
    for d in directions:
        if d not in DIRECTIONS:
            raise fail("objective.directions", f"{d!r} is not a direction: use maximize or minimize")
    return kind, metrics, directions


def _check_search(search: dict, sampler: str, pruner: str, kind: str, metrics: tuple, tune: dict,
                  grid_fields: list[str], fail) -> None:
    """What each sampler and pruner needs of the rest of the study."""
    if sampler == "grid":
        if tune:
            raise fail("tune", f"needs a sampler that searches: set [search] sampler to one of "
                               f"{', '.join(s for s in SAMPLERS if s != 'grid')}")
        if "trials" in search:
            raise fail("search.trials", "applies to samplers other than grid (a grid runs each point once per seed)")
    elif not tune:
        raise fail("search.sampler", f"{sampler} searches the fields of [tune], and there are none: add one, or use "
                                     f"sampler = \"grid\"")
    if sampler == "cmaes":
        try:
            import cmaes  # noqa: F401  (Optuna's CmaEsSampler needs it)
        except ModuleNotFoundError:
            raise fail("search.sampler", "cmaes needs the cmaes package: pip install cmaes, or use tpe") from None
        if len(metrics) > 1:
            raise fail("search.sampler", "cmaes optimizes one metric: use nsga2 or tpe for several")
    if pruner != "none" and len(metrics) > 1:
        raise fail("search.pruner", "Optuna prunes single-objective studies only: use pruner = \"none\"")
    if kind == "equivalence" and sampler != "grid":
        raise fail("objective.kind", "an equivalence study compares grid points: use sampler = \"grid\"")


def _kind(value: Any) -> str:
    return {bool: "true/false", int: "an integer", float: "a number", str: "text", list: "a list",
            dict: "a table"}.get(type(value), type(value).__name__)


def _typed(table: dict, name: str, kind: type, fail, default: Any = None, required: bool = False,
           key: str | None = None) -> Any:
    key = key or name
    if name not in table:
        if required:
            raise fail(key, "is missing: add it")
        return default
    value = table[name]
    if type(value) is not kind:
        raise fail(key, f"must be {_kind(kind())}, got {_kind(value)} {value!r}")
    return value


def _count(table: dict, key: str, name: str, default: int, high: int, fail, low: int = 1) -> int:
    value = _typed(table, name, int, fail, default=default, key=key)
    if not low <= value <= high:
        raise fail(key, f"must be between {low} and {high:,}, got {value}")
    return value


def _choice(table: dict, key: str, name: str, allowed: tuple[str, ...], default: str, fail) -> str:
    value = _typed(table, name, str, fail, default=default, key=key)
    if value not in allowed:
        raise fail(key, f"{value!r} is not one of {', '.join(allowed)}")
    return value


def _strings(table: dict, key: str, name: str, default: list[str], fail) -> list[str]:
    value = table.get(name, default)
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise fail(key, f"must be a list of names, e.g. [\"val_acc\"], got {value!r}")
    return value


def _field_value(key: str, field: str, value: Any, fail) -> Any:
    """A TrainConfig field's value of the field's type (an integer is a float where a float is due)."""
    if field not in FIELDS:
        close = [f for f in FIELDS if f.startswith(field[:4])]
        raise fail(key, f"{field!r} is not a trainer field" + (f" (did you mean {close[0]}?)" if close else "")
                   + f": see `{command('train')} --help`")
    kind = type(FIELDS[field].default)
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind:
        raise fail(key, f"must be {_kind(kind())}, got {_kind(value)} {value!r}")
    if kind is float and not math.isfinite(value):
        raise fail(key, f"must be a finite number, got {value!r}")
    return value


def _param(key: str, field: str, spec: Any, fail, own: bool = False) -> Param:
    if field not in FIELDS and not own:
        _field_value(key, field, None, fail)  # names the unknown field

    def value_of(where: str, value: Any) -> Any:
        if field in FIELDS:
            return _field_value(where, field, value, fail)
        return _own_value(where, value, fail, field)

    if not isinstance(spec, dict):
        raise fail(key, f"must be a table ([{key}]) with type and low/high or choices, got {_kind(spec)}")
    for name in spec:
        if name not in KEYS["tune"]:
            raise fail(f"{key}.{name}", f"unknown key: the keys here are {', '.join(KEYS['tune'])}")
    if "type" not in spec:
        raise fail(f"{key}.type", "is missing: float, int or categorical")
    kind = _choice(spec, f"{key}.type", "type", ("float", "int", "categorical"), "", fail)
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise fail(f"{key}.choices", "must be a non-empty list of values")
        return Param("categorical", choices=tuple(value_of(f"{key}.choices", c) for c in choices))
    if "choices" in spec:
        raise fail(f"{key}.choices", f"belongs to type = \"categorical\"; a {kind} takes low and high")
    field_kind = type(FIELDS[field].default) if field in FIELDS else {"float": float, "int": int}[kind]
    if kind == "float" and field_kind is not float or kind == "int" and field_kind is not int:
        raise fail(f"{key}.type", f"{field} is {_kind(field_kind())}: use type = "
                                  f"\"{'int' if field_kind is int else 'float' if field_kind is float else 'categorical'}\"")
    low, high = (_number(f"{key}.{b}", field_kind, spec[b], fail) if b in spec else None for b in ("low", "high"))
    if low is None or high is None:
        raise fail(f"{key}.{'low' if low is None else 'high'}", "is missing: give low and high")
    log = _typed(spec, "log", bool, fail, default=False, key=f"{key}.log")
    if not low < high or log and low <= 0:
        raise fail(key, f"needs low < high{' and low > 0 (log scale)' if log else ''}, got low={low}, high={high}")
    return Param(kind, low=low, high=high, log=log)


def _number(key: str, kind: type, value: Any, fail) -> float | int:
    """A bound of a searched range: a finite number of the range's type (an integer is a float where due)."""
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind or kind is float and not math.isfinite(value):
        raise fail(key, f"must be {'a finite number' if kind is float else 'an integer'}, got {_kind(value)} {value!r}")
    return value


def _own_value(key: str, value: Any, fail, field: str) -> Any:
    """A value of a [program] study's own field: text, a number or true/false, passed to the script as text. The
    field's name is a placeholder's (it reaches the script only as one) and an MLflow param's."""
    if not PLACEHOLDER.fullmatch(f"{{{field}}}"):
        raise fail(key, f"{field!r} is not a name a field of your own can have: use letters, digits and _, "
                        f"not a digit first, as a placeholder does ({{drop_rate}})")
    if type(value) not in (str, int, float, bool) or type(value) is float and not math.isfinite(value):
        raise fail(key, f"must be text, a finite number or true/false (a field of your own, passed to the "
                        f"[program]), got {_kind(value)} {value!r}")
    return value


def _program(data: dict, source: str, fail) -> Program:
    """[program]: the command as a list of arguments (no shell), extra variables, a folder and a time limit.
    A relative cwd, and the default, is the study file's folder."""
    table = _table(data, "program", fail)
    _unknown("program", table, KEYS["program"], fail)
    command = table.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(a, str) and a for a in command):
        raise fail("program.command", f"must be a non-empty list of arguments (no shell), e.g. [\"python\", "
                                      f"\"train.py\", \"--lr\", \"{{lr}}\"], got {command!r}")
    env = _table(table, "env", fail)
    for name, value in env.items():
        if not isinstance(value, str):
            raise fail(f"program.env.{name}", f"must be text, got {_kind(value)} {value!r}")
    here = Path(source).resolve().parent if source.endswith(".toml") else Path.cwd()
    text = _typed(table, "cwd", str, fail, default=".", key="program.cwd")
    # A cwd is filled as the command is ({trial_dir}: each trial in its own folder): the study file's folder before
    # it, with its braces doubled, unless it starts with a placeholder (an absolute {trial_dir}).
    escaped = str(here if _filled_per_trial(text) else here / text).replace("{", "{{").replace("}", "}}")
    cwd = text if PLACEHOLDER.match(text) else escaped + os.sep + text if _filled_per_trial(text) else escaped
    if not _filled_per_trial(cwd) and not Path(fill(cwd, {})).is_dir():
        raise fail("program.cwd", f"{fill(cwd, {})} is not a folder: a relative cwd is relative to the study file's "
                                  f"folder")
    moved = [a for a in command if _filled_per_trial(cwd) and not a.startswith(("/", "-")) and "{" not in a and
             (here / a).is_file()]
    if moved:  # (a trial's own folder is made empty: the script there would not be found)
        raise fail("program.cwd", f"each trial runs in {text}, where {moved[0]!r} (a file in {here}) is not: give "
                                  f"its path from / in the command ({here / moved[0]})")
    timeout = table.get("timeout_minutes")
    if timeout is not None and (type(timeout) not in (int, float) or not 0 < timeout < math.inf):
        raise fail("program.timeout_minutes", f"must be a positive number of minutes, got {timeout!r}")
    return Program(tuple(command), dict(env), cwd, None if timeout is None else float(timeout))


def _check_program(study: Study, fail) -> None:
    """What a [program] study cannot have: a placeholder with no value, and what only the trainer does."""
    known = {*FIELDS, *DERIVED, *study.named, "python", "trial_dir"}
    program = study.program
    for key, text in [*(("program.command", a) for a in program.command),
                      *((f"program.env.{k}", v) for k, v in program.env.items()), ("program.cwd", program.cwd)]:
        brace = stray_brace(text)
        if brace:
            raise fail(key, misread(brace, known))
    for key, texts in (("program.command", program.command), ("program.env", program.env.values()),
                       ("program.cwd", [program.cwd])):
        for name in (m.group(1) for text in texts for m in TOKEN.finditer(text) if m.group(1)):
            if name not in known:
                raise fail(key, f"{{{name}}} is not a placeholder: use a trainer field (physical_batch, "
                                f"accum_steps, lr, seed, epochs, max_steps, ...), {', '.join(DERIVED)}, a field of "
                                f"[fixed], [grid] or [tune], {{trial_dir}} or {{python}}")
    first = program.command[0]
    if not _filled_per_trial(first):  # ("{trial_dir}/run.sh": known when the trial runs)
        first = fill(first, {})
        if "/" not in first:
            found = shutil.which(first)
        elif first.startswith("/"):
            found = Path(first).is_file()
        else:  # (relative to a cwd of each trial's own: known when the trial runs)
            found = _filled_per_trial(program.cwd) or Path(fill(program.cwd, {}), first).is_file()
        if not found:
            raise fail("program.command", f"{first!r} is not a program it can start: give a program on PATH, a "
                                          f"path (relative to {program.cwd}), or {{python}}")
    if study.launcher != "process":
        raise fail("launcher", "a [program] runs your command as it is: put torchrun into the command instead")
    if study.auto_batch:
        raise fail("fixed.physical_batch", "\"auto\" shrinks b inside batchsweep's trainer; a [program] sets "
                                           "physical_batch itself: give it values")


def _filled_per_trial(text: str) -> bool:
    """Whether a text holds a placeholder whose value is a trial's ({python} is the same for all)."""
    return bool({m.group(1) for m in TOKEN.finditer(text)} - {None, "python"})


def _constraint(text: str, fail, own: set[str] = frozenset()) -> Constraint:
    match = CONSTRAINT.fullmatch(text)
    if not match:
        raise fail("search.constraints", f"{text!r} is not `field op number`, e.g. \"effective_batch <= 4096\"")
    name = match.group(1)
    if name not in FIELDS and name not in DERIVED and name not in own:
        raise fail("search.constraints", f"{text!r}: {name!r} is neither a trainer field nor one of {', '.join(DERIVED)}")
    try:
        number = float(match.group(3))
    except ValueError:
        raise fail("search.constraints", f"{text!r}: {match.group(3)!r} is not a number") from None
    if not math.isfinite(number):
        raise fail("search.constraints", f"{text!r}: {match.group(3)!r} is beyond a float's range: give a finite "
                                         f"number")
    return Constraint(text.strip())
