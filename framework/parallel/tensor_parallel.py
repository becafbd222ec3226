"""Tensor parallelism: parallelize_module over the TP submesh with the config's plan."""
from typing import Any, Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from framework.plan import build_plan


def apply_tp(module: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, Mapping[str, Any]]) -> nn.Module:
    """Shard `module` in place per `plan`; an empty plan or a TP size of 1 leaves it as is."""
    if not plan or tp_mesh.size() == 1:
        return module
    return parallelize_module(module, tp_mesh, build_plan(plan))
