"""`python -m sweeps ...`: the same as `python sweeps/run.py ...`."""
import sys

from sweeps.cli import main

sys.exit(main())
