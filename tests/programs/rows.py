"""A script that prints the metric rows of one fault case as JSON lines, as a user's script might.

    python rows.py string      # the last epoch's val_acc printed as text
    python rows.py backwards   # a row of epoch 2.5 printed after epoch 3's
    python rows.py fail        # one row, then exit status 1
    python rows.py mixed       # rows within epochs at their step, between the whole epochs' rows
    python rows.py unplaced    # after epoch 2, a row with no epoch and one with an epoch that is no number
"""
import json
import sys

ROWS = {
    "string": [{"epoch": 1, "val_acc": 0.3}, {"epoch": 2, "val_acc": 0.6}, {"epoch": 3, "val_acc": "0.9"}],
    "backwards": [{"epoch": 1, "val_acc": 0.2}, {"epoch": 3, "val_acc": 0.1}, {"epoch": 2.5, "val_acc": 0.4}],
    "fail": [{"epoch": 1, "val_acc": 0.2}],
    "mixed": [{"epoch": 1, "val_acc": 0.5}, {"epoch": 1.5, "step": 150, "val_acc": 0.6}, {"epoch": 2, "val_acc": 0.7},
              {"epoch": 2.5, "step": 250, "val_acc": 0.8}],
    "unplaced": [{"epoch": 1, "val_acc": 0.5}, {"epoch": 2, "val_acc": 0.7}, {"val_acc": 0.9},
                 {"epoch": "3", "val_acc": 0.95}],
}
for row in ROWS[sys.argv[1]]:
    print(json.dumps(row), flush=True)
if sys.argv[1] == "fail":
    sys.exit("the data is gone")  # (exit status 1)
