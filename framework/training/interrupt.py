"""Ctrl-C and SIGTERM (kill, torchrun's or Slurm's stop, a preemption) end a run cleanly: every
rank finishes the same step, saves a checkpoint there (when checkpoint.every is set), and the run
ends with its summary. A second signal, a second or more after the first, stops at once (one
signal can arrive twice within ms: Slurm signals every process of a step, and the zygote's
client relays what it gets to its rank).

The ranks are signalled one by one (by the launcher, torchrun or Slurm), each at another point of
its step, and a rank that stopped alone would leave the others waiting in a collective. So every
few steps the ranks compare notes: an all-reduce over the whole world, on a gloo group of its own,
of whether each was signalled; all ranks then stop after the same step. It is blocking, between
steps, never running beside a step's own collectives. A comparison costs about 1.5 ms on 2 busy
cores (made every step, it took the seed MLP's 1.1 ms 2x1 step to 2.8 ms), so after the first
steps the ranks make one per CHECK_EVERY_S of the slowest rank's step time: every step for steps
of 0.5 s or more, about every 450 steps for the seed's. A signal is acted on within that.
"""
import logging
import os
import signal
import threading
import time
from typing import Optional, Tuple

import torch
import torch.distributed as dist

log = logging.getLogger("framework")

STOPPING = (signal.SIGINT, signal.SIGTERM)
REPEAT_AFTER_S = 1.0  # a signal again sooner is the first one's other copy
CHECK_EVERY_S = 0.5  # of training between two comparisons of notes
DECIDE_AT = 3  # the step whose time (the slowest rank's) sets how many steps that is (step 1 compiles)


class Interrupt:
    """Used as a context around the loop (it holds the signal handlers); `agreed()` after each step."""

    def __init__(self, rank: int, signals: Tuple[int, ...] = STOPPING):
        """signals: those that stop the ranks together (the others keep their default action)."""
        self.rank, self.signals = rank, signals
        self.received = 0  # the first signal's number, 0 until one arrives
        self.received_at = 0.0
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.group = dist.new_group(backend="gloo") if distributed else None
        self.every = 1  # steps between comparisons, until DECIDE_AT's says
        self.steps, self.last = 0, time.monotonic()
        self.previous = {}

    def __enter__(self) -> "Interrupt":
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only (a test may train in another)
        for number in self.signals:
            self.previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *_) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)  # None: set outside Python

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
            log.info("%s received: the ranks stop together within a few steps and save a checkpoint there "
                     "(when checkpoint.every is set); send it again, a second later, to stop at once",
                     signal.Signals(number).name)

    def agreed(self) -> Optional[str]:
        """After each step: the name of the signal some rank has received, when the ranks compare
        notes at this step (the same answer on every rank), else None."""
        self.steps += 1
        now = time.monotonic()
        step_us, self.last = int((now - self.last) * 1e6), now
        if self.group is None:
            return signal.Signals(self.received).name if self.received else None
        if self.steps % self.every:
            return None
        notes = torch.tensor([self.received, step_us], dtype=torch.int64)
        dist.all_reduce(notes, op=dist.ReduceOp.MAX, group=self.group)
        received, slowest_us = notes.tolist()
        if self.steps == DECIDE_AT:
            self.every = max(1, int(CHECK_EVERY_S * 1e6) // max(slowest_us, 1))
        return signal.Signals(received).name if received else None
