"""One self-launched rank: `python -m framework.worker RESOLVED_CONFIG OUT_DIR`.

The launcher (framework.launch.launch_local) starts one per mesh position through the elastic
agent, which sets RANK, WORLD_SIZE and MASTER_ADDR/PORT. `record` writes the rank's error
where the agent reads it, so the launcher can name the failing rank and its exception.
"""
import sys

from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from framework.launch import run_rank


@record
def main() -> None:
    config_path, out_dir = sys.argv[1:3]
    run_rank(OmegaConf.to_container(OmegaConf.load(config_path)), out_dir)


if __name__ == "__main__":
    main()
