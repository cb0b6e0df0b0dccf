"""A script that keeps a checkpoint under a fixed name in its current folder, as many do (nanoGPT's out/ckpt.pt),
or in its trial's own folder: it writes its value there, reads the file back and reports what it read. Sharing
the file, it waits until two trials have written it (an event file each, in EVENTS) before reading: the two
report one value.

    python clash.py VALUE EVENTS SHARED TRIAL_DIR    # SHARED: True (./checkpoint.txt) or False (TRIAL_DIR's)
"""
import json
import os
import sys
import time

value, events, shared, trial_dir = sys.argv[1:5]
if trial_dir != os.environ["BATCHSWEEP_TRIAL_DIR"] or not os.path.isdir(trial_dir):
    sys.exit(f"{{trial_dir}} is {trial_dir}, BATCHSWEEP_TRIAL_DIR {os.environ['BATCHSWEEP_TRIAL_DIR']}")
path = "checkpoint.txt" if shared == "True" else os.path.join(trial_dir, "checkpoint.txt")
with open(path, "w") as f:
    f.write(value)
if shared == "True":
    os.close(os.open(os.path.join(events, f"written-{value}"), os.O_CREAT | os.O_EXCL))
    deadline = time.monotonic() + 120
    while len(os.listdir(events)) < 2:
        if time.monotonic() > deadline:
            sys.exit("the other trial never wrote")
        time.sleep(0.05)
with open(path) as f:
    read = f.read()
if read != value:
    print(f"CLASH: wrote {value}, read {read}")
print(json.dumps({"epoch": 1, "val_acc": float(read) / 10}), flush=True)
