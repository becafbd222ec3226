"""Expert parallelism: each mixture-of-experts block's experts spread over the ranks of
`parallel.ep_dims` (every DP dim, the tp dim, or both), every token slot sent to its expert's
rank and back with the uneven all-to-all (the per-expert counts exchanged first), forward and
backward alike. The TP ranks of a group hold the same (replicated) tokens: when the experts span
the tp dim each TP rank dispatches only its share of them, and the shares are gathered back
(torchtitan's EP borrowing TP ranks), so no token is computed twice.

The stacked expert weights become DTensors sharded on the expert dim over the EP mesh, so each
rank computes only its own experts, and checkpoints (DCP) keep the whole stacks under the same
names whatever the EP size. An expert spread over the DP ranks sums the contributions of every
replica's tokens it served, each replica's loss already scaled for DP's average: DataParallel
divides its gradient by the DP size instead of all-reducing it (ExpertGradients, below),
and under fsdp the experts stay out of FSDP2's sharding with their gradient divided alike
(fully_shard.apply_fsdp). Spread over some DP dims, they are summed over the others under
replicate, and FSDP2-sharded over them under fsdp / hsdp (torchtitan's efsdp). Experts over the
tp dim alone are replicated over DP like any TP shard, and averaged as one. The router's load statistics pool over the DP ranks
(framework.models.moe.load_balance_loss) with or without EP.
"""
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from framework.models.protocol import offered
from framework.parallel.data_parallel import in_flat_buckets


def spread_over_dp(param: torch.Tensor, dp_group: Optional[dist.ProcessGroup]) -> bool:
    """A DTensor sharded over a mesh that holds other DP ranks than this one (an expert stack
    under expert parallelism over DP dims, and maybe TP's: DP ranks hold other experts). Its
    gradient already sums the contributions of the replicas whose tokens the expert served:
    ExpertGradients sums it over the DP ranks holding the same experts (none when EP spans every
    DP dim) and divides it by the DP size, instead of averaging it over DP; the replica check skips
    it. Told from its placement, which survives what replaces Parameters (to_empty), not from a
    mark on the Parameter."""
    return isinstance(param, DTensor) and dp_group is not None and param.device_mesh.ndim == 1 \
        and param.placements[0].is_shard() \
        and len(set(dist.get_process_group_ranks(dp_group)) & set(param.device_mesh.mesh.flatten().tolist())) > 1


class ExpertGradients:
    """What replicate's DataParallel hands the experts spread over DP ranks (spread_over_dp): it
    leaves them out of its buckets and calls finish() after its own sync. Each one's gradient
    already sums the contributions of the replicas whose tokens it served: summed over the DP
    ranks holding the same experts (`expert_replicas`; none when EP spans every DP dim), then
    divided by the DP size, which the other gradients are averaged over."""

    def __init__(self, dp_group: Optional[dist.ProcessGroup], dp_size: int, expert_replicas: Optional[DeviceMesh]):
        self.dp_group, self.dp_size = dp_group, dp_size
        self.replica_group = expert_replicas.get_group() if expert_replicas is not None else None

    def owns(self, param: torch.Tensor) -> bool:
        return spread_over_dp(param, self.dp_group)

    @torch.no_grad()
    def finish(self, params: List[nn.Parameter]) -> None:
        if self.replica_group is not None:
            for p in params:
                if p.grad is None:  # (not used by this rank's tokens: nothing to add)
                    p.grad = torch.zeros_like(p)
            local = [p.grad.to_local() for p in params]
            in_flat_buckets(local, lambda flat: dist.all_reduce(flat, group=self.replica_group))
            for p, summed in zip(params, local):
                p.grad = DTensor.from_local(summed, p.grad.device_mesh, p.grad.placements, run_check=False)
        for p in params:
            if p.grad is not None:
                p.grad.div_(self.dp_size)


