"""batchsweep's overhead per [program] trial: a study of N trials of a script against the same N commands
run by hand, one after another. The overhead is everything around the script (claiming the point, the MLflow
run, launching, reading the output, sampling memory, recording the outcome): the study's time from its first
trial's start to its last trial's end, divided by N, less the mean time of the command by hand.
Prints `overhead_share=<of the script's time>` and, on the last line, `overhead_s=<seconds per trial>`.
The two sides are separate processes, one set after the other, not pairs: the script's --seconds are wall-clock
time, which a busy machine does not stretch, so only the interpreter's start varies between them; the range of
each side is printed (the commands by hand; the trials start to start), and the figure is resolved where the
two ranges do not overlap.

    python benchmarks/program_overhead.py [--trials 10] [--seconds 10]

The script prints a JSON row every 0.1 s and busy-works in between, for --seconds seconds.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna

SCRIPT = '''import json, sys, time
start, rows = time.perf_counter(), 0
while time.perf_counter() - start < float(sys.argv[1]):
    while time.perf_counter() - start < 0.1 * (rows + 1):
        pass
    rows += 1
    print(json.dumps({"step": rows, "val_acc": rows / 1000}), flush=True)
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        (work / "script.py").write_text(SCRIPT)
        by_hand = []
        for _ in range(args.trials):
            start = time.perf_counter()
            subprocess.run([sys.executable, "script.py", str(args.seconds)], cwd=work, check=True,
                           stdout=subprocess.DEVNULL)
            by_hand.append(time.perf_counter() - start)
        (work / "study.toml").write_text(f'''name = "overhead"
[program]
command = ["{{python}}", "script.py", "{args.seconds}"]
[grid]
repeat = {list(range(args.trials))}
''')
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "sweeps" / "run.py"),
                               "--study", "study.toml", "--workers", "1", "--no-report"], cwd=work,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"error: the study failed ({proc.stderr.strip().splitlines()[-1:]}): nothing measured")
        trials = optuna.load_study(study_name="overhead", storage=f"sqlite:///{work}/mlruns/optuna.db").trials
        complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
        if len(complete) != args.trials:
            raise SystemExit(f"error: {len(complete)} of {args.trials} trials completed: nothing measured")
        span = (max(t.datetime_complete for t in trials) - min(t.datetime_start for t in trials)).total_seconds()
        starts = sorted(t.datetime_start for t in trials)
        cycles = [(b - a).total_seconds() for a, b in zip(starts, starts[1:])]
    hand = sum(by_hand) / len(by_hand)
    per_trial = span / args.trials
    print(f"by hand: {hand:.3f} s a command; in the study: {per_trial:.3f} s a trial ({args.trials} trials of a "
          f"{args.seconds:g}-s script)")
    print(f"ranges: by hand {min(by_hand):.3f} to {max(by_hand):.3f} s; in the study, start to start, "
          f"{min(cycles or [span]):.3f} to {max(cycles or [span]):.3f} s")
    print(f"overhead_share={(per_trial - hand) / hand:.4f}")
    print(f"overhead_s={per_trial - hand:.3f}")


if __name__ == "__main__":
    main()
