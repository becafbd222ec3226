"""What every rank runs, and the entry of a self-launched rank:
`python -m framework.launch.worker RESOLVED_CONFIG OUT_DIR`.

The launcher (framework.launch.local.launch_local) starts one per mesh position through the elastic
agent, which sets RANK, WORLD_SIZE and MASTER_ADDR/PORT. `record` writes the rank's error
where the agent reads it, so the launcher can name the failing rank and its exception.
"""
import logging
import os
import sys
from typing import Optional

import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from framework.training.builder import build_and_run
from framework.config.validate import validate

log = logging.getLogger("framework")


def setup_rank_logging(out_dir: str, rank: int) -> None:
    """Every rank logs to logs/rank<N>.log in the job's dir; rank 0 also to the console."""
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    handlers = [logging.FileHandler(os.path.join(out_dir, "logs", f"rank{rank}.log"))]
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(asctime)s %(message)s",
                        handlers=handlers, force=True)


def run_rank(cfg_container: dict, out_dir: str) -> Optional[dict]:
    """What every rank runs: re-check the config cheaply, build the stages, return rank 0's summary."""
    rank = int(os.environ["RANK"])
    setup_rank_logging(out_dir, rank)
    cfg = OmegaConf.create(cfg_container)
    validate(cfg, world_size=int(os.environ["WORLD_SIZE"]), deep=False)
    try:
        run = build_and_run(cfg, out_dir)
    except Exception:
        log.exception("rank %d failed", rank)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return run.summary if rank == 0 else None


@record
def main() -> None:
    config_path, out_dir = sys.argv[1:3]
    run_rank(OmegaConf.to_container(OmegaConf.load(config_path)), out_dir)


if __name__ == "__main__":
    main()
