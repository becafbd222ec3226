"""Tensor parallelism: parallelize_module over the TP submesh with the config's plan
(checked beforehand by framework.parallel.plan)."""
from fnmatch import fnmatch
from typing import Any, Dict, Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from framework.models.protocol import offered
from framework.parallel.plan import LAYOUT, LAYOUT_OPTIONS, ROOT, STYLE_OPTIONS

STYLE_CLASSES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "sequence_parallel": SequenceParallel,
    "prepare_module_input": PrepareModuleInput,
    "prepare_module_output": PrepareModuleOutput,
    "prepare_module_input_output": PrepareModuleInputOutput,
}
assert STYLE_CLASSES.keys() == STYLE_OPTIONS.keys()


def to_placement(value: Any) -> Placement | tuple | None:
    """`replicate` -> Replicate(), `shard(d)` -> Shard(d), null -> None, a list -> a tuple."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return tuple(to_placement(v) for v in value)
    match = LAYOUT.match(str(value).strip().lower())
    return Replicate() if match.group(1) == "replicate" else Shard(int(match.group(2)))


def build_plan(plan: Mapping[str, Mapping[str, Any]]) -> ParallelStyle | Dict[str, ParallelStyle]:
    """What parallelize_module takes: FQN pattern -> ParallelStyle, or one style for the root."""
    built = {}
    for pattern, entry in plan.items():
        kwargs = {option: to_placement(entry[option]) if option in LAYOUT_OPTIONS else entry[option]
                  for option in STYLE_OPTIONS[entry["style"]] if entry.get(option) is not None}
        built[pattern] = STYLE_CLASSES[entry["style"]](**kwargs)
    return built.pop(ROOT) if ROOT in built else built


def entries_present(module: nn.Module, plan: Mapping[str, Mapping[str, Any]]) -> Dict[str, Mapping[str, Any]]:
    """The plan's entries that name a submodule of `module` (matched as parallelize_module
    matches: fnmatch per dotted token). A pipeline stage holds only its own layers, so the
    entries for the others' (tok_embeddings, output) are not for it; validation checked the
    plan against the whole model already, and torch would warn with the whole module's repr."""
    names = [name.split(".") for name, _ in module.named_modules() if name]

    def present(pattern: str) -> bool:
        tokens = pattern.split(".")
        return any(len(name) == len(tokens) and all(map(fnmatch, name, tokens)) for name in names)

    return {pattern: entry for pattern, entry in plan.items() if pattern == ROOT or present(pattern)}


def apply_tp(module: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, Mapping[str, Any]]) -> nn.Module:
    """Shard `module` in place per `plan` (its entries for this module's parts); an empty plan
    or a TP size of 1 leaves it as is."""
    plan = entries_present(module, plan) if plan else plan
    if not plan or tp_mesh.size() == 1:
        return module
    with offered(module).tp_set_aside():  # LoRA's adapters, placed for their layers' layouts after
        return parallelize_module(module, tp_mesh, build_plan(plan))
