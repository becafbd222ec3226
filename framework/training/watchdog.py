"""A stuck step fails fast and explains itself, long before the collective timeout.

Every rank runs a daemon thread that watches when a training step, evaluation or checkpoint
save last finished. After `trainer.stall_timeout_s` without one it writes every thread's
Python stack to the rank's log (faulthandler), a one-line report of the framework stage and the
collective the main thread is blocked in (logs/stall.rank<N>.json), waits a few seconds so the
other stuck ranks report too, and ends the process with exit 1; the launcher then prints every
rank's report (stall_message). Compiling is progress, not a stall: torch.compile's start and end
callbacks stop the clock while this rank compiles (a cold inductor cache can take minutes), and
while any rank of the job does (each marks it with logs/compiling.rank<N>: a rank that found a
graph in the cache waits in a collective for a peer that compiles it); after a compile the clock
also gets the compile's duration once more. Stdlib only: the launcher reads the reports without
torch.
"""
import faulthandler
import glob
import json
import logging
import os
import sys
import sysconfig
import threading
import time
from types import FrameType
from typing import Optional

from framework.atomic import atomic_file

log = logging.getLogger("framework")

# How long a rank that reported waits for the others before it exits: stuck ranks stopped
# within a step of each other, and the first to exit would turn the others' stalls into
# lost-peer errors with no stacks.
REPORT_GRACE_S = 5.0
# Taken for good by the watchdog before it ends the process, and held by the main thread while
# it writes the agent's error file (framework.launch.worker): the exit never cuts that file short.
EXIT_LOCK = threading.Lock()
_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
_LAUNCHER = _DISTRIBUTED + "elastic" + os.sep  # the agent's wrapper around every rank's main
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
# framework.parallel.data_parallel's wait for its gradient all-reduces: a collective too. Named,
# not imported, so the launcher (which reads the reports) never loads DTensor.
_DP_WAIT = ("wait_for_all_reduce", os.path.join("framework", "parallel", "data_parallel.py"))


def _in_collective(frame: FrameType) -> bool:
    path = frame.f_code.co_filename
    dp_wait = frame.f_code.co_name == _DP_WAIT[0] and path.endswith(_DP_WAIT[1])
    return (_DISTRIBUTED in path and _LAUNCHER not in path) or dp_wait


def _where(frame: FrameType) -> str:
    """`function (path:line)`, the path relative to the longest sys.path entry holding it."""
    path = frame.f_code.co_filename
    roots = [root.rstrip(os.sep) + os.sep for root in sys.path + [os.getcwd()] if root]
    root = max((r for r in roots if path.startswith(r)), key=len, default=None)
    return f"{frame.f_code.co_name} ({os.path.relpath(path, root) if root else path}:{frame.f_lineno})"


def blocked_in(frame: Optional[FrameType]) -> str:
    """Where a stuck main thread waits: the innermost torch.distributed function (the collective
    or its wait) and the nearest caller outside torch; else the innermost frame outside the
    standard library (a wait on a lock says less than the line that waits)."""
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    if not stack:
        return "unknown (no Python frame)"
    collective = next((f for f in stack if _in_collective(f)), None)
    if collective is None:
        own = next((f for f in stack if not f.f_code.co_filename.startswith(_STDLIB)), stack[0])
        return f"not in a collective: at {_where(own)}"
    caller = next((f for f in stack[stack.index(collective) + 1:] if os.sep + "torch" + os.sep not in f.f_code.co_filename),
                  None)
    return f"collective {_where(collective)}" + (f", called from {_where(caller)}" if caller else "")


def report_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, "logs", f"stall.rank{rank}.json")


def compiling_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, "logs", f"compiling.rank{rank}")


