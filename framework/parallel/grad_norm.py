"""Global gradient norm and clipping over parameters that mix DTensor shards and plain tensors.

torch.nn.utils.clip_grad_norm_ stacks per-parameter norms and fails when a model mixes
DTensor and plain parameters (a plan that leaves some layers unsharded). Here each shard
contributes its local sum of squares; sums of sharded gradients are all-reduced over each mesh
dim they are sharded on (TP's, and FSDP's DP dims), once per mesh and set of dims; replicated
ones are counted once. Gradients are final by then: placed like their parameters and averaged
over DP (framework.parallel.data_parallel, FSDP2's reduce-scatter).
"""
from typing import Dict, Iterable, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


@torch.no_grad()
def global_grad_norm(params: Iterable[torch.Tensor], pp_group=None) -> torch.Tensor:
    """`pp_group`: the pipeline's ranks, each holding other stages' parameters (summed over too).
    On the gradients' device, with no host sync (a GPU step never waits for the norm), and on
    meta (the dry run)."""
    replicated = []
    sharded: Dict[Tuple[DeviceMesh, Tuple[int, ...]], torch.Tensor] = {}
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            squares = grad.to_local().float().pow(2).sum()
            # not is_shard(): FSDP2 places a dim-0 TP shard it shards again as _StridedShard,
            # which torch 2.13's is_shard() does not count. A final gradient is never Partial.
            dims = tuple(i for i, p in enumerate(grad.placements) if not p.is_replicate())
            if dims:
                key = (grad.device_mesh, dims)
                sharded[key] = sharded.get(key, 0) + squares
                continue
        else:
            squares = grad.float().pow(2).sum()
        replicated.append(squares)
    for (mesh, dims), squares in sharded.items():
        for dim in dims:  # summed over each dim the gradient is sharded on: over all its shards
            dist.all_reduce(squares, group=mesh.get_group(dim))
        replicated.append(squares)
    total = torch.stack(replicated).sum() if replicated else torch.zeros(())
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, pp_group=None) -> torch.Tensor:
    """Scale gradients so their global norm is at most max_norm (torch's formula, a clamped
    coefficient multiplied in, no host sync); return the norm before clipping."""
    params = list(params)
    norm = global_grad_norm(params, pp_group)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for param in params:
        if param.grad is not None:
            param.grad.mul_(coef.to(param.grad.device) if not isinstance(param.grad, DTensor) else coef)
    return norm
