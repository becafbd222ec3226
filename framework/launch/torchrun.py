"""Joining a world torchrun started (RANK/WORLD_SIZE set) instead of spawning one.

Rank 0 runs Hydra and validation, then hands the resolved config and its output dir to the
other ranks through the store torchrun's agent hosts; the other ranks never run Hydra and never
make directories of their own. A config rank 0 refuses is handed over as the error, so every
rank exits instead of waiting.
"""
import json
import os
import shutil
import sys
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist
from omegaconf import DictConfig

from framework.launch.handoff import HYDRA_ONLY, rank_config, write_resolved_config
from framework.validate import validate
from framework.launch.worker import run_rank

HANDSHAKE_TIMEOUT = timedelta(minutes=10)
JOB_DIR_KEY = "framework/job_dir"


def _payload_key() -> str:
    """Per restart attempt, so a restarted world never reads the previous attempt's config."""
    return f"framework/config/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _job_dir(store: dist.TCPStore, out_dir: str) -> str:
    """The first attempt's job dir: after torchrun's --max-restarts restarts the world, rank 0's
    Hydra makes a new (timestamped) dir, but the run continues where its checkpoints, logs and
    TensorBoard events are. The new dir, which holds only Hydra's files, is removed."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" or not store.check([JOB_DIR_KEY]):
        store.set(JOB_DIR_KEY, out_dir)
        return out_dir
    first = store.get(JOB_DIR_KEY).decode()
    if first != out_dir and set(os.listdir(out_dir)) <= HYDRA_ONLY:
        shutil.rmtree(out_dir, ignore_errors=True)
    return first


def _torchrun_store() -> dist.TCPStore:
    """Client of the store torchrun's agent hosts for this job."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=HANDSHAKE_TIMEOUT)


def launch_in_torchrun_world(cfg: DictConfig, out_dir: str,
                             choose_layout: Callable[[DictConfig, int], DictConfig]) -> Optional[dict]:
    """Rank 0 under torchrun: plan the layout if mesh=auto (`choose_layout` of the config and
    the world's size: the command's planner, which sits above the launchers), validate against
    the world, publish the config (or the error), then run as rank 0."""
    store = _torchrun_store()
    out_dir = _job_dir(store, out_dir)
    try:
        if cfg.mesh.auto:
            cfg = choose_layout(cfg, int(os.environ["WORLD_SIZE"]))
        validate(cfg, world_size=int(os.environ["WORLD_SIZE"]),
                 ranks_per_host=int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])), out_dir=out_dir)
    except Exception as error:  # a ConfigError, or anything else: never leave the others waiting
        store.set(_payload_key(), json.dumps({"error": str(error)}))
        raise
    write_resolved_config(cfg, out_dir)
    container = rank_config(cfg)
    store.set(_payload_key(), json.dumps({"cfg": container, "out_dir": out_dir}))
    return run_rank(container, out_dir)


def follow_rank0() -> int:
    """Ranks > 0 under torchrun: wait for rank 0's config and run it; exit 2 if it refused."""
    payload = json.loads(_torchrun_store().get(_payload_key()))
    if "error" in payload:
        print(f"rank {os.environ['RANK']}: rank 0 refused the config: {payload['error']}", file=sys.stderr)
        return 2
    run_rank(payload["cfg"], payload["out_dir"])
    return 0
