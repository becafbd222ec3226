"""Ctrl-C and SIGTERM (kill, torchrun's or Slurm's stop, a preemption) end a run cleanly: every
rank finishes the same step, saves a checkpoint there (when checkpoint.every is set), and the run
ends with its summary. A second signal, a second or more after the first, stops at once (one
signal can arrive twice within ms: Slurm signals every process of a step, and the zygote's
client relays what it gets to its rank).

The ranks are signalled one by one (by the launcher, torchrun or Slurm), each at another point of
its step, and a rank that stopped alone would leave the others waiting in a collective. So every
few steps the ranks compare notes: each puts whether it was signalled into an all-reduce over the
whole world, on a gloo group of its own, started without waiting and read after the next step;
all ranks then stop after the same step. A comparison costs about 1.5 ms on 2 busy cores (seed
MLP on 2x1: 2.8 ms steps instead of 1.1 ms when made every step), so after the first steps the
ranks make one per CHECK_EVERY_S of the slowest rank's step time: every step for steps of 0.2 s
or more, about every 180 steps for the seed's. A signal is acted on within that and two steps.
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
CHECK_EVERY_S = 0.2  # of training between two comparisons of notes
DECIDE_AT = 3  # the step whose time (the slowest rank's) sets how many steps that is (step 1 compiles)


class Interrupt:
    """Used as a context around the loop (it holds the signal handlers); `agreed()` after each step."""

    def __init__(self, rank: int):
        self.rank = rank
        self.received = 0  # the first signal's number, 0 until one arrives
        self.received_at = 0.0
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.group = dist.new_group(backend="gloo") if distributed else None
        self.in_flight: Optional[tuple] = None  # (work, tensor, step) of the last all-reduce started
        self.every = 1  # steps between comparisons, until DECIDE_AT's says
        self.steps, self.last = 0, time.monotonic()
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
            log.info("%s received: the ranks stop together within a few steps and save a checkpoint there "
                     "(when checkpoint.every is set); send it again, a second later, to stop at once",
                     signal.Signals(number).name)

    def agreed(self) -> Optional[str]:
        """After each step: the name of the signal some rank had received when the ranks last
        compared notes (the same answer on every rank), else None."""
        self.steps += 1
        now = time.monotonic()
        step_us, self.last = int((now - self.last) * 1e6), now
        if self.group is None:
            return signal.Signals(self.received).name if self.received else None
        answer = None
        if self.in_flight is not None:
            work, notes, started_at = self.in_flight
            work.wait()
            self.in_flight = None
            received, slowest_us = notes.tolist()
            answer = signal.Signals(received).name if received else None
            if started_at == DECIDE_AT:
                self.every = max(1, int(CHECK_EVERY_S * 1e6) // max(slowest_us, 1))
        if answer is None and self.steps % self.every == 0:
            notes = torch.tensor([self.received, step_us], dtype=torch.int64)
            work = dist.all_reduce(notes, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            self.in_flight = (work, notes, self.steps)
        return answer
