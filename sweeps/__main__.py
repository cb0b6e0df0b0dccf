"""`python -m sweeps ...`: the same as `python sweeps/run.py ...`."""
import sys

from sweeps import commands
from sweeps.cli import main

commands.started = ("run", "python -m sweeps")
sys.exit(main())
