"""The bytes a rank holds for its training state, from the local shards it really holds:
parameters, their gradients and the optimizer's state. Recorded by the training loop after the
first step (summary.json `memory`, TensorBoard) and estimated by framework.dryrun on meta."""
from typing import Dict

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
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
