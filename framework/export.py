"""`python -m framework.export CHECKPOINT OUT.pt`: a checkpoint's model as one plain state_dict.

CHECKPOINT is a step_N dir (or a checkpoints dir, meaning its newest). The model its saved
config names is built in this one process, DCP loads the sharded weights into it with no
process group (resharding whatever mesh and plan saved them into whole tensors), and OUT.pt
gets `model.state_dict()`: the model's own keys, loadable with
`model.load_state_dict(torch.load("OUT.pt"))` anywhere. Bad input exits 2 with one line.
"""
import sys
import warnings
from typing import List

import torch
from omegaconf import OmegaConf

from framework.atomic import atomic_file
from framework.checkpoint.compat import check_model_keys
from framework.checkpoint.layout import CheckpointError, read_meta, resolve
from framework.checkpoint.safe_load import load_checkpoint
from framework.config.errors import ConfigError
from framework.config.schema import Config
from framework.config.trust import check_targets
from framework.config.validate import instantiate_checked

USAGE = "usage: python -m framework.export CHECKPOINT OUT.pt"


def export(checkpoint: str, out_path: str) -> str:
    """Write the checkpoint's full model state_dict to out_path (atomically); return the
    checkpoint dir used."""
    path = resolve(checkpoint, directory="")
    cfg = OmegaConf.create(read_meta(path)["config"])
    # The saved config names the model class: checked against your allowlist (the default, and
    # FRAMEWORK_ALLOWED_TARGETS), never the one the checkpoint carries.
    cfg.allowed_targets = Config().allowed_targets
    check_targets(cfg)
    with torch.device("cpu"):
        model = instantiate_checked(cfg.model)
    check_model_keys(path, model)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_checkpoint(state, path, no_dist=True)
    with atomic_file(out_path, "wb") as f:
        torch.save(state["model"], f)
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
