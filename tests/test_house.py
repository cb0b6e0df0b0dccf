"""The house stays walkable: the README is a front door whose links lead somewhere, docs/cli.md is every
command's --help, no function is longer than a screen, and sweeps/ uses the trainer through its surface."""
import ast
import importlib.util
import re
import subprocess
import sys
import tempfile

from tests.conftest import ROOT


def test_docs_cli_md_is_every_commands_help():
    from batchsweep.sweeps.commands import markdown

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


def modules(folder: str) -> list:
    """The modules of one floor, its rooms' included (the tracer's files are the script's, not batchsweep's)."""
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "tracer" not in p.parts)


def test_no_function_is_longer_than_60_lines():
    long = []
    for folder in ("trainers", "sweeps", "analysis"):
        for path in modules(folder):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        node.end_lineno - node.lineno + 1 > 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not long, long


def test_sweeps_and_analysis_use_the_trainer_through_its_surface_only():
    past = []
    for folder in ("sweeps", "analysis"):
        for path in modules(folder):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                past += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("batchsweep.trainers.")]
                if folder == "analysis":  # it reads MLflow, never the trainer or the sweep's logic
                    past += [f"{path.relative_to(ROOT)}: {n}" for n in names if n == "batchsweep.trainers" or (
                        n.startswith("batchsweep.sweeps") and n not in ("batchsweep.sweeps", "batchsweep.sweeps.stores"))]
    assert not past, past


PACKAGES = ("trainers", "sweeps", "analysis")
# What each floor may import of the others: imports go one way (docs/architecture.md). analysis/ reads MLflow and
# shares two small modules of the sweeps (URLs and their redaction; a command's name and its one-line errors).
MAY_IMPORT = {"trainers": set(), "sweeps": {"batchsweep.trainers"},
              "analysis": {"batchsweep.sweeps.stores.urls", "batchsweep.sweeps.commands"}}


