"""A script that does what scripts do and a launcher must survive:

    python rude.py bytes           # bytes that are not UTF-8, and a line of 10 MB, among its rows
    python rude.py stdin           # reads its standard input to the end (a prompt, a REPL)
    python rude.py deaf PIDS       # ignores SIGTERM, as does the child it starts; writes "PID CHILD_PID" to
                                   # PIDS and sleeps an hour
"""
import json
import os
import signal
import subprocess
import sys
import time

mode = sys.argv[1]
if mode == "bytes":
    out = sys.stdout.buffer
    out.write(b"caf\xe9 \xff\xfe not UTF-8\n" + b"x" * 10 * 2 ** 20 + b"\n")
    out.write(json.dumps({"epoch": 1, "val_acc": 0.5}).encode() + b"\n")
    out.flush()
elif mode == "stdin":
    read = sys.stdin.read()  # /dev/null: "" at once; a terminal or a pipe left open would wait forever
    print(json.dumps({"epoch": 1, "val_acc": 0.5, "stdin_bytes": len(read)}))
elif mode == "deaf":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (inherited by the child: ignored signals stay ignored)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    time.sleep(3600)
