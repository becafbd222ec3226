"""The DeviceMesh and a readable table of which ranks share which group.

torch 2.13's DeviceMesh repr no longer lists ranks, so `layout_table` prints, for every rank,
its coordinates and the ranks of each named submesh it belongs to. It is computed from the
shape alone, so the launcher and tests can use it without a process group.
"""
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def coordinates(shape: Sequence[int], rank: int) -> List[int]:
    """Row-major coordinates of `rank` in a mesh of `shape`."""
    coords = []
    for size in reversed(shape):
        rank, coord = divmod(rank, size)
        coords.append(coord)
    return coords[::-1]


def submesh_ranks(shape: Sequence[int], rank: int, dim: int) -> List[int]:
    """Ranks of the 1-D submesh along `dim` that contains `rank`."""
    stride = math.prod(shape[dim + 1:])
    first = rank - coordinates(shape, rank)[dim] * stride
    return [first + i * stride for i in range(shape[dim])]


def spanning_ranks(shape: Sequence[int], rank: int, dims: Sequence[int]) -> List[int]:
    """Ranks whose coordinates differ from `rank`'s only on `dims` (a group over several dims)."""
    mine = coordinates(shape, rank)
    return [r for r in range(math.prod(shape))
            if all(c == m for d, (c, m) in enumerate(zip(coordinates(shape, r), mine)) if d not in dims)]


def layout_table(shape: Sequence[int], dim_names: Sequence[str], spans: Optional[Dict[str, Sequence[str]]] = None) -> str:
    """One line per rank: coordinates on each dim, then the ranks of each named group, and of
    each group in `spans` (a role over several dims by name: {"ep": ["dp"]})."""
    shape = list(shape)  # a plain list: indexing an OmegaConf ListConfig costs seconds over 1024 ranks
    world = math.prod(shape)
    grid = torch.arange(world).reshape(tuple(shape)).tolist()
    spans = {label: [list(dim_names).index(d) for d in dims] for label, dims in (spans or {}).items() if dims}
    header = ["rank", *dim_names, *(f"{name} group" for name in [*dim_names, *spans])]
    rows = []
    for rank in range(world):
        groups = [str(submesh_ranks(shape, rank, d)) for d in range(len(shape))]
        groups += [str(spanning_ranks(shape, rank, dims)) for dims in spans.values()]
        rows.append([str(rank), *map(str, coordinates(shape, rank)), *groups])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    dims = ", ".join(f"{n}={s}" for n, s in zip(dim_names, shape))
    return f"DeviceMesh [{dims}] ranks {grid}\n" + "\n".join(lines)


def resolve_device(requested: str, gpu_count: int, local_ranks: int) -> Tuple[str, str, str]:
    """mesh.device_type's (device, default backend, why): `auto` is cuda with nccl when this host's
    GPUs (`gpu_count`, torch's) give each of its `local_ranks` ranks one, else cpu with gloo, so
    `make train` and every recipe use the GPUs where there are enough; cpu or cuda are taken as
    named (a cuda without enough GPUs is refused by validation)."""
    if requested != "auto":
        return requested, "nccl" if requested == "cuda" else "gloo", f"mesh.device_type={requested}"
    if gpu_count == 0:
        return "cpu", "gloo", "auto: no GPU"
    why = f"auto: {gpu_count} GPU{'s' * (gpu_count > 1)} for {local_ranks} local rank{'s' * (local_ranks > 1)}"
    return ("cuda", "nccl", why) if gpu_count >= local_ranks else ("cpu", "gloo", why)


def resolve_device_type(mesh_cfg: Any, local_ranks: int) -> None:
    """The config's mesh.device_type made concrete, and why (mesh.device_reason, which the
    rank-layout header shows): by the process that validates, so the ranks it starts, and every
    reader of the config after it, see one device. A config already resolved keeps its device."""
    if mesh_cfg.get("device_reason"):
        return
    requested = getattr(mesh_cfg.device_type, "value", mesh_cfg.device_type)
    gpus = torch.cuda.device_count() if requested == "auto" else 0
    mesh_cfg.device_type, _, mesh_cfg.device_reason = resolve_device(requested, gpus, local_ranks)


def device_line(mesh_cfg: Any) -> str:
    """The rank-layout header's device: 'device: cuda (auto: 8 GPUs for 8 local ranks)'."""
    device = getattr(mesh_cfg.device_type, "value", mesh_cfg.device_type)
    return f"device: {device} ({mesh_cfg.get('device_reason') or f'mesh.device_type={device}'})"


def build_mesh(device_type: str, shape: Sequence[int], dim_names: Sequence[str]) -> DeviceMesh:
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(dim_names))


def coordinates_on(submesh: Optional[DeviceMesh]) -> Dict[str, int]:
    """Size of a role's 1-D submesh and this rank's coordinate on it; no submesh is size 1."""
    if submesh is None:
        return {"size": 1, "rank": 0}
    return {"size": submesh.size(), "rank": submesh.get_local_rank()}
