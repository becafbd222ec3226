"""Global gradient norm and clipping over parameters that mix DTensor shards and plain tensors.

torch.nn.utils.clip_grad_norm_ stacks per-parameter norms and fails when a model mixes
DTensor and plain parameters (a plan that leaves some layers unsharded). Here each shard
contributes its local sum of squares; sums of sharded gradients are all-reduced over each mesh
dim they are sharded on (TP's, and FSDP's DP dims), once per mesh and set of dims; replicated
ones are counted once. Gradients are final by then: placed like their parameters and averaged
over DP (framework.parallel.data_parallel, FSDP2's reduce-scatter).
"""
from typing import Dict, Iterable, List, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _squares(grads: List[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of these tensors, in float32, one foreach kernel for all (as torch's
    clip_grad_norm_; a loop of per-tensor pow and sum took half again as long)."""
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).pow(2).sum()


@torch.no_grad()
def global_grad_norm(params: Iterable[torch.Tensor], pp_group=None) -> torch.Tensor:
    """`pp_group`: the pipeline's ranks, each holding other stages' parameters (summed over too).
    On the gradients' device, with no host sync (a GPU step never waits for the norm), and on
    meta (the dry run)."""
    replicated: List[torch.Tensor] = []
    sharded: Dict[Tuple[DeviceMesh, Tuple[int, ...]], List[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            # not is_shard(): FSDP2 places a dim-0 TP shard it shards again as _StridedShard,
            # which torch 2.13's is_shard() does not count. A final gradient is never Partial.
            dims = tuple(i for i, p in enumerate(grad.placements) if not p.is_replicate())
            if dims:
                sharded.setdefault((grad.device_mesh, dims), []).append(grad.to_local())
                continue
            grad = grad.to_local()
        replicated.append(grad)
    totals = [_squares(replicated)] if replicated else []
    for (mesh, dims), grads in sharded.items():
        squares = _squares(grads)
        for dim in dims:  # summed over each dim the gradient is sharded on: over all its shards
            dist.all_reduce(squares, group=mesh.get_group(dim))
        totals.append(squares)
    total = torch.stack(totals).sum() if totals else torch.zeros(())
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
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm
