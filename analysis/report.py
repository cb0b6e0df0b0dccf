"""Write a study's report: `python analysis/report.py --study accum_lr` (see --help)."""
import sys

from batchsweep.analysis.cli import main

if __name__ == "__main__":
    sys.exit(main())
