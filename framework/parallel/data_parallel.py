"""Data parallelism over the DP submesh that stays correct when TP is applied afterwards.

The seed wraps `DDP(model, process_group=dp_group)` and then replaces `model.module`'s
layers with `parallelize_module`. torch's DDP binds its gradient reducer to the Parameter
objects that exist at construction; TP swaps them for new DTensor Parameters, so no gradient
all-reduce ever reaches the TP layers and the DP replicas silently diverge (measured on
torch 2.13; tests/test_training.py keeps that measurement). Applying TP first does not help
either: plain DDP cannot broadcast DTensors, and DDP(device_mesh=...) leaves
`model.parameters()` empty after the first forward.

`DataParallel` keeps the seed's shape (an outer wrapper whose `.module` is the model, so TP is
applied to `.module` after it) but binds nothing at construction: at the first forward it hooks
whatever parameters `.module` holds then, and during backward all-reduces their gradients'
local shards over the DP group in buckets, each as soon as its gradients exist (as DDP
overlaps communication with backward); at the end of backward it waits, averages, and sums the
partial gradients TP leaves on replicated parameters. Parameters stay ordinary module
parameters, so the optimizer, grad clipping and state_dict see all of them.
"""
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from framework.models.protocol import offered

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket cap


FIRST_BUCKET_BYTES = 1024 * 1024  # DDP's cap for the first bucket, so communication starts early


class _SyncGradientsAfterBackward(torch.autograd.Function):
    """Identity on the model's outputs whose backward queues the end of the DP gradient sync
    to run once autograd has produced every gradient (the same hook point DDP uses)."""

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


class _Bucket:
    """Parameters whose gradients are all-reduced together, and the all-reduce in flight.

    `flat` is allocated once and reused every step: the gradients are copied in, all-reduced
    and averaged there, and the parameters' gradients become views of it (as DDP's
    gradient_as_bucket_view), so no step allocates a bucket or copies the results back."""

    def __init__(self, params: List[nn.Parameter]):
        self.params = params
        self.waiting = len(params)  # gradients not yet produced in this backward
        self.produced: List[float] = []  # per parameter: 1.0 where this rank produced its gradient
        self.flat: Optional[torch.Tensor] = None
        self.views: List[torch.Tensor] = []  # of flat: each gradient's local shard, then the tail (flags, riders)
        self.work = None

    def bind_views(self, grads: List[torch.Tensor], n_tail: int) -> None:
        """Allocate `flat` for these local gradients (and a tail of n_tail values), once."""
        if self.flat is not None:
            return
        sizes = [g.numel() for g in grads] + ([n_tail] if n_tail else [])
        self.flat = torch.empty(sum(sizes), dtype=grads[0].dtype, device=grads[0].device)
        pieces = self.flat.split(sizes)
        self.views = [piece.view_as(g) for piece, g in zip(pieces, grads)] + list(pieces[len(grads):])


class _OverGroup:
    """Gradients averaged over the DP process group (what `across` replaces). Nothing rides with
    them (`riders`: values the last bucket carries for `across`, averaged as the gradients are)."""

    riders = 0

    def __init__(self, group: Optional[dist.ProcessGroup], size: int):
        self.group, self._size = group, size

    def all_reduce(self, flat: torch.Tensor):
        return dist.all_reduce(flat, group=self.group, async_op=True)

    def ride(self, tail: torch.Tensor) -> None:
        pass

    def arrived(self, tail: torch.Tensor) -> None:
        pass

    def size(self) -> int:
        return self._size


class NoGradientSync:
    """How a DP strategy's gradient sync meets micro-batches and pipeline schedules, the one face
    the Trainer sees (run.gradient_sync): no_sync() around every micro-batch's backward but the
    last; under a pipeline, sync_after_pipeline() once before the first schedule and
    sync_gradients() after each. This one: gradients that need no sync (no DP stage ran);
    DataParallel (replicate) and framework.parallel.fully_shard.FullyShardedSync (fsdp / hsdp)
    are the others."""

    def no_sync(self):
        return nullcontext()

    def sync_after_pipeline(self) -> None:
        pass

    def sync_gradients(self) -> None:
        pass


