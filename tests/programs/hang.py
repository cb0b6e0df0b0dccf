"""A script that never ends on its own: it starts a child (in its process group), writes "PID CHILD_PID" to
the file named by its first argument, and sleeps. Stopping it must stop the child too."""
import os
import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(3600)
