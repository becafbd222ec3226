"""`python -m framework.inspect comm [overrides]`: the collectives of one training step.

Composes the config like framework.train (same groups, recipes and overrides; no output dir),
starts the mesh's ranks, builds the model, runs one step (forward, backward with the gradient
finalization, optimizer step; no clipping or logging) under torch's CommDebugMode on every
rank, and prints rank 0's collectives by type. DTensor's own collectives (TP) and the c10d
ones DataParallel issues (DP gradient averaging) are both counted.
"""
import math
import sys
import tempfile
import warnings
from typing import Dict, List

import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.distributed.tensor.debug import CommDebugMode

from framework.training.builder import build_and_run
from framework.config.schema import STAGES, register_schema
from framework.config.errors import ConfigError
from framework.launch.handoff import rank_config
from framework.launch.local import RankFailed, spawn_ranks
from framework.train import CONFIG_DIR
from framework.training.loop import forward_backward
from framework.config.validate import validate

USAGE = "usage: python -m framework.inspect comm [hydra overrides, e.g. recipe=lm_2d mesh=1x2]"


def collectives_of_one_step(cfg_container: dict, out_dir: str) -> Dict[str, int]:
    """Runs in every rank: build up to the optimizer, then one counted step."""
    cfg = OmegaConf.create(cfg_container)
    cfg.pipeline = STAGES[: STAGES.index("optimizer") + 1]
    run = build_and_run(cfg, out_dir)
    inputs, targets = next(iter(run.dataloader))
    # CommDebugMode's module tracker registers full backward hooks, which warn on the first module.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    with CommDebugMode() as comm:
        forward_backward(run, inputs, targets)
        run.optimizer.step()
    counts = {str(op).removeprefix("torch.ops."): n for op, n in comm.get_comm_counts().items()}
    dist.destroy_process_group()
    return counts


def count_collectives(overrides: List[str]) -> Dict[str, int]:
    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    validate(cfg)
    with tempfile.TemporaryDirectory(prefix="framework-inspect-") as out_dir:
        counts = spawn_ranks(math.prod(cfg.mesh.shape), collectives_of_one_step,
                             rank_config(cfg), out_dir)[0]
    return dict(sorted(counts.items()))


def main(argv: List[str]) -> int:
    if not argv or argv[0] != "comm":
        print(USAGE, file=sys.stderr)
        return 2
    try:
        counts = count_collectives(argv[1:])
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    except RankFailed as error:
        print(f"inspection failed: {error}", file=sys.stderr)
        return 1
    print(f"collectives in one training step (rank 0), {' '.join(argv[1:]) or 'default config'}:")
    width = max([len(op) for op in counts] + [10])
    for op, n in counts.items():
        print(f"  {op.ljust(width)}  {n}")
    print(f"  {'total'.ljust(width)}  {sum(counts.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
