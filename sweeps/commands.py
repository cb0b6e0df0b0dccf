"""The installed `batchsweep` command: `batchsweep run|plan|report|train ...`, each the same as its script."""
from __future__ import annotations

import importlib
import sys

# name: (module whose main() takes the rest of the command line, arguments put first, what it does)
COMMANDS = {
    "run": ("sweeps.cli", [], "run a study (python sweeps/run.py)"),
    "plan": ("sweeps.cli", ["--plan"], "plan b and k for a target batch within a memory budget"),
    "report": ("analysis.cli", [], "write a study's report from MLflow (python analysis/report.py)"),
    "train": ("trainers.cli", [], "train one configuration (python trainers/train.py)"),
}


def usage() -> str:
    lines = ["usage: batchsweep COMMAND [options]   (batchsweep COMMAND --help for its options)", ""]
    lines += [f"  {name:<7} {what}" for name, (_, _, what) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"error: unknown command {argv[0]!r}: use one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module, first, _ = COMMANDS[argv[0]]
    return importlib.import_module(module).main(first + argv[1:])
