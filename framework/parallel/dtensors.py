"""DTensors and FSDP2's modules, handled without importing torch.distributed.tensor or
torch.distributed.fsdp: the launcher imports the models' and adapters' modules to validate a
config and must not pay for those imports (seconds). A DTensor (an FSDP2 module) exists only once
its module is loaded, so until then none is one, and where one is, its module is read from
sys.modules: no import is deferred for their sake."""
import sys
from typing import Dict, Iterable, List

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def _is(value: object, module_name: str, class_name: str) -> bool:
    module = sys.modules.get(module_name)
    return module is not None and isinstance(value, getattr(module, class_name))


def is_dtensor(tensor: torch.Tensor) -> bool:
    return _is(tensor, "torch.distributed.tensor", "DTensor")


def is_async_collective(tensor: torch.Tensor) -> bool:
    """A functional collective's result still in flight (TP's async redistribute)."""
    return _is(tensor, "torch.distributed._functional_collectives", "AsyncCollectiveTensor")


def dtensor_api():
    """torch.distributed.tensor, for code that holds a DTensor (so the module is loaded)."""
    return sys.modules["torch.distributed.tensor"]


def global_offset(tensor: torch.Tensor) -> List[int]:
    """Where a DTensor's local shard starts in the whole tensor, per dim (what DCP computes)."""
    utils = sys.modules["torch.distributed.tensor._utils"]
    return list(utils.compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)[1])


def reshard(module: torch.nn.Module) -> None:
    """FSDP2 keeps a root unsharded after a forward with no backward (a reference's, KTO's KL
    estimate's, GRPO's generation): free its gathered parameters."""
    if _is(module, "torch.distributed.fsdp", "FSDPModule"):
        module.reshard()


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor without an autograd op (to_local's): for counting storage."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor


def local_bytes(tensor: torch.Tensor) -> int:
    """The bytes of the storage behind it: a tensor subclass (QLoRA's NF4 weight) by its inner
    tensors, not by its logical shape and dtype."""
    local = local_tensor(tensor)
    if is_traceable_wrapper_subclass(local):
        names, _ = local.__tensor_flatten__()
        return sum(local_bytes(getattr(local, name)) for name in names)
    return local.numel() * local.element_size()


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole on every rank; a plain tensor as it is."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def by_mesh(tensors: Iterable[torch.Tensor]) -> List[List[torch.Tensor]]:
    """The tensors in lists of one kind each, in their order: plain tensors, and the DTensors of
    each device mesh. A foreach or fused kernel (AdamW's) takes one kind alone: DTensor refuses
    a list that mixes plain tensors with DTensors (a TP plan leaving norms whole) or two meshes
    (experts on their own)."""
    kinds: Dict[object, List[torch.Tensor]] = {}
    for tensor in tensors:
        kinds.setdefault(tensor.device_mesh if is_dtensor(tensor) else None, []).append(tensor)
    return list(kinds.values())


@torch.no_grad()
def place_whole(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write `full`, a parameter's whole value (the same on every rank), into `param`: a DTensor
    (FSDP2, TP, EP shards) keeps this rank's part of it, cut here without any communication."""
    if param.is_meta:
        return
    if is_dtensor(param):
        part = dtensor_api().distribute_tensor(full.to(local_tensor(param).device), param.device_mesh, param.placements,
                                 src_data_rank=None)
        local_tensor(param).copy_(local_tensor(part))
    else:
        param.copy_(full)