class DataParallel(nn.Module):
    """Replicates `module` across the DP submesh; all-reduces gradients during backward.

    Bound at the first forward, not at construction: by then TP has replaced the parameters,
    and those are the ones hooked and bucketed. With
    `overlap` a bucket's all-reduce starts (async) as soon as backward has produced all its
    gradients and every earlier bucket has started: buckets in a fixed order on every rank
    (reverse parameter order, as DDP's, so they fill in about the order backward produces them).
    A parameter this rank does not use holds its bucket, and the later ones, until the end of
    backward, when what is left starts; one wait then. Each bucket's flat buffer lives as long
    as the wrapper, as DDP's bucket buffers do, and the final gradients are views of it."""

    def __init__(self, module: nn.Module, dp_mesh: Optional[DeviceMesh], overlap: bool = True,
                 experts: Any = None, across: Any = None):
        """What other capabilities own, handed in: `experts`, the gradients of experts spread over
        DP ranks, which it leaves out of its buckets and hands back after its sync
        (framework.parallel.expert_parallel.ExpertGradients); `across`, where the gradients
        average instead of the DP group: its all_reduce(flat) and size(), and the values that ride
        with them in the last bucket (torchft's replica groups and the step's loss,
        framework.parallel.fault_tolerance.ReplicaGroups)."""
        super().__init__()
        self.module = module
        self.dp_group = dp_mesh.get_group() if dp_mesh is not None else None
        self.dp_size = dp_mesh.size() if dp_mesh is not None else 1
        self.experts = experts
        self.average = across if across is not None else _OverGroup(self.dp_group, self.dp_size)
        self.syncs = self.dp_size > 1 or across is not None
        self.overlap = overlap
        self._sync_queued = False
        self.sync_after_backward = True  # False while micro-batches accumulate (no_sync)
        self._buckets: List[_Bucket] = []
        self._bucket_of: Dict[nn.Parameter, _Bucket] = {}
        self._summed: List[nn.Parameter] = []  # experts spread over DP: `experts` finishes them
        self._launched = 0  # buckets launched in this backward, in order
        self._broadcast_from_first_replica()

    @torch.no_grad()
    def _broadcast_from_first_replica(self) -> None:
        """Start every replica from the same weights, as DDP does at construction. A model on
        meta has none yet: every replica loads the same ones later (a Hugging Face model)."""
        if self.dp_size == 1 or any(p.is_meta for p in self.module.parameters()):
            return
        src = dist.get_global_rank(self.dp_group, 0)
        alike = {id(t) for t in offered(self.module).alike_on_every_rank()}  # (QLoRA's NF4 weights)
        tensors = [t.data for t in [*self.module.parameters(), *self.module.buffers()] if id(t) not in alike]
        in_flat_buckets(tensors, lambda flat: dist.broadcast(flat, src=src, group=self.dp_group))

    def _bind(self) -> None:
        """Hook and bucket the trainable parameters `.module` holds now (once: the first forward)."""
        if self._buckets or not self.syncs:
            return
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        self._summed = [p for p in trainable if self.experts is not None and self.experts.owns(p)]
        params = [p for p in trainable if not any(p is q for q in self._summed)]
        self._buckets = [_Bucket(bucket) for bucket in _buckets(params[::-1], FIRST_BUCKET_BYTES)]
        self._bucket_of = {p: bucket for bucket in self._buckets for p in bucket.params}
        for p in params:
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        self._bind()
        output = self.module(*args, **kwargs)
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

    def sync_after_pipeline(self) -> None:
        """Pipeline parallelism: the schedule calls the stages, not this wrapper, once per
        micro-batch; gradients add up over them and are synced once, by sync_gradients() after
        the schedule (as DDP's no_sync until the last micro-batch)."""
        self.sync_after_backward = False
        self._bind()

    def _gradient_ready(self, param: nn.Parameter) -> None:
        if not (self.overlap and self.sync_after_backward):
            return
        self._bucket_of[param].waiting -= 1
        while self._launched < len(self._buckets) and self._buckets[self._launched].waiting == 0:
            self._launch(self._buckets[self._launched])

    def _launch(self, bucket: _Bucket) -> None:
        """Start the bucket's all-reduce on the local shards of its gradients (a gradient this rank
        did not produce counts as zeros). The last bucket also carries, per parameter, whether this
        rank produced its gradient, so a parameter no replica used can keep no gradient, and what
        rides with the gradients (`average`'s riders)."""
        bucket.produced = [float(p.grad is not None) for p in bucket.params]
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            _place_like_parameter(p)
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in bucket.params]
        last = bucket is self._buckets[-1]
        n_flags = sum(len(b.params) for b in self._buckets)
        bucket.bind_views(grads, n_flags + self.average.riders if last else 0)
        torch._foreach_copy_(bucket.views[:len(grads)], grads)
        if last:  # every bucket has recorded its flags by now
            tail = bucket.views[-1]
            tail[:n_flags].copy_(torch.tensor([flag for b in self._buckets for flag in b.produced]))
            self.average.ride(tail[n_flags:])
        bucket.work = self.average.all_reduce(bucket.flat)
        self._launched += 1

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Make every trainable parameter's gradient final: averaged over DP and placed like its
        parameter (TP's partial sums added). A parameter no replica used keeps no gradient (the
        optimizer skips it, as it would in one process); one only some replicas used gets their
        average, the others counting zeros. Every replica runs the same collectives either way."""
        self._sync_queued = False
        if self.syncs and self._buckets:
            self._finish_all_reduces()
        if self._summed:
            self.experts.finish(self._summed)
        _reduce_partial_grads([p for p in self.module.parameters() if p.requires_grad and p.grad is not None])

    def _finish_all_reduces(self) -> None:
        """Launch what backward left (buckets with a gradient this rank did not produce, or all of
        them without overlap), in order; wait for each and average."""
        while self._launched < len(self._buckets):
            self._launch(self._buckets[self._launched])
        replicas = self.average.size()
        for bucket in self._buckets:
            wait_for_all_reduce(bucket.work)
            bucket.flat.div_(replicas)
            for p, view in zip(bucket.params, bucket.views):
                p.grad = DTensor.from_local(view, p.grad.device_mesh, p.grad.placements, run_check=False) \
                    if isinstance(p.grad, DTensor) else view
            bucket.work, bucket.waiting = None, len(bucket.params)
        self._launched = 0
        params = [p for b in self._buckets for p in b.params]
        tail = self._buckets[-1].views[-1]
        self.average.arrived(tail[len(params):])
        used = tail[:len(params)]  # the flags, summed over replicas
        if used.is_meta:  # framework.dryrun: meta tensors hold no flags; every parameter counts as used
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
        _place_like_parameter(p)
        if _partial_sums(p):
            partial.setdefault(p.grad.device_mesh, []).append(p)
    for mesh, group_params in partial.items():
        local_grads = [p.grad.to_local() for p in group_params]
        in_flat_buckets(local_grads, lambda flat: dist.all_reduce(flat, group=mesh.get_group()))
        for p, summed in zip(group_params, local_grads):
            p.grad = DTensor.from_local(summed, mesh, p.placements, run_check=False)


def _partial_sums(p: torch.Tensor) -> bool:
    """Whether TP left `p`'s gradient as per-rank partial sums of a replicated parameter."""
    return isinstance(p.grad, DTensor) and p.grad.placements != p.placements and \
        all(g.is_partial() and q.is_replicate() for g, q in zip(p.grad.placements, p.placements))


