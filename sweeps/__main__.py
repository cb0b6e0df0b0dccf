"""`python -m batchsweep.sweeps ...`: the same as `python sweeps/run.py ...`."""
import sys

from batchsweep.sweeps import commands
from batchsweep.sweeps.cli import main

commands.started = ("run", "python -m batchsweep.sweeps")
sys.exit(main())
