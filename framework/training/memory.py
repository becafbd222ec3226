"""The bytes a rank holds for its training state, from the local shards it really holds:
parameters, their gradients and the optimizer's state. Recorded by the training loop after the
first step (summary.json `memory`, TensorBoard) and estimated by framework.dryrun on meta; and
the activations autograd saves for backward (framework.dryrun, bench/pipeline.py)."""
from typing import Dict, List

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def local_bytes(tensor: torch.Tensor) -> int:
    """The bytes of the storage behind it: a tensor subclass (QLoRA's NF4 weight) by its inner
    tensors, not by its logical shape and dtype."""
    local = local_tensor(tensor)
    if is_traceable_wrapper_subclass(local):
        names, _ = local.__tensor_flatten__()
        return sum(local_bytes(getattr(local, name)) for name in names)
    return local.numel() * local.element_size()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, int]:
    """Gradients count as the trainable parameters' shards (placed like them, whether or not a
    step has made them yet); optimizer state as its tensors with a dim (momenta, second
    moments), not its scalar step counters."""
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    sizes = {"parameters": sum(local_bytes(p) for p in params),
             "gradients": sum(local_bytes(p) for p in params if p.requires_grad),
             "optimizer_state": sum(local_bytes(t) for t in state)}
    return {**sizes, "total": sum(sizes.values())}


class SavedActivations:
    """The peak bytes of the tensors autograd holds for backward, once per storage, parameters
    excluded: a saved_tensors_hooks pair whose packed handle gives its storage back when
    autograd frees it (after that backward). Works on any device, meta included."""

    def __init__(self, parameters: List[torch.Tensor]):
        self.parameters = {local_tensor(p).untyped_storage()._cdata for p in parameters}
        self.holders: Dict[int, int] = {}  # storage -> saved tensors holding it
        self.bytes = self.peak = 0

    def pack(self, tensor: torch.Tensor):
        storage = local_tensor(tensor).untyped_storage()
        key = storage._cdata
        if key in self.parameters or _of_a_parameter(tensor):
            return tensor
        if key not in self.holders:
            self.bytes += storage.nbytes()
            self.peak = max(self.peak, self.bytes)
        self.holders[key] = self.holders.get(key, 0) + 1
        return _Saved(tensor, key, storage.nbytes(), self)

    @staticmethod
    def unpack(saved) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def release(self, key: int, nbytes: int) -> None:
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]
            self.bytes -= nbytes

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _of_a_parameter(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one, whatever its storage: FSDP's all-gathered parameters, which
    FSDP frees after their unit's forward (and gathers again for backward)."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


class _Saved:
    def __init__(self, tensor: torch.Tensor, key: int, nbytes: int, owner: SavedActivations):
        self.tensor, self.key, self.nbytes, self.owner = tensor, key, nbytes, owner

    def __del__(self):
        self.owner.release(self.key, self.nbytes)
