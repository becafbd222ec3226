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
# association allows any one job.
HOPELESS = {"PartitionTimeLimit", "PartitionConfig", "BadConstraints", "InvalidAccount", "InvalidQOS",
            "AccountNotAllowed", "QOSNotAllowed"}
# Reasons that also mean nodes are down, drained or reserved: hopeless once they last `grace_s`.
NODES_UNAVAILABLE = {"PartitionNodeLimit", "ReqNodeNotAvail", "NodeDown"}
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
# A preempted job may be requeued (PREEMPTED, then PENDING again): ended only if it stays so.
PREEMPTED_GRACE_S = 30.0
# sbatch options the launcher's parameters stand for (hydra.launcher.*), for --test-only.
SBATCH_OPTIONS = {"partition": "--partition={}", "account": "--account={}", "qos": "--qos={}",
                  "constraint": "--constraint={}", "exclude": "--exclude={}", "gres": "--gres={}",
                  "mem_gb": "--mem={}G", "cpus_per_task": "--cpus-per-task={}", "gpus_per_node": "--gpus-per-node={}",
                  "timeout_min": "--time={}"}


def hopeless(reason: str) -> bool:
    """Whether a pending reason can never resolve (squeue may add details after a comma)."""
    reason = reason.split(",")[0].strip()
    return reason in HOPELESS or (reason.startswith(("QOSMax", "AssocMax", "AssocGrp", "QOSGrp")) and "PerJob" in reason)


def sbatch_test_args(params: dict) -> List[str]:
    """The launcher's parameters as sbatch options (additional_parameters as --key=value)."""
    args = [option.format(params[key]) for key, option in SBATCH_OPTIONS.items() if params.get(key)]
    extra = params.get("additional_parameters") or {}
    return args + [f"--{key.replace('_', '-')}={value}" for key, value in extra.items()]


def sbatch_refusal(nodes: int, tasks_per_node: int, params: dict) -> Optional[str]:
    """sbatch --test-only's refusal of this allocation (one line), or None when Slurm could run it."""
    cmd = ["sbatch", "--test-only", f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}",
           *sbatch_test_args(params), "--wrap=true"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if result.returncode == 0:
        return None
    return " ".join(result.stderr.split()) or f"sbatch --test-only exited {result.returncode}"


def _run(cmd: List[str]) -> Tuple[int, str, str]:
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return -1, "", f"{cmd[0]} timed out"
    return result.returncode, result.stdout, result.stderr


def _scontrol_state(job_id: str) -> Tuple[str, str, str]:
    code, out, err = _run(["scontrol", "-o", "show", "job", job_id])
    fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
    if code == 0 and "JobState" in fields:
        return fields["JobState"], fields.get("Reason", ""), fields.get("NodeList", "")
    if "Invalid job id" in err:
        return "GONE", "", ""  # no longer known to the controller: ended a while ago
    return "UNKNOWN", " ".join(err.split()), ""  # the controller did not answer: ask again


def job_states(job_ids: Sequence[str]) -> Dict[str, Tuple[str, str, str]]:
    """job id -> (state, reason, nodes), from one squeue call (scontrol for a job squeue does
    not list, or when squeue fails). UNKNOWN: Slurm did not answer this time."""
    code, out, _ = _run(["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", "%i|%T|%r|%N"])
    states = {}
    for line in out.splitlines() if code == 0 else []:
        job_id, state, reason, nodes = line.split("|", 3)
        states[job_id] = (state, reason, nodes)
    return {job_id: states.get(job_id) or _scontrol_state(job_id) for job_id in job_ids}


def describe(state: str, reason: str, nodes: str) -> str:
    if state == "PENDING":
        return f"PENDING ({reason})" if reason and reason != "None" else "PENDING"
    if state == "RUNNING":
        return f"RUNNING on {nodes}"
    return state


class _Watch:
    def __init__(self, jobs: Dict[str, str], say: Callable[[str], None], cancel: Callable[[str], None],
                 grace_s: float):
        self.jobs, self.say, self.cancel, self.grace_s = jobs, say, cancel, grace_s
        self.shown: Dict[str, str] = {}
        self.since: Dict[str, Tuple[str, float]] = {}  # the line each job has shown since when
        self.ended: Dict[str, str] = {}

    def poll(self) -> None:
        waiting = [job_id for job_id in self.jobs if job_id not in self.ended]
        for job_id, (state, reason, nodes) in job_states(waiting).items():
            if state == "UNKNOWN":
                continue  # keep the last state shown; ask again next poll
            line = describe(state, reason, nodes)
            if self.shown.get(job_id) != line:
                self.say(f"slurm job {job_id} ({self.jobs[job_id]}): {line}")
                self.shown[job_id] = line
                self.since[job_id] = (line, time.monotonic())
            lasted = time.monotonic() - self.since[job_id][1]
            self._decide(job_id, state, reason.split(",")[0].strip(), lasted)

    def _decide(self, job_id: str, state: str, reason: str, lasted: float) -> None:
        if state == "PENDING" and (hopeless(reason) or (reason in NODES_UNAVAILABLE and lasted >= self.grace_s)):
            self.cancel(job_id)
            self.ended[job_id] = f"slurm job {job_id} can never start: pending with reason {reason}; cancelled"
            self.say(self.ended[job_id])
        elif state in TERMINAL or state == "GONE" or (state == "PREEMPTED" and lasted >= PREEMPTED_GRACE_S):
            self.ended[job_id] = state


def watch(jobs: Dict[str, str], poll_s: float = 1.0, say: Callable[[str], None] = None,
          cancel: Callable[[str], None] = None, grace_s: float = 120.0) -> Dict[str, str]:
    """Until every job ended: print each job's state when it changes (`jobs`: id -> label);
    cancel one whose pending reason cannot resolve (at once, or after `grace_s` for reasons that
    also mean nodes are down). Returns id -> how it ended: its final state, or the line saying
    why it was cancelled."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    cancel = cancel or (lambda job_id: _run(["scancel", job_id]))
    state = _Watch(jobs, say, cancel, grace_s)
    while True:
        state.poll()
        if len(state.ended) == len(jobs):
            return state.ended
        time.sleep(poll_s)