def _imports() -> dict[str, set[str]]:
    """Every module of the three floors (as installed: batchsweep.<floor>...) and the modules of theirs it
    imports, however spelled: `import a.b`, `from a import b`, relative, and inside functions (lazy) alike."""
    paths = {"batchsweep." + ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for package in PACKAGES for p in modules(package)}
    graph = {}
    for name, path in paths.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                module = ".".join(base[:len(base) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module
                found |= {module} | {f"{module}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in paths and m != name}
    return graph


def test_no_import_circle_and_no_import_that_runs_back_up():
    graph = _imports()
    assert len(graph) > 50 and "batchsweep.sweeps.trials.worker" in graph["batchsweep.sweeps.trials.driver"]  # lazy
    circles, index, low, stack = [], {}, {}, []

    def visit(v):  # Tarjan's strongly connected components: each of more than one module is a circle
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, circles
    upward = [f"{m} -> {i}" for m, found in graph.items() for i in found
              if i.split(".")[1] != m.split(".")[1] and not any(
                  i == allowed or i.startswith(allowed + ".") or allowed.startswith(i + ".")  # (its package)
                  for allowed in MAY_IMPORT[m.split(".")[1]])]
    assert not upward, upward


def test_each_copy_of_a_fact_agrees_with_its_source():
    """analysis/ may not import the trainer or the sweeps' logic, so it keeps its own copy of a few names."""
    from batchsweep import trainers
    from batchsweep.analysis import plotting, runs
    from batchsweep.trainers.config import BN_RULES, LR_RULES

    assert runs.DERIVED == trainers.DERIVED
    # the rules a figure splits by, in the order they read: every rule the trainer knows, and no other
    assert sorted(plotting.SPLITS["lr_rule"]) == sorted(LR_RULES)
    assert sorted(plotting.SPLITS["bn_momentum_rule"]) == sorted(BN_RULES)


def test_the_benchmarks_page_is_a_reference_that_names_every_benchmark():
    """docs/benchmarks.md gives each benchmark's command and latest figure; the runs behind them are in
    docs/results/."""
    text = (ROOT / "docs/benchmarks.md").read_text()
    assert len(text.splitlines()) <= 250
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py") if "def main" in p.read_text()}
    missing = [s for s in scripts if f"benchmarks/{s}" not in text]
    assert not missing, missing
    linked = re.findall(r"`(docs/results/[\w.-]+\.md)`", text)
    assert linked and all((ROOT / path).exists() for path in linked)


def test_the_messages_that_docs_reliability_quotes_are_the_commands():
    """Each row of docs/reliability.md's bad-input table whose input is a `sweeps/run.py` flag: the command's
    line is the message quoted there (… stands for what varies)."""
    import shlex

    from batchsweep.sweeps.cli import main as run
    from tests.conftest import in_process
    from batchsweep.trainers.cli import main as train

    rows = [line.split(" | ") for line in (ROOT / "docs/reliability.md").read_text().splitlines()
            if line.startswith("| `--")]
    checked = []
    for cells in rows:
        flags = shlex.split(re.match(r"\| `(--[^`]+)`", cells[0]).group(1))
        quoted = re.match(r"`(error: [^`]+)`", cells[1])
        # (--plan, --workers-per-gpu and --device say what they say after a probe, or where there is no GPU)
        if quoted is None or flags[0] in ("--plan", "--workers-per-gpu", "--device"):
            continue
        if any(f.startswith("hf:") for f in flags) and importlib.util.find_spec("transformers") is None:
            continue  # (without the optional extra the line says to install it: tests/test_shapes.py)
        pattern = ".*".join(re.escape(part) for part in quoted.group(1).split("…"))
        with tempfile.TemporaryDirectory() as folder:
            said = in_process(run, folder, "--study", "accum_lr", *flags, "--dry-run").stderr.strip()
            if "unrecognized arguments" in said:  # a flag of `python trainers/train.py`
                said = in_process(train, folder, *flags).stderr.strip()
        assert re.fullmatch(pattern, said.splitlines()[-1] if said else ""), (flags, said, quoted.group(1))
        checked.append(flags[0])
    assert {"--model", "--dataset", "--set", "--storage", "--study-name", "--sync-bn"} <= set(checked), checked


def test_sweeps_keeps_its_entry_points_at_its_root_and_its_concepts_in_rooms():
    root = sorted(p.name for p in (ROOT / "sweeps").glob("*.py"))
    assert root == ["__init__.py", "__main__.py", "cli.py", "commands.py", "run.py"], root
    rooms = sorted(p.parent.name for p in (ROOT / "sweeps").glob("*/__init__.py"))
    assert rooms == ["audit", "gpus", "launch", "stores", "study", "trials"], rooms


def test_the_tracer_imports_nothing_of_batchsweep():
    """It runs inside the user's script, in whatever interpreter the command names: torch is all it may need."""
    for path in (ROOT / "sweeps/launch/tracer").glob("*.py"):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any(n.split(".")[0] in ("batchsweep", *PACKAGES) for n in names), (path.name, names)


def test_an_installed_batchsweep_claims_one_top_level_name():
    """From a folder outside the checkout, with nothing on PYTHONPATH: the floors are batchsweep.trainers,
    batchsweep.sweeps and batchsweep.analysis, and their folder names are not importable on their own."""
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import importlib.util as u, batchsweep.trainers, batchsweep.sweeps.cli, batchsweep.analysis.cli\n"
            "from batchsweep.trainers import TrainConfig, train\n"
            "print([n for n in ('trainers', 'sweeps', 'analysis') if u.find_spec(n) is not None])")
    with tempfile.TemporaryDirectory() as outside:
        out = subprocess.run([sys.executable, "-c", code], cwd=outside, env=env, capture_output=True, text=True,
                             timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_a_config_followed_from_train_comes_back_to_at_most_10_files_it_left(monkeypatch, data_dir):
    """The walk of benchmarks/walk.py (its docstring gives the rule): a configuration followed from `train`
    through a resumed run. Its setup (device, data, model, optimizer, loss, probes, checkpoint, resume, schedule)
    reads as one path: at most 2 returns, both to loop.py for the schedule."""
    spec = importlib.util.spec_from_file_location("walk", ROOT / "benchmarks" / "walk.py")
    walk = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "walk", walk)  # (its dataclass looks its module up there)
    spec.loader.exec_module(walk)
    from batchsweep import trainers

    stays, setup = walk.walk(trainers, **{**walk.TINY, "data_dir": data_dir})
    path = " > ".join(stay.file for stay in stays)
    assert walk.returns(stays[:setup]) <= 2 and walk.returns(stays) <= 10, path
