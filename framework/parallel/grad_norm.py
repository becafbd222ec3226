"""Global gradient norm and clipping over parameters that mix DTensor shards and plain tensors.

torch.nn.utils.clip_grad_norm_ stacks per-parameter norms and fails when a model mixes
DTensor and plain parameters (a plan that leaves some layers unsharded). Here each shard
contributes its local sum of squares; sums of Shard-placed gradients are all-reduced once
per TP mesh, Replicate-placed ones are counted once. Gradients are final by then: placed like
their parameters and equal across DP (framework.parallel.data_parallel).
"""
from typing import Dict, Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


@torch.no_grad()
def global_grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    replicated = torch.zeros((), dtype=torch.float32)
    sharded: Dict[DeviceMesh, torch.Tensor] = {}
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            squares = grad.to_local().float().pow(2).sum().cpu()
            if any(p.is_shard() for p in grad.placements):
                sharded[grad.device_mesh] = sharded.get(grad.device_mesh, 0) + squares
                continue
        else:
            squares = grad.float().pow(2).sum().cpu()
        replicated += squares
    for mesh, squares in sharded.items():
        squares = squares.to(mesh.device_type)
        dist.all_reduce(squares, group=mesh.get_group())
        replicated += squares.cpu()
    return replicated.sqrt()


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale gradients so their global norm is at most max_norm (torch's formula); return the
    norm before clipping."""
    params = list(params)
    norm = global_grad_norm(params)
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1.0:
        for param in params:
            if param.grad is not None:
                param.grad.mul_(coef)
    return norm
