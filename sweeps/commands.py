"""The installed `batchsweep` command: `batchsweep run|plan|report|train ...`, each the same as its script."""
from __future__ import annotations

import importlib
import os
import sys

from batchsweep.trainers import INVOKED, OneLineParser

# name: ("module:function" that takes the rest of the command line, what it does)
COMMANDS = {
    "run": ("batchsweep.sweeps.cli:main", "run a study (python sweeps/run.py)"),
    "plan": ("batchsweep.sweeps.cli:plan", "plan b and k for a target batch within a memory budget (python sweeps/run.py --plan)"),
    "report": ("batchsweep.analysis.cli:main", "write a study's report from MLflow (python analysis/report.py)"),
    "train": ("batchsweep.trainers.cli:main", "train one configuration (python trainers/train.py)"),
    "audit": ("batchsweep.sweeps.audit.command:main", "name the accumulation mistake of your own training script"),
}

SCRIPTS = {"run": "sweeps/run.py", "report": "analysis/report.py", "train": "trainers/train.py"}
# (command, as typed) where this process's parser would name itself otherwise: `batchsweep run`, `python -m batchsweep.sweeps`.
started: tuple[str, str] | None = None


def command(name: str) -> str:
    """A command as a hint names it: `batchsweep report` where the user started `batchsweep`, which runs from any
    folder, else the script (`python analysis/report.py`), which runs from batchsweep's own folder (`batchsweep audit`
    has no script)."""
    return f"batchsweep {name}" if invoked() or name not in SCRIPTS else f"python {SCRIPTS[name]}"


class Parser(OneLineParser):
    """A command's parser, named as the user started it; its bad input is one line instead of argparse's usage."""

    def __init__(self, name: str, **kwargs):
        super().__init__(prog=started[1] if started and started[0] == name else command(name), **kwargs)


def entry(name: str):
    """The function that runs a command, imported only when that command runs."""
    module, function = COMMANDS[name][0].split(":")
    return getattr(importlib.import_module(module), function)


def invoked() -> bool:
    return os.environ.get(INVOKED) == "batchsweep"


def usage() -> str:
    lines = ["usage: batchsweep COMMAND [options]   (batchsweep COMMAND --help for its options)", ""]
    lines += [f"  {name:<7} {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def help_text(name: str) -> str:
    """A command's --help, as `batchsweep` prints it in a terminal 100 columns wide."""
    import contextlib
    import io
    from unittest import mock  # patch.dict: the environment as it was afterwards, whatever --help raised

    out = io.StringIO()
    with mock.patch.dict(os.environ, {"COLUMNS": "100", INVOKED: "batchsweep"}), \
            contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        entry(name)(["--help"])
    return out.getvalue()


def markdown() -> str:
    """docs/cli.md: every command's flags, from their --help (tests/test_house.py keeps the file equal to this)."""
    parts = ["# Commands", "", "Every command's `--help`, as it prints it. Made with", "",
             "    python -c 'from batchsweep.sweeps.commands import markdown; print(markdown(), end=\"\")' > docs/cli.md", "",
             "```", usage(), "```"]
    for name in COMMANDS:
        parts += ["", f"## batchsweep {name}", "", "```", help_text(name).rstrip(), "```"]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"error: unknown command {argv[0]!r}: use one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    global started
    os.environ[INVOKED] = "batchsweep"
    started = (argv[0], f"batchsweep {argv[0]}")
    try:
        return entry(argv[0])(argv[1:])
    finally:
        started = None
