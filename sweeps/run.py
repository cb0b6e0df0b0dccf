"""Run a study: `python sweeps/run.py --study accum_lr` (see --help)."""
import sys

from sweeps.cli import main

if __name__ == "__main__":
    sys.exit(main())
