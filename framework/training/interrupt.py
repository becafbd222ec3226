"""Ctrl-C and SIGTERM (kill, torchrun's or Slurm's stop, a preemption) end a run cleanly: every
rank finishes the same step, saves a checkpoint there (when checkpoint.every is set), and the run
ends with its summary. A second signal, a second or more after the first, stops at once (one
signal can arrive twice within ms: Slurm signals every process of a step, and the zygote's
client relays what it gets to its rank).

The ranks are signalled one by one (by the launcher, torchrun or Slurm), each at another point of
its step, and a rank that stopped alone would leave the others waiting in a collective. So after
each step every rank puts whether it was signalled into an all-reduce over the whole world, on a
gloo group of its own, started without waiting and read after the next step: all ranks stop after
the same step (the one after the first signal reached a rank), and no step waits for it.
"""
import logging
import os
import signal
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger("framework")

STOPPING = (signal.SIGINT, signal.SIGTERM)
REPEAT_AFTER_S = 1.0  # a signal again sooner is the first one's other copy


class Interrupt:
    """Used as a context around the loop (it holds the signal handlers); `agreed()` after each step."""

    def __init__(self, rank: int):
        self.rank = rank
        self.received = 0  # the first signal's number, 0 until one arrives
        self.received_at = 0.0
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.group = dist.new_group(backend="gloo") if distributed else None
        self.in_flight: Optional[tuple] = None  # (work, tensor) of the last step's all-reduce
        self.previous = {}

    def __enter__(self) -> "Interrupt":
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only (a test may train in another)
        for number in STOPPING:
            self.previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, exc_type, *_) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        if self.in_flight is not None and exc_type is None:  # every rank started it: every rank waits for it
            self.in_flight[0].wait()
            self.in_flight = None

    def _handle(self, number: int, _frame) -> None:
        if self.received and time.monotonic() - self.received_at < REPEAT_AFTER_S:
            return
        if self.received:  # the second: stop now, as without this handler
            signal.signal(number, signal.SIG_DFL)
            if number == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), number)
            return
        self.received, self.received_at = number, time.monotonic()
        if self.rank == 0:
            log.info("%s received: every rank stops after the next step and saves a checkpoint there "
                     "(when checkpoint.every is set); send it again to stop at once", signal.Signals(number).name)

    def agreed(self) -> Optional[str]:
        """After a step: the name of the signal some rank had received by the previous step (the
        same answer on every rank), else None."""
        if self.group is None:
            return signal.Signals(self.received).name if self.received else None
        answer = None
        if self.in_flight is not None:
            work, flag = self.in_flight
            work.wait()
            answer = signal.Signals(int(flag)).name if int(flag) else None
        flag = torch.tensor([self.received], dtype=torch.int32)
        self.in_flight = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag)
        return answer
