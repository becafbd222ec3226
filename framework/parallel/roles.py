"""Which mesh dim plays which role, and how large each role is: made from the config alone
(no process group), so validation, the dry run and the builder read the same answer
(torchtitan's ParallelDims). Once the DeviceMesh exists, it also picks each role's submesh.

Roles: `tp` (parallel.tp_dim), `dp` (parallel.dp_dim) and, when the mesh has a dim named
parallel.dp_replicate_dim, the outer DP dim of hsdp; data parallelism spans both DP dims,
outer first. A role whose dim is null or absent has size 1.
"""
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class MeshRoles:
    shape: Tuple[int, ...]
    dim_names: Tuple[str, ...]
    dp_dim: Optional[str]
    tp_dim: Optional[str]
    dp_replicate_dim: str

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "MeshRoles":
        p = cfg.parallel
        return cls(tuple(cfg.mesh.shape), tuple(cfg.mesh.dim_names), p.dp_dim, p.tp_dim, p.dp_replicate_dim)

    @property
    def world(self) -> int:
        return math.prod(self.shape)

    def size(self, name: Optional[str]) -> int:
        return self.shape[self.dim_names.index(name)] if name in self.dim_names else 1

    @property
    def dp_dims(self) -> List[str]:
        """The mesh dims data parallelism spans, outer first."""
        outer = [self.dp_replicate_dim] if self.dp_replicate_dim in self.dim_names else []
        return outer + ([self.dp_dim] if self.dp_dim is not None else [])

    @property
    def dp_size(self) -> int:
        return math.prod(self.size(name) for name in self.dp_dims)

    @property
    def tp_size(self) -> int:
        return self.size(self.tp_dim)

    def tp_mesh(self, mesh: DeviceMesh) -> Optional[DeviceMesh]:
        return None if self.tp_dim is None else mesh[self.tp_dim]

    def dp_mesh(self, mesh: DeviceMesh) -> Optional[DeviceMesh]:
        """The DP ranks as one 1-D mesh (None without DP). Two dims are flattened row-major, so
        the coordinate is outer x inner: DP's replica index under any strategy.
        DeviceMesh._flatten is private in torch 2.13; torchtitan flattens its DP dims the same way."""
        dims = self.dp_dims
        if not dims:
            return None
        return mesh[dims[0]] if len(dims) == 1 else mesh[tuple(dims)]._flatten()

    def sharding_mesh(self, mesh: DeviceMesh, strategy: str) -> Optional[DeviceMesh]:
        """What fully_shard shards over: hsdp the 2-D (replicate, shard) mesh, fsdp every DP rank."""
        return mesh[tuple(self.dp_dims)] if strategy == "hsdp" else self.dp_mesh(mesh)
