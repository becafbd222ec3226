"""What a SLURM sweep says while it waits: every job's state changes on the console (PENDING
with Slurm's reason, RUNNING on which nodes, how it ended), a job that can never start refused
before it is submitted (sbatch --test-only) or, when only the scheduler knows (a per-job limit),
cancelled with one line instead of waiting in silence.

States come from squeue and scontrol, which work on every cluster; submitit polls sacct, which
without accounting fails and warns on every poll.
"""
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# Pending reasons no wait resolves: the job asks for more than its partition, QOS or
# association allows any one job, or for nodes that are down.
HOPELESS = {"PartitionNodeLimit", "PartitionTimeLimit", "PartitionConfig", "ReqNodeNotAvail", "BadConstraints",
            "InvalidAccount", "InvalidQOS", "AccountNotAllowed", "QOSNotAllowed", "NodeDown"}
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE"}


def hopeless(reason: str) -> bool:
    return reason in HOPELESS or (reason.startswith(("QOSMax", "AssocMax", "AssocGrp", "QOSGrp")) and "PerJob" in reason)


def sbatch_refusal(partition: Optional[str], nodes: int, tasks_per_node: int, extra: Sequence[str] = ()) -> Optional[str]:
    """sbatch --test-only's refusal of this allocation (one line), or None when Slurm could run it."""
    cmd = ["sbatch", "--test-only", f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}", *extra, "--wrap=true"]
    if partition:
        cmd.insert(2, f"--partition={partition}")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if result.returncode == 0:
        return None
    return " ".join(result.stderr.split()) or f"sbatch --test-only exited {result.returncode}"


def _scontrol_state(job_id: str) -> Tuple[str, str, str]:
    result = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=60)
    fields = dict(item.split("=", 1) for item in result.stdout.split() if "=" in item)
    if result.returncode != 0 or "JobState" not in fields:
        return "GONE", "", ""  # no longer known to the controller: ended a while ago
    return fields["JobState"], fields.get("Reason", ""), fields.get("NodeList", "")


def job_states(job_ids: Sequence[str]) -> Dict[str, Tuple[str, str, str]]:
    """job id -> (state, reason, nodes), from one squeue call (scontrol for a job squeue no
    longer lists)."""
    result = subprocess.run(["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", "%i|%T|%r|%N"],
                            capture_output=True, text=True, timeout=60)
    states = {}
    for line in result.stdout.splitlines() if result.returncode == 0 else []:
        job_id, state, reason, nodes = line.split("|", 3)
        states[job_id] = (state, reason, nodes)
    return {job_id: states.get(job_id) or _scontrol_state(job_id) for job_id in job_ids}


def describe(state: str, reason: str, nodes: str) -> str:
    if state == "PENDING":
        return f"PENDING ({reason})" if reason and reason != "None" else "PENDING"
    if state == "RUNNING":
        return f"RUNNING on {nodes}"
    return state


def watch(jobs: Dict[str, str], poll_s: float = 1.0, say: Callable[[str], None] = None,
          cancel: Callable[[str], None] = None) -> Dict[str, str]:
    """Until every job ended: print each job's state when it changes (`jobs`: id -> label);
    cancel one whose pending reason cannot resolve. Returns id -> how it ended: its final
    state, or the line saying why it was cancelled."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    cancel = cancel or (lambda job_id: subprocess.run(["scancel", job_id], capture_output=True, timeout=60))
    shown: Dict[str, str] = {}
    ended: Dict[str, str] = {}
    while len(ended) < len(jobs):
        waiting: List[str] = [job_id for job_id in jobs if job_id not in ended]
        for job_id, (state, reason, nodes) in job_states(waiting).items():
            line = describe(state, reason, nodes)
            if shown.get(job_id) != line:
                say(f"slurm job {job_id} ({jobs[job_id]}): {line}")
                shown[job_id] = line
            if state == "PENDING" and hopeless(reason):
                cancel(job_id)
                ended[job_id] = f"slurm job {job_id} can never start: pending with reason {reason}; cancelled"
                say(ended[job_id])
            elif state in TERMINAL or state == "GONE":
                ended[job_id] = state
        if len(ended) < len(jobs):
            time.sleep(poll_s)
    return ended
