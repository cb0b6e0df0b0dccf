"""A script that double-forks a daemon into a session of its own (as a script that starts a server or a data
service might): the daemon writes its PID to the file named by the first argument and sleeps an hour; the script
waits for that file, reports one epoch and ends, leaving the daemon behind. Given a second argument HOLD that
names no file yet, the script writes its own PID there once the daemon is up, and holds (sleeps an hour)."""
import json
import os
import sys
import time

pid_file = sys.argv[1]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # the daemon: no parent, no session, no output of the script's
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
        os.execvp("sleep", ["sleep", "3600"])
    os._exit(0)
os.wait()
deadline = time.monotonic() + 60
while not os.path.exists(pid_file):  # the daemon is up (an event, not a guess of how long it takes)
    if time.monotonic() > deadline:
        sys.exit("the daemon never wrote its pid")
    time.sleep(0.01)
if len(sys.argv) > 2 and not os.path.exists(sys.argv[2]):
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    time.sleep(3600)
print(json.dumps({"epoch": 1, "val_acc": 0.5}), flush=True)
