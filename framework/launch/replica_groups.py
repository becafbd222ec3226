"""launcher.fault_tolerance=torchft, self-launched: a torchft lighthouse (or launcher.lighthouse's)
and one process per replica group, `python -m framework.launch.replica_groups CONFIG OUT_DIR`,
each running its group's ranks under an elastic agent of its own (spawn_ranks), restarted up to
launcher.max_restarts times without stopping the other groups (framework.parallel.fault_tolerance).

Group g's outputs go to OUT_DIR/replica_group_<g>/ (logs, TensorBoard, checkpoints, its
summary.json); the run's summary.json is group 0's.
"""
import ctypes
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import List, Optional

from omegaconf import DictConfig, OmegaConf

from framework.checkpoint.compat import checkpoint_dir
from framework.launch.handoff import write_resolved_config
from framework.launch.local import Interrupted, RankFailed, spawn_ranks
from framework.launch.threads import available_cores, binds_cores
from framework.parallel.fault_tolerance_config import GROUP_ENV, replica_dim

# How long the lighthouse waits for a heartbeating group that has not asked for this step's quorum
# yet, before forming the quorum without it: short, since a group asks only once it is built.
JOIN_TIMEOUT_MS = 500


def group_config(cfg: DictConfig, group: int, out_dir: str) -> DictConfig:
    """Group `group`'s config: the mesh with the replica dim at 1, its share of this host's cores,
    and a checkpoint dir of its own."""
    group_cfg = cfg.copy()
    names = list(cfg.mesh.dim_names)
    shape = list(cfg.mesh.shape)
    shape[names.index(replica_dim(cfg))] = 1
    group_cfg.mesh.shape = shape
    if cfg.launcher.threads_per_rank is None:
        group_cfg.launcher.threads_per_rank = max(1, available_cores() // math.prod(cfg.mesh.shape))
    group_cfg.checkpoint.dir = os.path.join(checkpoint_dir(cfg, out_dir), f"replica_group_{group}") \
        if cfg.checkpoint.dir else None
    return group_cfg


def _start_lighthouse(cfg: DictConfig):
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                            heartbeat_timeout_ms=int(cfg.launcher.ft_detection_s * 1000))


def _stop_with_parent() -> None:
    """A group's process gets SIGTERM when the launcher dies (even by kill -9), so no group
    trains on orphaned (Linux's PR_SET_PDEATHSIG; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def _wait(processes: List[subprocess.Popen], grace_s: float) -> List[int]:
    """Every group's exit code. Groups in one quorum finish together; a group still running
    `grace_s` after another finished restarted too late to rejoin (nothing left to heal from) and
    would train alone from its own start: it is stopped (SIGTERM) and counts as done."""
    finished_at = None
    while any(process.poll() is None for process in processes):
        codes = [process.poll() for process in processes]
        if finished_at is None and 0 in codes:
            finished_at = time.monotonic()
        if finished_at is not None and time.monotonic() - finished_at > grace_s:
            for group, process in enumerate(processes):
                if process.poll() is None:
                    print(f"replica group {group} stopped: the others had finished before it rejoined",
                          file=sys.stderr)
                    process.terminate()
                    process.wait()
                    process.returncode = 0
            break
        time.sleep(0.1)
    return [process.returncode for process in processes]


def launch_replica_groups(cfg: DictConfig, out_dir: str) -> Optional[dict]:
    """Start the lighthouse and every group; wait for all; return group 0's summary."""
    groups = dict(zip(cfg.mesh.dim_names, cfg.mesh.shape))[replica_dim(cfg)]
    lighthouse = None if cfg.launcher.lighthouse else _start_lighthouse(cfg)
    address = cfg.launcher.lighthouse or lighthouse.address()
    processes: List[subprocess.Popen] = []
    try:
        for group in range(groups):
            group_dir = os.path.join(out_dir, f"replica_group_{group}")
            config_path = write_resolved_config(group_config(cfg, group, out_dir), group_dir)
            # (RUST_LOG: torchft's lighthouse and managers log every quorum at info)
            env = {"RUST_LOG": "warn", **os.environ, GROUP_ENV: f"{group}/{groups}", "TORCHFT_LIGHTHOUSE": address}
            processes.append(subprocess.Popen([sys.executable, "-m", "framework.launch.replica_groups", config_path,
                                               group_dir], env=env, preexec_fn=_stop_with_parent))
        codes = _wait(processes, grace_s=max(10.0, 2 * cfg.launcher.ft_detection_s))
    except KeyboardInterrupt:
        for process in processes:
            process.send_signal(signal.SIGINT)
        codes = [process.wait() for process in processes]
        raise Interrupted(signal.SIGINT) from None
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
                process.wait()
        if lighthouse is not None:
            lighthouse.shutdown()
    failed = [group for group, code in enumerate(codes) if code]
    if failed:
        raise RankFailed(f"replica group {failed[0]} failed (exit code {codes[failed[0]]}; its line above, logs in "
                         f"{os.path.join(out_dir, f'replica_group_{failed[0]}', 'logs')})"
                         + (f"; groups {failed[1:]} too" if len(failed) > 1 else ""))
    first = os.path.join(out_dir, "replica_group_0", "summary.json")
    if not os.path.exists(first):
        return None
    shutil.copyfile(first, os.path.join(out_dir, "summary.json"))
    with open(first) as f:
        return json.load(f)


def main() -> None:
    """One replica group: its ranks under their own elastic agent."""
    config_path, out_dir = sys.argv[1:3]
    cfg = OmegaConf.load(config_path)
    group = os.environ[GROUP_ENV].split("/")[0]
    try:
        spawn_ranks(math.prod(cfg.mesh.shape), sys.executable, "-m", "framework.launch.worker", config_path, out_dir,
                    max_restarts=cfg.launcher.max_restarts, threads_per_rank=cfg.launcher.threads_per_rank,
                    bind_cores=binds_cores(cfg))
    except RankFailed as error:
        print(f"replica group {group}: {error}", file=sys.stderr)
        sys.exit(1)
    except Interrupted as stop:
        sys.exit(128 + stop.number)


if __name__ == "__main__":
    main()
