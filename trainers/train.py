"""Train one configuration: `python trainers/train.py --physical-batch 32 --accum-steps 4 ...`."""
import sys

from batchsweep.trainers import interrupt
from batchsweep.trainers.cli import main

if __name__ == "__main__":
    interrupt.trap()  # a process's own: Ctrl-C is never lost (trainers/interrupt.py)
    sys.exit(main())
