"""Starting the ranks. Hydra and validation run once, in the launching process; ranks get the
resolved config and the job's output dir and never compose or create directories themselves.

- Self-launched: prod(mesh.shape) workers through torch.distributed's elastic launcher (the
  engine behind torchrun) on loopback. If any rank fails, the agent stops the others and the
  launcher reports the failing rank and its error.
- Under torchrun (RANK/WORLD_SIZE set): the process joins that world (framework.torchrun).
"""
import json
import logging
import math
import os
import re
import sys
import tempfile
import uuid
from typing import Any, Callable, Dict, Optional

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from framework.validate import validate



class RankFailed(RuntimeError):
    """A rank raised or died; the message names the rank and its error."""


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# A rank whose peer died fails too, inside a collective; such errors are consequences.
_PEER_LOST = re.compile(r"gloo|nccl|connection closed|connection reset|broken pipe", re.IGNORECASE)


def _headline(failure) -> str:
    """The exception's own line, not the last line of a multi-line message."""
    message = failure.message["message"] if isinstance(failure.message, dict) else failure.message
    headlines = re.findall(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit)\b.*$", message, re.MULTILINE)
    return headlines[-1] if headlines else message.strip().splitlines()[-1]


def _failure_message(error: ChildFailedError) -> str:
    """Name the rank that failed first, preferring a rank's own error over a lost-peer error."""
    ranks = sorted(error.failures, key=lambda r: (error.failures[r].timestamp,
                                                  bool(_PEER_LOST.search(_headline(error.failures[r]))), r))
    rank, failure = ranks[0], error.failures[ranks[0]]
    others = f"; ranks {ranks[1:]} failed after it" if len(ranks) > 1 else ""
    return (f"rank {rank} failed (exit code {failure.exitcode}): {_headline(failure)} "
            f"(traceback in logs/rank{rank}.log){others}")


def spawn_ranks(world: int, entrypoint: Callable | str, *args: Any) -> Dict[int, Any]:
    """Run `entrypoint(*args)` (a function, or a command with its arguments) in `world` fresh
    processes forming one process group on loopback; return each rank's result (None for a
    command). Any rank failing stops them all and raises RankFailed."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks
    # The agent logs each failed rank's whole traceback; the rank's own log has it, and
    # RankFailed says which rank and why.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="framework-elastic-") as log_dir:
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=str(uuid.uuid4()),
            rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1",
            max_restarts=0, monitor_interval=0.1, start_method="spawn",
            logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        )
        try:
            return elastic_launch(config, entrypoint)(*args)
        except ChildFailedError as error:
            raise RankFailed(_failure_message(error)) from None


def rank_config(cfg: DictConfig) -> dict:
    """The config the ranks run: resolved, plain values (enums as their names), plus the
    job's command-line overrides (TensorBoard's hparams show what a sweep varied)."""
    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    container["overrides"] = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    return container


def write_resolved_config(cfg: DictConfig, out_dir: str) -> str:
    """The config every rank runs, interpolations resolved, kept with the job (.hydra/)."""
    path = os.path.join(out_dir, ".hydra", "resolved_config.yaml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    OmegaConf.save(OmegaConf.create(rank_config(cfg)), path)
    return path


def launch_local(cfg: DictConfig, out_dir: str) -> Optional[dict]:
    """Start prod(mesh.shape) ranks as `python -m framework.worker` processes, each handed the
    resolved config; return rank 0's summary (None when the pipeline stops before training).
    Separate processes (not a spawned function) let the agent see every failed rank."""
    config_path = write_resolved_config(cfg, out_dir)
    spawn_ranks(math.prod(cfg.mesh.shape), sys.executable, "-m", "framework.worker", config_path, out_dir)
    summary_path = os.path.join(out_dir, "summary.json")
    if not os.path.exists(summary_path):
        return None
    with open(summary_path) as f:
        return json.load(f)


def launch(cfg: DictConfig, out_dir: str) -> Optional[dict]:
    if under_torchrun():
        # Rank 0 of torchrun's world runs as a rank itself; a self-launcher never imports
        # the ranks' machinery (DTensor and the rest), which keeps its start-up short.
        from framework.torchrun import launch_in_torchrun_world

        return launch_in_torchrun_world(cfg, out_dir)
    validate(cfg)
    return launch_local(cfg, out_dir)
