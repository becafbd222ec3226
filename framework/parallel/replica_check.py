"""A guard during training for what verify did not cover: parameters that must be identical on
several ranks are. A plain parameter (or a replicated DTensor) must be equal on every rank, a
sharded DTensor's local shard on every DP replica. One float64 checksum per parameter; one
all-reduce per group (of [checksum, -checksum] under MAX, giving max and min at once) finds any
that differ, and the run fails naming the first and the group. Under pipeline parallelism "every
rank" is every rank of the pipeline stage (the others hold other layers)."""
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from framework.parallel.expert_parallel import spread_over_dp


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum and sum of squares weighted by position, so a swap or a sign flip also shows."""
    flat = tensor.detach().reshape(-1).double()
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device) / max(1, flat.numel())
    return torch.stack([(flat * weights).sum(), flat.square().sum()])


def _differing(names: List[str], sums: List[torch.Tensor], group, device) -> List[str]:
    if not names:
        return []
    local = torch.stack(sums).to(device)
    both = torch.cat([local, -local])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = both[: len(local)], -both[len(local):]
    return [name for name, differs in zip(names, (high != low).any(dim=1).tolist()) if differs]


@torch.no_grad()
def check_replicas(model: nn.Module, dp_group, step: int, stage_group=None) -> None:
    """Raise naming the first parameter that differs where it must not (every rank raises).
    `stage_group`: the ranks of this pipeline stage (None: every rank holds every layer)."""
    groups: Dict[str, Tuple[List[str], List[torch.Tensor]]] = {"all ranks": ([], []), "its DP group": ([], [])}
    device = None
    for name, param in model.named_parameters():
        if spread_over_dp(param, dp_group):  # an expert under EP: each DP rank holds other experts
            continue
        sharded = isinstance(param, DTensor) and any(p.is_shard() for p in param.placements)
        local = param.to_local() if isinstance(param, DTensor) else param
        device = local.device
        names, sums = groups["its DP group" if sharded else "all ranks"]
        names.append(name)
        sums.append(checksum(local))
    for label, group in (("all ranks", stage_group), ("its DP group", dp_group)):
        if label == "its DP group" and dp_group is None:
            continue
        differing = _differing(*groups[label], group=group, device=device)
        if differing:
            raise RuntimeError(f"replica check at step {step}: parameter {differing[0]} differs across {label} "
                               f"(it must be identical there{'; also ' + ', '.join(differing[1:4]) if differing[1:] else ''}): "
                               f"a gradient not synchronised (a parameter the plan leaves plain under TP?), or a "
                               f"rank-dependent update; python -m framework.verify names the cause")
