"""The DeviceMesh and a readable table of which ranks share which group.

torch 2.13's DeviceMesh repr no longer lists ranks, so `layout_table` prints, for every rank,
its coordinates and the ranks of each named submesh it belongs to. It is computed from the
shape alone, so the launcher and tests can use it without a process group.
"""
import math
from typing import Dict, List, Optional, Sequence

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


def build_mesh(device_type: str, shape: Sequence[int], dim_names: Sequence[str]) -> DeviceMesh:
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(dim_names))


def coordinates_on(submesh: Optional[DeviceMesh]) -> Dict[str, int]:
    """Size of a role's 1-D submesh and this rank's coordinate on it; no submesh is size 1."""
    if submesh is None:
        return {"size": 1, "rank": 0}
    return {"size": submesh.size(), "rank": submesh.get_local_rank()}
