"""Functions the multi-process tests run inside each rank (importable by spawned processes)."""
import os

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from framework.builder import build_and_run
from framework.models import SeedMLP


class FailOnRank(SeedMLP):
    """The seed model, except that building it raises on one rank: tests failure handling."""

    def __init__(self, fail_rank: int = 1, **sizes):
        if os.environ.get("RANK") == str(fail_rank):
            raise RuntimeError(f"boom on rank {fail_rank}")
        super().__init__(**sizes)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def train_and_report(cfg_container: dict, out_dir: str) -> dict:
    """Run the whole pipeline, then report what the tests compare across ranks."""
    run = build_and_run(OmegaConf.create(cfg_container), out_dir)
    module = run.model.module
    report = {
        "rank": dist.get_rank(),
        "dp_rank": run.dp["rank"],
        "tp_rank": run.tp["rank"],
        "params": {name: local_tensor(p) for name, p in module.named_parameters()},
        "param_numel": sum(p.numel() for p in run.model.parameters()),
        "state_dict_keys": sorted(run.model.state_dict()),
        "optimizer_params": sum(len(g["params"]) for g in run.optimizer.param_groups),
        "epoch0_indices": list(iter(run.sampler)),
        "summary": run.summary,
    }
    dist.destroy_process_group()
    return report
