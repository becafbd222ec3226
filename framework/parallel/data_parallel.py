"""Data parallelism over the DP submesh that stays correct when TP is applied afterwards.

The seed wraps `DDP(model, process_group=dp_group)` and then replaces `model.module`'s
layers with `parallelize_module`. torch's DDP binds its gradient reducer to the Parameter
objects that exist at construction; TP swaps them for new DTensor Parameters, so no gradient
all-reduce ever reaches the TP layers and the DP replicas silently diverge (measured on
torch 2.13; tests/test_training.py keeps that measurement). Applying TP first does not help
either: plain DDP cannot broadcast DTensors, and DDP(device_mesh=...) leaves
`model.parameters()` empty after the first forward.

`DataParallel` keeps the seed's shape (an outer wrapper whose `.module` is the model, so TP is
applied to `.module` after it) but binds nothing at construction: when backward finishes it
averages the gradients of whatever parameters `.module` holds at that moment, over the DP
group, using each DTensor's local shard (after summing the partial gradients TP leaves on
replicated parameters). Parameters stay ordinary module parameters, so the
optimizer, grad clipping and state_dict see all of them.
"""
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket cap


class _SyncGradientsAfterBackward(torch.autograd.Function):
    """Identity on the model's outputs whose backward queues the DP gradient sync to run
    once autograd has produced every gradient (the same hook point DDP uses)."""

    @staticmethod
    def forward(ctx, wrapper: "DataParallel", output: torch.Tensor) -> torch.Tensor:
        ctx.wrapper = wrapper
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        wrapper = ctx.wrapper
        if wrapper.sync_after_backward and not wrapper._sync_queued:
            wrapper._sync_queued = True
            Variable._execution_engine.queue_callback(wrapper.sync_gradients)
        return None, grad


class DataParallel(nn.Module):
    """Replicates `module` across the DP submesh; finalizes gradients after each backward."""

    def __init__(self, module: nn.Module, dp_mesh: Optional[DeviceMesh]):
        super().__init__()
        self.module = module
        self.dp_group = dp_mesh.get_group() if dp_mesh is not None else None
        self.dp_size = dp_mesh.size() if dp_mesh is not None else 1
        self._sync_queued = False
        self.sync_after_backward = True  # False while micro-batches accumulate (no_sync)
        self._broadcast_from_first_replica()

    @torch.no_grad()
    def _broadcast_from_first_replica(self) -> None:
        """Start every replica from the same weights, as DDP does at construction."""
        if self.dp_size == 1:
            return
        src = dist.get_global_rank(self.dp_group, 0)
        tensors = [t.data for t in [*self.module.parameters(), *self.module.buffers()]]
        _in_flat_buckets(tensors, lambda flat: dist.broadcast(flat, src=src, group=self.dp_group))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = self.module(*args, **kwargs)
        if not torch.is_grad_enabled():
            return output
        return tree_map_only(
            torch.Tensor,
            lambda t: _SyncGradientsAfterBackward.apply(self, t) if t.requires_grad else t,
            output,
        )

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside add to the gradients without finalizing them (as DDP's
        no_sync): gradient accumulation syncs once, after the step's last micro-batch."""
        self.sync_after_backward = False
        try:
            yield
        finally:
            self.sync_after_backward = True

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Make every trainable parameter's gradient final: placed like its parameter (TP) and
        averaged over DP. A parameter no replica used keeps no gradient (the optimizer skips it,
        as it would in one process); one only some replicas used gets their average, the
        others counting zeros. Every replica runs the same collectives either way."""
        self._sync_queued = False
        params = [p for p in self.module.parameters() if p.requires_grad]
        _reduce_partial_grads([p for p in params if p.grad is not None])
        if self.dp_size == 1 or not params:
            return
        used = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # to_local() is a view, so writing it writes the DTensor gradient's shard.
        local_grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        _in_flat_buckets([*local_grads, used], lambda flat: _average(flat, self.dp_group, self.dp_size))
        if used.is_meta:  # framework.dryrun: meta tensors hold no flags to read; every parameter counts as used
            return
        for p, used_somewhere in zip(params, used.tolist()):
            if not used_somewhere:
                p.grad = None


def _reduce_partial_grads(params: List[torch.Tensor]) -> None:
    """A replicated TP parameter (a sequence-parallel norm weight, say) gets a Partial gradient:
    each TP rank holds a partial sum. Sum them with one all-reduce per TP mesh for all such
    gradients together, rather than one redistribute per parameter."""
    partial: Dict[DeviceMesh, List[torch.Tensor]] = {}
    for p in params:
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            if all(g.is_partial() and q.is_replicate() for g, q in zip(p.grad.placements, p.placements)):
                partial.setdefault(p.grad.device_mesh, []).append(p)
            else:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    for mesh, group_params in partial.items():
        local_grads = [p.grad.to_local() for p in group_params]
        _in_flat_buckets(local_grads, lambda flat: dist.all_reduce(flat, group=mesh.get_group()))
        for p, summed in zip(group_params, local_grads):
            p.grad = DTensor.from_local(summed, mesh, p.placements, run_check=False)


def _average(flat: torch.Tensor, group, size: int) -> None:
    dist.all_reduce(flat, group=group)
    flat.div_(size)


def _in_flat_buckets(tensors: List[torch.Tensor], collective: Callable[[torch.Tensor], Any]) -> None:
    """Run `collective` in place on each bucket of `tensors` flattened into one tensor (one
    collective per bucket instead of one per tensor), then copy the results back."""
    for bucket in _buckets(tensors):
        flat = torch._utils._flatten_dense_tensors(bucket)
        collective(flat)
        for tensor, result in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
            tensor.copy_(result)


def _buckets(tensors: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """Group same-dtype tensors into buckets of at most BUCKET_BYTES, keeping order."""
    buckets: List[List[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or buckets[-1][0].dtype != t.dtype or size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets


def apply_dp(model: nn.Module, dp_mesh: Optional[DeviceMesh]) -> DataParallel:
    """Wrap `model`; with no DP dim (dp_mesh None) the wrapper only keeps the `.module` shape."""
    return DataParallel(model, dp_mesh)
