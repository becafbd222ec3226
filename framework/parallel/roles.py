"""Which mesh dim plays which role, and how large each role is: made from the config alone
(no process group), so validation, the dry run and the builder read the same answer
(torchtitan's ParallelDims). It checks the roles (before launch: validate calls it), and once
the DeviceMesh exists it picks each role's submesh.

Roles: `tp` (parallel.tp_dim), `dp` (parallel.dp_dim) and, when the mesh has a dim named
parallel.dp_replicate_dim, the outer DP dim of hsdp; data parallelism spans both DP dims,
outer first; `pp` (parallel.pp_dim, when the mesh has a dim of that name, outermost): pipeline
stages; `ep` (parallel.ep_dims, by name): the dims a mixture of experts' experts are spread over
(framework.parallel.expert_parallel): every DP dim, the tp dim, or both; `cp` (parallel.cp_dim): the
ranks that split each sequence (framework.parallel.context_parallel), between DP and TP. A role
whose dim is null or absent has size 1.

Names: "dp" is always the DP dims alone, the ranks whose samples differ (`dp_dims`, `dp_size`,
`dp_mesh`: the sampler splits the global batch over them); "dp_cp" is the DP dims and a cp dim,
the ranks that hold the same weights and other tokens (`dp_cp_dims`, `dp_cp_mesh`, and the run's
`dp_cp`): the gradient average, the FSDP sharding and the loss's count span them, since a CP rank
holds other tokens of the same weights, as a DP rank does (torchtitan's dp_cp). Without a cp dim
the two are the same ranks.
"""
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh

from framework.config.errors import ConfigError
from framework.parallel.mesh import submesh_ranks


