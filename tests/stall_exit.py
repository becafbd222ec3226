"""`python -m tests.stall_exit OUT_DIR`: a stalled rank whose main thread fails (a collective
whose peer exited) and writes the agent's error file while its stall watchdog ends the process.
The write is slowed past the watchdog's grace; the file must still come out whole."""
import json
import os
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import record

from framework.launch.worker import ErrorFileUnderExitLock
from framework.training import watchdog

watchdog.REPORT_GRACE_S = 0.2


def _slow_dump(data, fp) -> None:
    text = json.dumps(data)
    fp.write(text[:10])
    fp.flush()
    time.sleep(1.0)
    fp.write(text[10:])


def stall_then_fail(out_dir: str) -> None:
    os.makedirs(os.path.join(out_dir, "logs"))
    watchdog.StallWatchdog(0.2, 0, out_dir)
    while not os.path.exists(watchdog.report_path(out_dir, 0)):
        time.sleep(0.01)
    json.dump = _slow_dump  # the error file's writer (the report is written already)
    raise RuntimeError("connection closed by peer")


if __name__ == "__main__":
    record(stall_then_fail, ErrorFileUnderExitLock())(sys.argv[1])
