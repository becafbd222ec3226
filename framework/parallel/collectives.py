"""One recorder of the collectives a piece of code issues, for framework.inspect (counts per
op, each module pass's collectives) and framework.dryrun (counts and bytes per op and mesh dim):
a TorchDispatchMode that sees DTensor's functional collectives and the c10d ones DataParallel
and FSDP issue alike, named as torch's CommDebugMode names them. (CommDebugMode itself fails on
a module run twice in one step: micro-batches, a reused submodule.)"""
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from framework.parallel.dtensors import local_bytes


def collective_name(func) -> Optional[str]:
    """`namespace.op` of a c10d collective, functional or in-place (`c10d_functional.all_reduce`,
    `c10d.allreduce_`); None for any other op (waits, wrappers and barriers included)."""
    namespace, _, name = func._schema.name.partition("::")
    if namespace not in ("_c10d_functional", "c10d") or any(w in name for w in ("wait", "wrap", "barrier")):
        return None
    return f"{namespace.lstrip('_')}.{name}"


def group_name(args) -> Optional[str]:
    """The group of a collective: c10d's in-place collectives pass it boxed, first; functional ones name it last."""
    boxed = [arg for arg in args if isinstance(arg, torch.ScriptObject)]
    if boxed:
        return dist.ProcessGroup.unbox(boxed[0]).group_name
    names = [arg for arg in args if isinstance(arg, str)]
    return names[-1] if names else None


def input_bytes(func, args, kwargs) -> int:
    """Every tensor argument but the output buffers (c10d's in-place ops name them output*)."""
    named = {**dict(zip((a.name for a in func._schema.arguments), args)), **kwargs}
    return sum(local_bytes(t) for name, value in named.items() if not name.startswith("output")
               for t in tree_leaves(value) if isinstance(t, torch.Tensor))


class CollectiveRecorder(TorchDispatchMode):
    """Calls `record(op, dim, bytes)` for each collective: its name, the mesh dim of its group
    (from `dim_of_group`, group name -> dim; `unknown` when not there) and its input bytes."""

    def __init__(self, record: Callable[[str, str, int], None], dim_of_group: Dict[str, str] = None,
                 unknown: str = "?"):
        super().__init__()
        self.record, self.dim_of_group, self.unknown = record, dim_of_group or {}, unknown

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = collective_name(func)
        if op:
            self.record(op, self.dim_of_group.get(group_name(args), self.unknown), input_bytes(func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def counted(totals: Dict, key_of: Callable[[str, str], object]) -> Callable[[str, str, int], None]:
    """A `record` that adds [count, bytes] per key_of(op, dim) into `totals`."""
    def record(op: str, dim: str, size: int) -> None:
        entry = totals.setdefault(key_of(op, dim), [0, 0])
        entry[0] += 1
        entry[1] += size
    return record

