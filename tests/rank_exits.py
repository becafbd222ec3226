"""A rank that only ends as told, for tests of the launcher's failure report and the zygote:
`python -m tests.rank_exits MODE [ARG]`.

    sigkill RANK  rank RANK kills itself with SIGKILL; the others wait to be stopped
    raise RANK    rank RANK writes its error to the agent's error file and is slow to exit (it is
                  stopped by the agent's SIGTERM); the others then fail as a rank whose collective
                  lost its peer does
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
elif mode == "raise":
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
    if os.environ["RANK"] == sys.argv[2]:
        ErrorHandler().record_exception(RuntimeError(f"boom on rank {sys.argv[2]}"))
        time.sleep(120)
    time.sleep(0.5)
    ErrorHandler().record_exception(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    sys.exit(1)
elif mode == "exit":
    sys.exit(int(sys.argv[2]))
elif mode == "sleep":
    print(os.getpid(), flush=True)
    time.sleep(120)
