"""launcher.fault_tolerance's side the launcher reads (framework.parallel.fault_tolerance is the
ranks'): which mesh dim becomes replica groups, which group a process is in, and the checks."""
import os
import socket
from typing import Dict, Optional, Tuple
from urllib.parse import urlparse

from omegaconf import DictConfig

from framework.config.errors import ConfigError
from framework.parallel.roles import MeshRoles


GROUP_ENV = "FRAMEWORK_REPLICA_GROUP"  # "g/G": this process is in replica group g of G (set by the launcher)


def replica_dim(cfg: DictConfig) -> str:
    """The mesh dim whose positions become replica groups: dp_replicate when the mesh has one, else dp."""
    p = cfg.parallel
    return p.dp_replicate_dim if p.dp_replicate_dim in cfg.mesh.dim_names else p.dp_dim


def replica_group() -> Optional[Tuple[int, int]]:
    """(g, G) in a rank of a replica group, else None."""
    value = os.environ.get(GROUP_ENV)
    if not value:
        return None
    group, groups = value.split("/")
    return int(group), int(groups)


def spread_over_groups(samples: Dict[str, int]) -> Dict[str, int]:
    """The sampler's replicas and this rank's among them, over every group's DP replicas."""
    position = replica_group()
    if position is None:
        return samples
    group, groups = position
    return {"size": samples["size"] * groups, "rank": group * samples["size"] + samples["rank"]}


def check_fault_tolerance(cfg: DictConfig) -> None:
    """launcher.fault_tolerance's refusals, in the launcher (the ranks of a group see its own mesh)."""
    kind = cfg.launcher.get("fault_tolerance")
    if kind is None or replica_group() is not None:
        return
    if kind != "torchft":
        raise ConfigError("launcher.fault_tolerance", kind, "null (one world) or torchft (per-step fault tolerance)")
    if "RANK" in os.environ:
        raise ConfigError("launcher.fault_tolerance", kind, "each replica group needs an elastic agent of its own: "
                          "launch with python -m framework.train, not under torchrun")
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ConfigError("launcher.fault_tolerance", kind, "torchft is not installed: pip install 'framework[ft]'") \
            from None
    roles, dim = MeshRoles.from_config(cfg), replica_dim(cfg)
    sizes = dict(zip(roles.dim_names, roles.shape))
    if sizes.get(dim, 1) < 2:
        raise ConfigError("mesh.shape", list(cfg.mesh.shape), f"fault_tolerance=torchft needs at least 2 DP "
                          f"replicas to make replica groups of (dim {dim!r} has {sizes.get(dim, 1)})")
    if cfg.launcher.lighthouse:
        check_lighthouse(cfg.launcher.lighthouse)


def check_lighthouse(address: str, timeout_s: float = 5.0) -> None:
    """A lighthouse address must answer (a TCP connection within timeout_s)."""
    parsed = urlparse(address if "://" in address else f"http://{address}")
    try:
        with socket.create_connection((parsed.hostname, parsed.port or 80), timeout=timeout_s):
            return
    except (OSError, ValueError) as error:
        raise ConfigError("launcher.lighthouse", address, f"no lighthouse answers there within {timeout_s:g} s "
                          f"({error}); start one (torchft_lighthouse --min_replicas 1) or use null to have "
                          f"the launcher start one") from None
