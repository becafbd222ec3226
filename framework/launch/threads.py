"""How many CPU threads each rank's torch uses: by default the cores this process may run on,
shared out among the ranks on this host, at least 1 each. One rank on 2 cores gets 2 threads
(1.8x the tokens/s of 1 thread, bench/README.md); 4 ranks on 2 cores get 1.

Who decides, first match wins:
1. OMP_NUM_THREADS exported by the user (a self-launched run's launcher sees it as it started;
   under torchrun, which exports 1 itself when it starts several ranks and the user did not,
   that default counts as unset);
2. `launcher.threads_per_rank`;
3. the rule: cores available (os.sched_getaffinity) // ranks on this host.

The launcher passes the number to its ranks as OMP_NUM_THREADS; each rank applies it with
torch.set_num_threads before its first op (a rank forked from the zygote inherits the zygote's
thread settings, not the variable). Stdlib only: the launcher imports it before torch.
"""
import os
from typing import Optional, Tuple

# What the user exported, read when this module is first imported (before the launcher sets the
# variable for its ranks).
EXPORTED = os.environ.get("OMP_NUM_THREADS")


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def torchrun_default(value: Optional[str]) -> bool:
    """torchrun exports OMP_NUM_THREADS=1 when it starts several ranks per node and the user
    exported nothing; that is its default, not the user's choice."""
    return value == "1" and "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1


def threads_per_rank(configured: Optional[int], ranks_on_host: int, exported: Optional[str]) -> Tuple[int, str]:
    """(threads, why) for each of `ranks_on_host` ranks."""
    if exported and not torchrun_default(exported):
        return int(exported), "OMP_NUM_THREADS"
    if configured:
        return configured, "launcher.threads_per_rank"
    cores = available_cores()
    return max(1, cores // ranks_on_host), f"{cores} cores / {ranks_on_host} ranks"
