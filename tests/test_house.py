"""The house stays walkable: the README is a front door whose links lead somewhere, docs/cli.md is every
command's --help, no function is longer than a screen, and sweeps/ uses the trainer through its surface."""
import ast
import re
import subprocess

from tests.conftest import ROOT


def test_docs_cli_md_is_every_commands_help():
    from sweeps.commands import markdown

    assert (ROOT / "docs/cli.md").read_text() == markdown(), (
        "docs/cli.md is not the commands' --help: remake it with the command at its top")


def test_the_readme_is_a_front_door_whose_links_lead_somewhere():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    named = set(re.findall(r"`((?:docs|sweeps|trainers|analysis|benchmarks)/[\w./-]+)`", text))
    named |= set(re.findall(r"\]\(((?:docs)/[\w./-]+)\)", text))
    assert "docs/architecture.md" in named and "docs/figures/accum_lr_accuracy.png" in named
    missing = [path for path in named if not (ROOT / path.rstrip("/")).exists()]
    assert not missing, missing


def test_the_repository_tracks_no_store_report_or_data():
    """A store or a report written while trying a command in a subfolder (examples/audit/mlruns/) is not
    committed: .gitignore covers every level."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    kept = [p for p in tracked if p != "mlruns/.gitkeep" and
            re.search(r"(^|/)(mlruns|reports|data|\.cache)/|\.(db|npz|pkl|pt)$", p)]
    assert not kept, kept


def test_no_function_is_longer_than_60_lines():
    long = []
    for folder in ("trainers", "sweeps", "analysis"):
        for path in sorted((ROOT / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        node.end_lineno - node.lineno + 1 > 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not long, long


def test_sweeps_and_analysis_use_the_trainer_through_its_surface_only():
    past = []
    for folder in ("sweeps", "analysis"):
        for path in sorted((ROOT / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                past += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("trainers.")]
                if folder == "analysis":  # it reads MLflow, never the trainer or the sweep's logic
                    past += [f"{path.relative_to(ROOT)}: {n}" for n in names
                             if n == "trainers" or (n.startswith("sweeps") and n != "sweeps")]
    assert not past, past
