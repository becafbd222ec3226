"""`python -m framework.export CHECKPOINT OUT.pt`: a checkpoint's model as one plain state_dict.

CHECKPOINT is a step_N dir (or a checkpoints dir, meaning its newest). The model its saved
config names is built in this one process, DCP loads the sharded weights into it with no
process group (resharding whatever mesh and plan saved them into whole tensors), and OUT.pt
gets `model.state_dict()`: the model's own keys, loadable with
`model.load_state_dict(torch.load("OUT.pt"))` anywhere. Bad input exits 2 with one line.
"""
import os
import sys
import warnings
from typing import List

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.api import CheckpointException

from framework.checkpoint.compat import check_model_keys
from framework.checkpoint.layout import CheckpointError, first_failure, read_meta, resolve
from framework.config.errors import ConfigError
from framework.config.validate import check_targets, instantiate_checked

USAGE = "usage: python -m framework.export CHECKPOINT OUT.pt"


def export(checkpoint: str, out_path: str) -> str:
    """Write the checkpoint's full model state_dict to out_path (atomically); return the
    checkpoint dir used."""
    path = resolve(checkpoint, directory="")
    cfg = OmegaConf.create(read_meta(path)["config"])
    check_targets(cfg)  # the saved config names the model class: the same allowlist as a run
    with torch.device("cpu"):
        model = instantiate_checked(cfg.model)
    check_model_keys(path, model)
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the point
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=path, no_dist=True)
    except (Exception, CheckpointException) as error:
        raise CheckpointError(path, f"cannot be loaded: {first_failure(error)}") from None
    tmp = out_path + ".tmp"
    torch.save(state["model"], tmp)
    os.replace(tmp, out_path)
    return path


def main(argv: List[str]) -> int:
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE)
        return 0
    if len(argv) != 2:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        path = export(*argv)
    except (CheckpointError, ConfigError) as error:
        print(f"export failed: {error}", file=sys.stderr)
        return 2
    print(f"exported the model of {path} to {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