def _gather_shares(share: torch.Tensor, sizes: List[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's share (of `sizes`, the same list on every rank), concatenated in rank order."""
    longest = max(sizes)
    padded = [share.new_empty(longest, *share.shape[1:]) for _ in sizes]
    dist.all_gather(padded, torch.cat([share, share.new_zeros(longest - len(share), *share.shape[1:])]), group=group)
    return torch.cat([piece[:size] for piece, size in zip(padded, sizes)])


class _TakeShare(torch.autograd.Function):
    """This TP rank's share of token slots every TP rank holds alike. The share's gradient is
    gathered back in backward, so each rank holds the whole gradient of the replicated slots
    again (DTensor's Replicate -> Shard, as torchtitan's EP borrowing TP does)."""

    @staticmethod
    def forward(ctx, slots: torch.Tensor, sizes: List[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.sizes, ctx.group = sizes, group
        start = sum(sizes[:dist.get_rank(group)])
        return slots[start:start + sizes[dist.get_rank(group)]]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_shares(grad.contiguous(), ctx.sizes, ctx.group), None, None


class _GatherShares(torch.autograd.Function):
    """The TP ranks' shares gathered back into the whole (Shard -> Replicate): everything after
    it is computed alike on every TP rank, so backward keeps this rank's share of the gradient."""

    @staticmethod
    def forward(ctx, share: torch.Tensor, sizes: List[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.start, ctx.size = sum(sizes[:dist.get_rank(group)]), sizes[dist.get_rank(group)]
        return _gather_shares(share, sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.start:ctx.start + ctx.size], None, None


def dispatch_over(group: dist.ProcessGroup, tp_group: Optional[dist.ProcessGroup] = None
                  ) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]:
    """A dispatch (ModelProtocol.use_expert_parallel) over the EP ranks of `group`, for experts
    as ModelProtocol.expert_modules describes them: rank r holds experts r*L .. r*L + L - 1 (L =
    n_experts / EP). Slots sorted by expert go to their experts' ranks in one all-to-all, are
    regrouped there by local expert, run, put back in arrival order, and return in another.
    With `tp_group` (the experts span the tp dim) this rank sends only its TP share of the slots."""
    size = dist.get_world_size(group)

    def exchange(experts: nn.Module, slots: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        local = experts.n_experts // size
        order = expert_ids.argsort(stable=True)
        counts = experts.slots_per_expert(expert_ids)
        arriving = torch.empty_like(counts)  # [source rank, local expert]: what each rank sends to mine
        dist.all_to_all_single(arriving, counts, group=group)
        if slots.is_meta:  # framework.dryrun's fake exchange moves nothing: every rank routes as this one
            arriving = counts.view(size, local)[dist.get_rank(group)].repeat(size)
        sent = counts.view(size, local).sum(dim=1).tolist()
        received = arriving.view(size, local).sum(dim=1).tolist()
        arrived = all_to_all_single_autograd(slots[order], received, sent, group)
        # arrival order is (source, expert); the experts want (expert, source)
        run = torch.repeat_interleave(torch.arange(size * local, device=counts.device), arriving)
        by_expert = ((run % local) * size + run // local).argsort(stable=True).to(slots.device)
        computed = experts(arrived[by_expert], arriving.view(size, local).sum(dim=0).tolist())
        back = computed[by_expert.argsort()]
        returned = all_to_all_single_autograd(back, sent, received, group)
        return returned[order.argsort()]

    def dispatch(experts: nn.Module, slots: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        if tp_group is None:
            return exchange(experts, slots, expert_ids)
        tp_size = dist.get_world_size(tp_group)
        shares = [len(slots) // tp_size + (rank < len(slots) % tp_size) for rank in range(tp_size)]
        start = sum(shares[:dist.get_rank(tp_group)])
        mine = expert_ids[start:start + shares[dist.get_rank(tp_group)]]
        return _GatherShares.apply(exchange(experts, _TakeShare.apply(slots, shares, tp_group), mine), shares, tp_group)

    # eager under trainer.compile=blocks: its splits are the counts just exchanged, which a traced
    # graph cannot take (the block compiles around it)
    return torch._dynamo.disable(dispatch)


def apply_ep(model: nn.Module, ep_mesh: Optional[DeviceMesh], token_group: Optional[dist.ProcessGroup],
             tp_mesh: Optional[DeviceMesh] = None) -> None:
    """Experts sharded over `ep_mesh` (None: every rank keeps them all), and the routing
    statistics pooled over `token_group` (the DP ranks, which hold other tokens). `tp_mesh`:
    the experts span the tp dim, whose ranks split their replicated tokens."""
    experts = offered(model).expert_modules()
    if not experts:
        return
    if ep_mesh is None or ep_mesh.size() == 1:
        offered(model).use_expert_parallel(token_group, None)
        return
    for module in experts:
        for name, stack in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(distribute_tensor(stack.data, ep_mesh, [Shard(0)])))
    tp_group = tp_mesh.get_group() if tp_mesh is not None else None
    offered(model).use_expert_parallel(token_group, dispatch_over(ep_mesh.get_group(), tp_group))


def update_biases_after_each_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """What the model moves after each optimizer step (ModelProtocol.optimizer_step_hook:
    DeepSeek-V3's expert biases, from the step's global load), as torchtitan hooks its optimizers."""
    hook = offered(model).optimizer_step_hook()
    if hook is not None:
        optimizer.register_step_post_hook(lambda *_: hook())


