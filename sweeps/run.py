"""Run a study: `python sweeps/run.py --study accum_lr` (see --help)."""
import sys

from batchsweep.sweeps.cli import main
from batchsweep.trainers import interrupt

if __name__ == "__main__":
    interrupt.trap()  # a process's own: Ctrl-C is never lost (trainers/interrupt.py)
    sys.exit(main())