def _place_like_parameter(p: torch.Tensor) -> None:
    """Redistribute a gradient placed otherwise than its parameter (TP's partial sums excepted, summed
    later in one all-reduce), so its local shard is the parameter's: what DP averages."""
    if isinstance(p.grad, DTensor) and p.grad.placements != p.placements and not _partial_sums(p):
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def wait_for_all_reduce(work) -> None:
    """Where a rank waits for DP's all-reduces; the stall watchdog reports it as a collective
    (an async op's wait has no torch.distributed Python frame of its own), and the profiler
    counts it as one (framework.training.profiling; record_function costs nothing unprofiled)."""
    with torch.profiler.record_function("c10d::wait_for_all_reduce"):
        work.wait()


def in_flat_buckets(tensors: List[torch.Tensor], collective: Callable[[torch.Tensor], Any]) -> None:
    """Run `collective` in place on each bucket of `tensors` flattened into one tensor (one
    collective per bucket instead of one per tensor), then copy the results back."""
    for bucket in _buckets(tensors):
        flat = torch._utils._flatten_dense_tensors(bucket)
        collective(flat)
        for tensor, result in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
            tensor.copy_(result)


def _buckets(tensors: List[torch.Tensor], first_bucket_bytes: int = BUCKET_BYTES) -> List[List[torch.Tensor]]:
    """Group same-dtype tensors into buckets of at most BUCKET_BYTES (the first: first_bucket_bytes),
    keeping order. A DTensor counts its local shard, the same on every rank of a DP group (they
    share their TP coordinate)."""
    buckets: List[List[torch.Tensor]] = []
    size = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        nbytes = local.numel() * local.element_size()
        cap = first_bucket_bytes if len(buckets) == 1 else BUCKET_BYTES
        if not buckets or buckets[-1][0].dtype != t.dtype or size + nbytes > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets


def apply_dp(model: nn.Module, dp_mesh: Optional[DeviceMesh], overlap: Optional[bool] = None, experts: Any = None,
             across: Any = None, device_type: str = "cpu") -> DataParallel:
    """Wrap `model`; with no DP dim (dp_mesh None) and nothing `across` the wrapper only keeps
    the `.module` shape. `overlap` None (parallel.overlap_dp_sync's default): overlap on GPUs,
    whose collectives run beside compute, not on CPUs, where gloo's threads take the cores
    backward computes on (bench/README.md: 3% faster after backward on 2x1, up to 11% on 2x2)."""
    return DataParallel(model, dp_mesh, device_type == "cuda" if overlap is None else overlap, experts, across)
