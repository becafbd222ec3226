"""Sharded data parallelism with torch's FSDP2 (`fully_shard`), after TP on the same mesh.

`parallel.dp_strategy: fsdp` shards parameters, gradients and optimizer state over every DP
rank; `hsdp` shards along `dp` and replicates along `dp_replicate` (a 2-D DP mesh, for which
torch reduce-scatters within a shard group and all-reduces across replicas). torch's
fully_shard takes parameters TP has already made DTensors and gives them one more mesh dim, so
this runs after `tensor_parallel` (the `fully_shard` stage); the other order is refused by
framework.validate. Gradients come out of backward averaged over DP and placed like their
parameters (FSDP2 also sums the partial gradients TP leaves on replicated parameters).
"""
import warnings
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from framework.models.protocol import offered
from framework.parallel.data_parallel import NoGradientSync
from framework.parallel.expert_parallel import spread_over_dp

# FSDP2 warns that an in-place op on a unit's output (a view) would skip its gradient hook; the
# loss reads the model's output out of place, and the blocks' residual adds are out of place.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")


def mixed_precision_policy(mixed_precision: Optional[str], root: bool) -> MixedPrecisionPolicy:
    """bf16: parameters all-gathered and computed in bf16, gradients reduced in fp32 into fp32
    shards (the optimizer's master weights); the root's output back in fp32 for the loss."""
    if mixed_precision != "bf16":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                output_dtype=torch.float32 if root else None)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, mixed_precision: Optional[str],
               dp_group: Optional[dist.ProcessGroup] = None, expert_replicas: Optional[DeviceMesh] = None) -> nn.Module:
    """fully_shard each unit (ModelProtocol.fsdp_units), then the root (which holds what no unit
    does), over `dp_mesh`: 1-D for fsdp, (dp_replicate, dp) for hsdp.

    Experts spread over DP ranks (expert parallelism, `dp_group` the DP ranks flattened) already
    sum, in their gradient, the tokens of every rank they served. Spread over every DP dim they
    have no FSDP share left: they stay out of FSDP's sharding (ignored_params), their gradient
    divided by the DP size as FSDP divides the others' reduced sums (torchtitan's gradient divide
    factor for experts). Spread over some DP dims, each expert has replicas on the rest
    (`expert_replicas`): FSDP2 shards each block's experts over those ranks (torchtitan's efsdp),
    and its reduce-scatter's sum is divided by the DP size alike."""
    if expert_replicas is not None:
        dp_size = dist.get_world_size(dp_group)
        for experts_module in offered(model).expert_modules():
            fully_shard(experts_module, mesh=expert_replicas, mp_policy=mixed_precision_policy(mixed_precision, False))
            # a sum, divided after it (gloo has no pre-multiplied sum for a divide factor of its own)
            experts_module.set_force_sum_reduction_for_comms(True)
            experts_module.set_gradient_divide_factor(float(dp_size))
    experts = {p for p in model.parameters() if spread_over_dp(p, dp_group)} if expert_replicas is None else set()
    # Over one rank FSDP2 shards nothing, and torchao's NF4 all-gather fails there (its
    # post-all-gather receives one of its three tensors: torch 2.13, torchao 0.18): QLoRA's frozen
    # NF4 weights stay out of it.
    alike = {p for p in offered(model).alike_on_every_rank() if isinstance(p, nn.Parameter)} \
        if dp_mesh.size() == 1 else set()
    for unit in offered(model).fsdp_units():
        fully_shard(unit, mesh=dp_mesh, mp_policy=mixed_precision_policy(mixed_precision, root=False),
                    ignored_params=(experts | alike) or None)
    sharded = fully_shard(model, mesh=dp_mesh, mp_policy=mixed_precision_policy(mixed_precision, root=True),
                          ignored_params=(experts | alike) or None)
    for param in experts:
        param.register_hook(lambda grad, size=dp_mesh.size(): grad / size)  # (dp_mesh: all of dp_group's ranks)
    return sharded


class FullyShardedSync(NoGradientSync):
    """fsdp / hsdp's face to the Trainer (framework.parallel.data_parallel.NoGradientSync): each
    backward reduce-scatters its gradients itself; a pipeline schedule drives its stages' syncs."""

    def __init__(self, model: FSDPModule):
        self.model = model

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside add to the (unsharded) gradients without reduce-scattering them
        (every unit: recurse): gradient accumulation syncs once, after the step's last micro-batch."""
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)
