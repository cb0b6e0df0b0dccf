"""Train one configuration: `python trainers/train.py --physical-batch 32 --accum-steps 4 ...`."""
import sys

from trainers.cli import main

if __name__ == "__main__":
    sys.exit(main())
