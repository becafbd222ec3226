"""SLURM (and submitit's local executor) through Hydra's submitit launcher.

`-m hydra/launcher=submitit_slurm` submits one SLURM job per sweep point, sized by the
framework: nodes x tasks per node = the job's mesh size, with `launcher.ranks_per_node` tasks
on each node (default: all on one node), so a sweep over mesh shapes asks for the right
allocation per point and nothing is typed twice. Every task runs the Hydra job itself (submitit
unpickles it on each), joins the job's world from submitit's view of SLURM's variables
(world_from_job), validates, and runs as that rank. The launcher classes are Hydra plugins, so
they live in hydra_plugins/framework_launchers/; conf/hydra/launcher/submitit_{slurm,local}.yaml
point the plugin's launcher names at them.
"""
import math
import os
import socket
import subprocess
import zlib
from typing import Dict, Optional, Tuple

from omegaconf import DictConfig

from framework.config.errors import ConfigError
from framework.validate import check_ranks_per_node, validate
from framework.launch.local import RankFailed

INSTALL = "pip install -e '.[slurm]' (hydra-submitit-launcher)"


def in_submitit_job() -> bool:
    return os.environ.get("SUBMITIT_EXECUTOR") in ("slurm", "local")


def job_shape(cfg: DictConfig) -> Tuple[int, int]:
    """(nodes, tasks per node) for a job of this config's mesh; refuses what a submitit job
    cannot do."""
    check_ranks_per_node(cfg)
    if cfg.launcher.max_restarts:
        raise ConfigError("launcher.max_restarts", cfg.launcher.max_restarts,
                          "restarts are the self-launcher's (its elastic agent); a submitit job's tasks are its "
                          "ranks, which nothing restarts: set 0, and continue a failed job with "
                          "checkpoint.resume=<its checkpoints dir>")
    world = math.prod(cfg.mesh.shape)
    per_node = cfg.launcher.ranks_per_node or world
    return world // per_node, per_node


def master_port(job_id: str) -> int:
    """A port every task of one job derives alike, different between jobs sharing a node."""
    return 20000 + zlib.crc32(job_id.encode()) % 20000


def world_from_job() -> Dict[str, str]:
    """torch.distributed's env:// variables for this task, from submitit's JobEnvironment (SLURM's
    SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST..., or the local executor's)."""
    import submitit

    job = submitit.JobEnvironment()
    return {"RANK": str(job.global_rank), "WORLD_SIZE": str(job.num_tasks), "LOCAL_RANK": str(job.local_rank),
            "LOCAL_WORLD_SIZE": str(job.num_tasks // job.num_nodes), "MASTER_ADDR": node_address(job.hostnames[0]),
            "MASTER_PORT": str(master_port(job.job_id))}


def node_address(node: str) -> str:
    """The node's name where it resolves, else the NodeAddr slurm.conf gives it (clusters whose
    node names are not host names, several slurmd on one host)."""
    try:
        socket.getaddrinfo(node, None)
        return node
    except socket.gaierror:
        pass
    try:
        result = subprocess.run(["scontrol", "-o", "show", "node", node], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:  # no Slurm client here (a submitit task outside Slurm): the name as given
        return node
    fields = dict(item.split("=", 1) for item in result.stdout.split() if "=" in item)
    return fields.get("NodeAddr", node)


def join_job_world(cfg: DictConfig, out_dir: str) -> Optional[dict]:
    """One task of a submitit job: every task composed the same config, so each validates it
    (deterministically: a bad config fails every task alike, before any collective) and runs
    as its rank; rank 0 keeps the resolved config with the job."""
    # Imported here: the submitting process imports this module, and must not pay for the
    # ranks' machinery (DTensor and the rest).
    from framework.launch.handoff import rank_config, write_resolved_config
    from framework.launch.worker import run_rank

    os.environ.update(world_from_job())
    try:
        validate(cfg, world_size=int(os.environ["WORLD_SIZE"]), ranks_per_host=int(os.environ["LOCAL_WORLD_SIZE"]),
                 out_dir=out_dir)
        if os.environ["RANK"] == "0":
            write_resolved_config(cfg, out_dir)
        return run_rank(rank_config(cfg), out_dir)
    except ConfigError:
        raise
    except Exception as error:  # this task is the rank: its failure is the job's (recorded, the sweep goes on)
        one_line = " ".join(str(error).split())[:500]
        raise RankFailed(f"rank {os.environ['RANK']} failed: {type(error).__name__}: {one_line}") from error
