"""A private two-node Slurm on this one host, for the tests marked `slurm`.

One munged (its own key and socket), one slurmctld and two slurmd (`slurmd -N n1`, `-N n2`:
Debian's build allows several per host), each with its own ports, spool, pid and log files
under a temp dir, all reached through SLURM_CONF. Node names map to 127.0.0.1 by NodeAddr (no
/etc/hosts change). Everything is stopped and removed on exit, even after a failure: the daemons,
and any slurmstepd left behind (seen once: a job step that never started its tasks kept its two
slurmstepd, daemonized away from slurmd, sleeping after the cluster was gone).
"""
import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, Optional

from tests.conftest import processes_with_marker

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scancel", "scontrol")


def missing_binaries() -> Optional[str]:
    """Why the slurm tests cannot run here, or None."""
    missing = [name for name in BINARIES if not (shutil.which(name) or os.path.exists(f"/usr/sbin/{name}"))]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing); as root with apt: "
                "apt-get install slurmd slurmctld munge")
    if os.geteuid() != 0:
        return "the private Slurm runs its daemons as this user and needs root"
    return None


def _free_ports(count: int) -> list:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


SLURM_CONF = """\
ClusterName=fwtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1_port} CPUs=4 RealMemory=8000 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n2_port} CPUs=4 RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
PartitionName=single Nodes=n1 MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


@contextmanager
def slurm_cluster(root: Path, timeout: float = 60, keep_logs: Optional[Path] = None) -> Iterator[Dict[str, str]]:
    """Start the cluster under `root`; yield the environment its commands need (SLURM_CONF).
    `keep_logs`: where the daemons' logs are copied before `root` is removed (pytest keeps its
    last runs' temp dirs), to read after a failure."""
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "munge", 0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    munge_socket = root / "munge" / "munge.socket"
    ctld_port, n1_port, n2_port = _free_ports(3)
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(root=root, munge_socket=munge_socket, ctld_port=ctld_port, n1_port=n1_port,
                                      n2_port=n2_port))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    processes, munged = [], None
    try:
        subprocess.run([_binary("munged"), "--force", f"--key-file={key}", f"--socket={munge_socket}",
                        f"--pid-file={root / 'munge' / 'munged.pid'}", f"--log-file={root / 'munge' / 'munged.log'}",
                        f"--seed-file={root / 'munge' / 'munged.seed'}"], check=True, env=env, timeout=30)
        munged = int((root / "munge" / "munged.pid").read_text().strip())
        processes.append(subprocess.Popen([_binary("slurmctld"), "-D", "-i"], env=env, start_new_session=True,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for node in ("n1", "n2"):
            processes.append(subprocess.Popen([_binary("slurmd"), "-D", "-N", node], env=env, start_new_session=True,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_for_idle_nodes(env, timeout)
        yield {"SLURM_CONF": str(conf)}
    finally:
        try:
            subprocess.run([_binary("scancel"), "--user=root", "--full"], env=env, capture_output=True, timeout=30)
        except subprocess.TimeoutExpired:
            pass  # a controller that never came up: the daemons go below all the same
        for process in processes:
            _stop(process)
        _kill_survivors(f"SLURM_CONF={conf}")
        if munged is not None:
            _stop_pid(munged)
        if keep_logs is not None:
            for log in root.glob("*.log"):
                shutil.copy(log, keep_logs)
        shutil.rmtree(root, ignore_errors=True)


def _wait_for_idle_nodes(env: dict, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    states = ""
    while time.monotonic() < deadline:
        result = subprocess.run([_binary("sinfo"), "-h", "-N", "-p", "debug", "-o", "%N %t"], env=env,
                                capture_output=True, text=True)
        states = result.stdout.strip() or result.stderr.strip()
        if result.returncode == 0 and sorted(states.splitlines()) == ["n1 idle", "n2 idle"]:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the private Slurm did not come up in {timeout} s: sinfo says {states!r}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _kill_survivors(marker: str) -> None:
    """SIGKILL every process whose environment holds `marker` (this cluster's SLURM_CONF, which
    slurmd hands its slurmstepd)."""
    for pid in processes_with_marker(marker):
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            continue


def _stop_pid(pid: int, timeout: float = 10) -> None:
    """SIGTERM `pid` and wait for it to exit (munged writes its seed file as it stops: removing
    its directory before that leaves one behind)."""
    deadline = time.monotonic() + timeout
    try:
        os.kill(pid, signal.SIGTERM)
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.1)
    except OSError:
        pass  # gone
