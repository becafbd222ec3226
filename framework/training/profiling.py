"""Where a step's time goes, per rank: torch.profiler over a few steps, each rank's trace
written where TensorBoard's profiler plugin and Perfetto open it, and a short summary: the top
operators by self time and the share of the profiled steps spent in collectives.

Used by `python -m framework.inspect profile` (a few steps, nothing else) and by
`trainer.profile_steps` inside a normal run (the steps after the first, which compiles and
warms caches).
"""
import os
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional

from torch.profiler import ProfilerActivity, profile, schedule

# Prefixes of communication operators' names: c10d's ops (DataParallel's all-reduces), the
# functional collectives and their waits (DTensor's), the backends' own events. Prefixes, not
# substrings: aten::broadcast_tensors is not a collective.
COLLECTIVE_PREFIXES = ("c10d::", "_c10d_functional::", "gloo:", "nccl:", "record_param_comms")


def trace_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, "profile", f"rank{rank}.pt.trace.json")


@contextmanager
def profiled(out_dir: str, rank: int, steps: int, skip_first: int = 1) -> Iterator[Optional[profile]]:
    """torch.profiler over `steps` steps after `skip_first` (call .step() after each step);
    the trace goes to out_dir/profile/rank<N>.pt.trace.json."""
    if not steps:
        yield None
        return
    os.makedirs(os.path.dirname(trace_path(out_dir, rank)), exist_ok=True)
    # kineto's own lines (profiler_start / profiler_stop on stderr, every rank) off unless asked for;
    # it reads the variable when the first profiler starts
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    # the skipped steps are the schedule's warm-up (torch warns when it has none)
    with profile(activities=[ProfilerActivity.CPU],
                 schedule=schedule(wait=max(0, skip_first - 1), warmup=min(1, skip_first), active=steps, repeat=1),
                 on_trace_ready=lambda prof: prof.export_chrome_trace(trace_path(out_dir, rank))) as prof:
        yield prof


def summary(prof: profile, top: int = 8) -> Dict[str, object]:
    """The top operators by self CPU time, and the share of the profiled steps' time that
    collectives took (their self time, over the steps' total)."""
    events = prof.key_averages()
    steps = [e for e in events if e.key.startswith("ProfilerStep")]
    step_us = sum(e.cpu_time_total for e in steps)
    ops = [e for e in events if not e.key.startswith("ProfilerStep")]
    collective_us = sum(e.self_cpu_time_total for e in ops if e.key.startswith(COLLECTIVE_PREFIXES))
    ranked = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {"step_ms": step_us / 1000 / max(1, sum(e.count for e in steps)),
            "collective_share": collective_us / step_us if step_us else 0.0,
            "top": [(e.key, e.self_cpu_time_total / 1000, e.count) for e in ranked]}


def format_summary(rank: int, result: Dict[str, object], trace: str) -> List[str]:
    lines = [f"rank {rank}: {result['step_ms']:.1f} ms per step, {100 * result['collective_share']:.1f}% of it in "
             f"collectives; trace {trace}"]
    lines += [f"    {ms:9.2f} ms  {count:6d}x  {name}" for name, ms, count in result["top"]]
    return lines