class StallWatchdog:
    """`stage(name)` says what the rank is doing (for the report); `finished()` marks a step,
    evaluation or save done. Both are attribute writes: nothing on the hot path."""

    def __init__(self, timeout_s: Optional[float], rank: int, out_dir: str):
        self.timeout_s, self.rank, self.out_dir = timeout_s, rank, out_dir
        self.current = "starting training"
        self.last_finished = time.monotonic()
        self.compiling_since: Optional[float] = None
        self.said_compiling = False
        self._stop = threading.Event()
        for stale in (report_path(out_dir, rank), compiling_path(out_dir, rank)):  # an earlier attempt's
            if os.path.exists(stale):
                os.remove(stale)
        # torch imported here: the launcher, which reads the reports, never makes a watchdog
        from torch._dynamo import callback_handler

        callback_handler.register_start_callback(self.compile_started)
        callback_handler.register_end_callback(self.compile_ended)
        if timeout_s is not None:
            threading.Thread(target=self._watch, name="stall-watchdog", daemon=True).start()

    def stage(self, name: str) -> None:
        self.current = name

    def finished(self) -> None:
        self.last_finished = time.monotonic()

    def compile_started(self, _args=None) -> None:
        """Rank 0 says so the first time: a first step that compiles (trainer.compile, float8,
        GRPO's compile_decode) waits without a word for up to minutes otherwise."""
        if self.rank == 0 and not self.said_compiling:
            self.said_compiling = True
            log.info("%s: torch.compile is compiling; the first steps wait for it (minutes with a cold inductor "
                     "cache), later ones reuse it", self.current)
        self.compiling_since = time.monotonic()
        open(compiling_path(self.out_dir, self.rank), "w").close()

    def compile_ended(self, _args=None) -> None:
        """The clock restarts after the compile plus as long again (peers may still compile)."""
        now = time.monotonic()
        self.last_finished = now + (now - self.compiling_since if self.compiling_since is not None else 0.0)
        self.compiling_since = None
        if os.path.exists(compiling_path(self.out_dir, self.rank)):
            os.remove(compiling_path(self.out_dir, self.rank))

    def _peer_compiling(self) -> bool:
        return bool(glob.glob(compiling_path(self.out_dir, "*")))

    def close(self) -> None:
        self._stop.set()
        from torch._dynamo import callback_handler

        callback_handler.remove_start_callback(self.compile_started)
        callback_handler.remove_end_callback(self.compile_ended)

    def _watch(self) -> None:
        interval = min(1.0, self.timeout_s / 5)
        while not self._stop.wait(interval):
            if self.compiling_since is not None or self._peer_compiling():
                self.last_finished = max(self.last_finished, time.monotonic())
                continue
            idle = time.monotonic() - self.last_finished
            if idle >= self.timeout_s:
                self._report(idle)

    def _report(self, idle: float) -> None:
        main = sys._current_frames().get(threading.main_thread().ident)
        log_path = os.path.join(self.out_dir, "logs", f"rank{self.rank}.log")
        report = {"rank": self.rank, "stage": self.current, "blocked_in": blocked_in(main),
                  "idle_s": round(idle, 1), "stacks": os.path.relpath(log_path, self.out_dir)}
        log.error("stalled: nothing finished for %.0f s (trainer.stall_timeout_s=%s) during %s; %s; "
                  "every thread's stack follows", idle, self.timeout_s, report["stage"], report["blocked_in"])
        with open(log_path, "a") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        with atomic_file(report_path(self.out_dir, self.rank)) as f:
            json.dump(report, f)
        time.sleep(REPORT_GRACE_S)
        EXIT_LOCK.acquire()
        logging.shutdown()
        os._exit(1)


def stall_message(out_dir: str) -> Optional[str]:
    """The launcher's one line from the ranks' stall reports, or None when no rank stalled."""
    reports = []
    for path in glob.glob(os.path.join(out_dir, "logs", "stall.rank*.json")):
        with open(path) as f:
            reports.append(json.load(f))
    if not reports:
        return None
    reports.sort(key=lambda r: r["rank"])
    idle = max(r["idle_s"] for r in reports)
    per_rank = "; ".join(f"rank {r['rank']}: {r['stage']}, {r['blocked_in']}" for r in reports)
    stacks = ", ".join(r["stacks"] for r in reports)
    return (f"stalled: nothing finished for {idle:.0f} s (trainer.stall_timeout_s); {per_rank}; "
            f"every thread's stack in {stacks}")