@dataclass(frozen=True)
class MeshRoles:
    shape: Tuple[int, ...]
    dim_names: Tuple[str, ...]
    dp_dim: Optional[str]
    tp_dim: Optional[str]
    dp_replicate_dim: str
    pp_dim: Optional[str] = None
    ep_dims: Tuple[str, ...] = ()
    cp_dim: Optional[str] = None

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "MeshRoles":
        p = cfg.parallel
        return cls(tuple(cfg.mesh.shape), tuple(cfg.mesh.dim_names), p.dp_dim, p.tp_dim, p.dp_replicate_dim,
                   p.get("pp_dim"), tuple(p.get("ep_dims") or ()), p.get("cp_dim"))

    def check(self) -> None:
        """The mesh's dims and sizes, and every role on a dim of its own (a dim larger than 1
        without a role would be a silent replica)."""
        shape, names = list(self.shape), list(self.dim_names)
        if len(shape) != len(names):
            raise ConfigError("mesh.dim_names", names, f"give one name per dim of mesh.shape={shape}")
        if len(set(names)) != len(names):
            raise ConfigError("mesh.dim_names", names, "dim names must be unique")
        for name, size in zip(names, shape):
            if size < 1:
                raise ConfigError("mesh.shape", shape, f"dim {name!r} has size {size}; every size must be >= 1")
        dp, tp, replicate = self.dp_dim, self.tp_dim, self.dp_replicate_dim
        for key, name in (("parallel.dp_dim", dp), ("parallel.tp_dim", tp)):
            if name is not None and name not in names:
                raise ConfigError(key, name, f"name one of the mesh dims {names}, or null for no such parallelism")
        if dp is not None and dp == tp:
            raise ConfigError("parallel.tp_dim", tp, "DP and TP need different mesh dims")
        if replicate in (dp, tp):
            raise ConfigError("parallel.dp_replicate_dim", replicate,
                              "must differ from parallel.dp_dim and parallel.tp_dim")
        if replicate in names and (dp is None or names.index(replicate) > names.index(dp)):
            raise ConfigError("mesh.dim_names", names,
                              f"the DP replica dim {replicate!r} (parallel.dp_replicate_dim) needs the DP dim "
                              f"parallel.dp_dim={dp!r} inside it, as in conf/mesh/2x2x1.yaml: [dp_replicate, dp, tp]")
        pp = self.pp_dim
        if pp in names and pp in (dp, tp, replicate):
            raise ConfigError("parallel.pp_dim", pp, "PP needs a mesh dim of its own, apart from DP's and TP's")
        if pp in names and names.index(pp) != 0 and self.size(pp) > 1:
            raise ConfigError("mesh.dim_names", names, f"the PP dim {pp!r} must be outermost (first), as in "
                                                       f"conf/mesh/pp2x2x1.yaml: [pp, dp, tp]; its stages exchange "
                                                       f"activations least often, so they may sit farthest apart")
        self.check_ep()
        self.check_cp()
        for name, size in zip(names, shape):
            if name not in (dp, tp, replicate, pp, self.cp_dim) and size > 1:
                raise ConfigError("mesh.shape", shape,
                                  f"dim {name!r} has size {size} but no role; set parallel.dp_dim, "
                                  f"parallel.tp_dim, parallel.cp_dim or parallel.pp_dim to it, or make it size 1")

    def check_cp(self) -> None:
        """CP's dim exists, is its own, and sits inside the DP dims (outside TP, whose groups
        exchange more often): [pp, dp_replicate, dp, cp, tp]."""
        cp, names = self.cp_dim, list(self.dim_names)
        if cp not in names:  # (null, or a name the mesh has no dim of: no context parallelism)
            return
        if cp in (self.dp_dim, self.tp_dim, self.dp_replicate_dim, self.pp_dim):
            raise ConfigError("parallel.cp_dim", cp, "CP needs a mesh dim of its own, apart from DP's, TP's and PP's")
        if any(names.index(d) > names.index(cp) for d in [*self.dp_dims, self.pp_dim] if d in names):
            raise ConfigError("mesh.dim_names", names, f"the CP dim {cp!r} goes inside the DP and PP dims, e.g. "
                                                       f"[dp, cp, tp] (conf/mesh/1x2x2cp.yaml)")

    def check_ep(self) -> None:
        """EP's dims exist and are DP dims or the tp dim: experts spread where the tokens differ
        (DP), or over TP ranks that split their replicated tokens between them. The DP dims EP
        leaves out hold replicas of each expert (expert_replica_dims)."""
        names, ep = list(self.dim_names), list(self.ep_dims)
        if len(set(ep)) < len(ep):
            raise ConfigError("parallel.ep_dims", ep, "names a dim twice; name each dim once")
        for name in ep:
            if name not in names:
                raise ConfigError("parallel.ep_dims", ep, f"{name!r} is not a mesh dim; name some of {names}, or null")
            if name == self.pp_dim:
                raise ConfigError("parallel.ep_dims", ep, "experts cannot spread over the pp dim, "
                                                          "whose ranks hold other layers")
            if name not in [*self.dp_dims, self.tp_dim]:
                raise ConfigError("parallel.ep_dims", ep, f"{name!r} is neither a DP dim {self.dp_dims} nor the tp "
                                                          f"dim {self.tp_dim!r}; experts spread over those")

    def check_strategy(self, strategy: str) -> None:
        """fsdp needs DP ranks to shard over; hsdp a replica dim outside the shard dim."""
        if strategy == "fsdp" and not self.dp_dims:
            raise ConfigError("parallel.dp_strategy", "fsdp",
                              "shards over the DP ranks, and parallel.dp_dim is null; name a DP mesh dim "
                              "(mesh=4x1 or 2x2), or use dp_strategy=replicate")
        if strategy == "hsdp" and len(self.dp_dims) != 2:
            raise ConfigError("parallel.dp_strategy", "hsdp",
                              f"needs two DP dims, parallel.dp_replicate_dim={self.dp_replicate_dim!r} (replicas) "
                              f"outside parallel.dp_dim={self.dp_dim!r} (shards), and mesh.dim_names="
                              f"{list(self.dim_names)} has {self.dp_dims}; use mesh=2x2x1 or mesh=2x1x2, or "
                              f"dp_strategy=fsdp")

    def check_tp_placement(self, ranks_per_host: int, enforce_innermost: bool, allow_across_hosts: bool) -> None:
        """TP exchanges activations every layer: keep its group on the innermost dim, inside one
        host. torch >= 2.9 no longer refuses an outer TP dim, so the framework does."""
        if self.tp_size == 1:
            return
        shape, names, tp = list(self.shape), list(self.dim_names), self.tp_dim
        tp_index = names.index(tp)
        inner_dims = [n for n, s in zip(names[tp_index + 1:], shape[tp_index + 1:]) if s > 1]
        if inner_dims and enforce_innermost:
            raise ConfigError("mesh.dim_names", names,
                              f"the TP dim {tp!r} must be innermost (last of the dims larger than 1) so its "
                              f"ranks are neighbours; reorder the mesh, or set "
                              f"parallel.enforce_tp_innermost=false to keep {inner_dims} inside it anyway")
        if allow_across_hosts:
            return
        for rank in range(self.world):
            group = submesh_ranks(shape, rank, tp_index)
            hosts = sorted({r // ranks_per_host for r in group})
            if len(hosts) > 1:
                raise ConfigError("mesh.shape", shape,
                                  f"TP group {group} spans hosts {hosts} ({ranks_per_host} ranks per host); "
                                  f"make the TP size divide the ranks per host, or set "
                                  f"parallel.allow_tp_across_hosts=true")

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

    @property
    def pp_size(self) -> int:
        return self.size(self.pp_dim)

    @property
    def cp_size(self) -> int:
        return self.size(self.cp_dim)

    def cp_mesh(self, mesh: DeviceMesh) -> Optional[DeviceMesh]:
        return mesh[self.cp_dim] if self.cp_size > 1 else None

    @property
    def dp_cp_dims(self) -> List[str]:
        """The dims whose ranks hold the same weights and other tokens: DP's, then cp."""
        return self.dp_dims + ([self.cp_dim] if self.cp_size > 1 else [])

    def spans(self) -> Dict[str, List[str]]:
        """The roles over several dims, for the rank-layout table: EP's, and with cp the
        gradient group (DP and cp)."""
        spans = {"ep": list(self.ep_dims)}
        if self.cp_size > 1:
            spans["dp+cp"] = self.dp_cp_dims
        return spans

    def dp_cp_mesh(self, mesh: DeviceMesh) -> Optional[DeviceMesh]:
        """The dp_cp_dims' ranks as one 1-D mesh (the DP mesh with cp; dp_mesh without a cp dim)."""
        return self._flattened(mesh, self.dp_cp_dims)

    @property
    def ep_size(self) -> int:
        return math.prod(self.size(name) for name in self.ep_dims)

    @property
    def ep_dims_in_mesh_order(self) -> List[str]:
        return [name for name in self.dim_names if name in self.ep_dims]

    @property
    def ep_spans_tp(self) -> bool:
        """Experts spread over the TP ranks too: each TP rank dispatches its share of the tokens."""
        return self.tp_dim in self.ep_dims and self.tp_size > 1

    @property
    def expert_replica_dims(self) -> List[str]:
        """The DP dims experts spread over some DP dims are not spread over: each holds the
        same experts with other tokens (their gradients sum over them). None without EP over DP."""
        if not any(name in self.dp_dims for name in self.ep_dims):
            return []
        return [name for name in self.dp_dims if name not in self.ep_dims and self.size(name) > 1]

    def expert_replica_mesh(self, mesh: DeviceMesh) -> Optional[DeviceMesh]:
        return self._flattened(mesh, self.expert_replica_dims)

    def ep_mesh(self, mesh: DeviceMesh) -> Optional[DeviceMesh]:
        """The experts' mesh: the ep dims' ranks as one 1-D mesh, flattened in mesh order; None without EP."""
        return self._flattened(mesh, self.ep_dims_in_mesh_order)

    def stage_mesh(self, mesh: DeviceMesh) -> Optional[DeviceMesh]:
        """The ranks of one pipeline stage: every dim but pp, flattened (None without pp)."""
        return self._flattened(mesh, [name for name in self.dim_names if name != self.pp_dim]) \
            if self.pp_size > 1 else None

    def pp_mesh(self, mesh: DeviceMesh) -> Optional[DeviceMesh]:
        return mesh[self.pp_dim] if self.pp_size > 1 else None

    def tp_mesh(self, mesh: DeviceMesh) -> Optional[DeviceMesh]:
        return None if self.tp_dim is None else mesh[self.tp_dim]

    def dp_mesh(self, mesh: DeviceMesh) -> Optional[DeviceMesh]:
        """The DP ranks as one 1-D mesh (None without DP). Two dims are flattened row-major, so
        the coordinate is outer x inner: DP's replica index under any strategy.
        DeviceMesh._flatten is private in torch 2.13; torchtitan flattens its DP dims the same way."""
        return self._flattened(mesh, self.dp_dims)

    @staticmethod
    def _flattened(mesh: DeviceMesh, dims: List[str]) -> Optional[DeviceMesh]:
        if not dims:
            return None
        return mesh[dims[0]] if len(dims) == 1 else mesh[tuple(dims)]._flatten()

    def sharding_mesh(self, mesh: DeviceMesh, strategy: str) -> Optional[DeviceMesh]:
        """What fully_shard shards over: hsdp the 2-D (replicate, shard) mesh, the shard dim
        with cp flattened into it; fsdp every rank of dp_cp_mesh."""
        if strategy != "hsdp":
            return self.dp_cp_mesh(mesh)
        if self.cp_size == 1:
            return mesh[tuple(self.dp_dims)]
        self._flattened(mesh, [self.dp_dim, self.cp_dim])
        return mesh[(self.dp_replicate_dim, f"{self.dp_dim}_{self.cp_dim}")]
