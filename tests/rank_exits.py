"""A rank that only ends as told, for tests of the launcher's failure report and the zygote:
`python -m tests.rank_exits MODE [ARG]`.

    sigkill RANK  rank RANK kills itself with SIGKILL; the others wait to be stopped
    exit CODE     exit with CODE
    sleep         print the pid, then sleep until signalled
"""
import os
import signal
import sys
import time

mode = sys.argv[1]
if mode == "sigkill":
    if os.environ["RANK"] == sys.argv[2]:
        time.sleep(0.3)  # the others are up and waiting
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
elif mode == "exit":
    sys.exit(int(sys.argv[2]))
elif mode == "sleep":
    print(os.getpid(), flush=True)
    time.sleep(120)
