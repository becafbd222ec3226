"""How many CPU threads each rank's torch uses, and on which cores: by default the cores this
process may run on, shared out among the ranks on this host, at least 1 each. One rank on 2 cores
gets 2 threads (1.8x the tokens/s of 1 thread, bench/README.md); 4 ranks on 2 cores get 1.

With `launcher.bind_cores` (null: on for compiled runs on CPU meshes) each rank is bound to its own
share: local rank r to the `threads` cores after the previous ranks' (round the host's cores again
when ranks x threads exceed them). Unbound, the scheduler moves a rank's main thread between cores
about 15 times a second, and it waits longer in TP's collectives: measured on 2 cores, compiled
lm_small 1x2 ran 7% faster bound and 2x2 5%; 2x1 and eager 1x2 the same; eager 2x2 5-10% slower
(bench/README.md).

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
from contextlib import contextmanager
from typing import Iterator, List, Optional, Tuple

# What the user exported, read when this module is first imported (before the launcher sets the
# variable for its ranks).
EXPORTED = os.environ.get("OMP_NUM_THREADS")
# Set by a self-launching launcher for its ranks: why they run OMP_NUM_THREADS threads, and
# whether each is bound to its own cores ("1" or "0").
DECIDED = "FRAMEWORK_THREADS_DECIDED_BY"
BIND = "FRAMEWORK_BIND_CORES"


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def torchrun_default(value: Optional[str]) -> bool:
    """torchrun exports OMP_NUM_THREADS=1 when it starts several ranks per node and the user
    exported nothing; that is its default, not the user's choice."""
    return value == "1" and "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1


def threads_per_rank(configured: Optional[int], ranks_on_host: int, exported: Optional[str]) -> Tuple[int, str]:
    """(threads, why) for each of `ranks_on_host` ranks."""
    if exported and not torchrun_default(exported):
        return int(exported), "OMP_NUM_THREADS exported"
    if configured:
        return configured, "launcher.threads_per_rank"
    return max(1, available_cores() // ranks_on_host), "this host's cores shared out among its ranks"


def binds_cores(cfg) -> bool:
    """launcher.bind_cores, whose null means: bind compiled runs on CPU meshes (where the ranks'
    own threads compute), not eager ones (measured on 2 cores: eager 2x2 5-10% slower bound,
    compiled 1x2 7% faster; bench/README.md), nor GPU ones. `cfg`: the run's config."""
    configured = cfg.launcher.bind_cores
    return configured if configured is not None else cfg.mesh.device_type == "cpu" and cfg.trainer.compile != "none"


def cores_of_rank(cores: List[int], local_rank: int, threads: int) -> List[int]:
    """The cores local rank `local_rank` is bound to: `threads` of `cores` after the previous
    local ranks' (wrapping round when the ranks' threads outnumber the cores)."""
    return sorted({cores[(local_rank * threads + i) % len(cores)] for i in range(threads)})


@contextmanager
def for_ranks(configured: Optional[int], ranks_on_host: int, bind: bool = False) -> Iterator[int]:
    """The launcher's environment while it starts its ranks (the elastic agent hands them
    OMP_NUM_THREADS): each rank's thread count, why, and whether each is bound to its cores."""
    threads, why = threads_per_rank(configured, ranks_on_host, EXPORTED)
    saved = {key: os.environ.get(key) for key in ("OMP_NUM_THREADS", DECIDED, BIND)}
    os.environ.update({"OMP_NUM_THREADS": str(threads), DECIDED: why, BIND: "1" if bind else "0"})
    try:
        yield threads
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def apply_in_rank(configured: Optional[int], bind: bool) -> str:
    """In a rank, before its first op: set torch's thread count and bind the rank to its cores
    (both decided by the launcher, or here from `configured` and `bind` under torchrun or a SLURM
    task) and return the start-up line saying it (the cores: this rank's)."""
    import torch

    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = available_cores()
    if os.environ.get(DECIDED):
        threads, why = int(os.environ["OMP_NUM_THREADS"]), os.environ[DECIDED]
        bind = os.environ.get(BIND) == "1"
    else:
        threads, why = threads_per_rank(configured, ranks, os.environ.get("OMP_NUM_THREADS"))
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for processes the rank starts (data loader workers)
    torch.set_num_threads(threads)
    line = (f"{ranks} rank{'s' if ranks > 1 else ''} on {cores} cores: {threads} "
            f"thread{'s' if threads > 1 else ''} each ({why})")
    if bind and hasattr(os, "sched_setaffinity"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        mine = cores_of_rank(sorted(os.sched_getaffinity(0)), local, threads)
        os.sched_setaffinity(0, mine)  # what it starts later inherits it: gloo's threads, data loader workers
        line += f"; each rank bound to its share of the cores (local rank {local}: {mine}; launcher.bind_cores)"
    return line
