"""Running one side of a side-by-side comparison on this shared host (bench/peers.py,
bench/grpo.py): wait for the host to be quiet, run the side's command, and say what it cost and
what else ran meanwhile."""
import os
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_ticks() -> tuple:
    """(busy, total) jiffies of the whole host since boot (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def wait_for_quiet(limit_s: float, idle_needed: float = 0.7) -> float:
    """Waits (at most limit_s) until the host is at least idle_needed idle over a second: other
    work on this shared machine would be measured too. Returns the idle share seen last."""
    deadline = time.monotonic() + limit_s
    while True:
        busy, total = cpu_ticks()
        time.sleep(1.0)
        busy2, total2 = cpu_ticks()
        idle = 1 - (busy2 - busy) / max(total2 - total, 1)
        if idle >= idle_needed or time.monotonic() > deadline:
            return idle
        time.sleep(4.0)


def run_side(cmd: list) -> dict:
    """Runs cmd (from the repository's root; its stderr kept in a file, shown if it fails):
    peak_rss, the bytes of the largest process in its tree; others_cpu, the share of the host's
    CPU time others used meanwhile (busy time not spent by cmd's tree, over cores x wall)."""
    busy, total = cpu_ticks()
    with tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
        _, status, usage = os.wait4(process.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            stderr.seek(0)
            raise SystemExit(f"{' '.join(map(str, cmd))} failed: {stderr.read().decode()[-3000:]}")
    busy2, total2 = cpu_ticks()
    tick = os.sysconf("SC_CLK_TCK")
    own = usage.ru_utime + usage.ru_stime
    return {"peak_rss": usage.ru_maxrss * 1024,
            "others_cpu": max(0.0, ((busy2 - busy) / tick - own) / max((total2 - total) / tick, 1e-9))}


def step_ends():
    """A transformers TrainerCallback timing a peer's steps as the framework times its own: from
    one step's end to the next (the batch's fetch and the logging included; Trainer's
    on_step_begin comes after the fetch). `.times()`: the step times, the first from its begin."""
    from transformers import TrainerCallback

    class StepEnds(TrainerCallback):
        def __init__(self):
            self.ends, self.begin = [], None

        def on_step_begin(self, *_, **__):
            if self.begin is None:
                self.begin = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.ends.append(time.perf_counter())

        def times(self) -> list:
            ends = [self.begin, *self.ends]
            return [b - a for a, b in zip(ends, ends[1:])]

    return StepEnds()
