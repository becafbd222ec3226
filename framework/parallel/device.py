"""Where a run computes: mesh.device_type resolved once, into a frozen Device (type, backend,
why) that the ranks and the commands read.

`auto` (the default) is cuda with nccl when this host's GPUs give each of its ranks one, else
cpu with gloo, so `make train` and every recipe use the GPUs where there are enough. The
process that validates a run settles it (settle_device) and the config it hands the ranks
carries the Device (its `device` entry, beside mesh.device_type made concrete); a config no
launcher settled (a test's, a command's) is settled where it is first built, by the same rule.
"""
import os
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
from omegaconf import open_dict

from framework.config.checked import Checked
from framework.config.errors import ConfigError


@dataclass(frozen=True)
class Device:
    type: str      # cpu | cuda
    backend: str   # the collectives' default: gloo | nccl
    why: str       # what chose it, for the rank-layout header

    def line(self) -> str:
        """The rank-layout header's device: 'device: cuda (auto: 8 GPUs for 8 local ranks)'."""
        return f"device: {self.type} ({self.why})"


def resolve_device(requested: str, local_ranks: int, gpu_count: Optional[int] = None) -> Device:
    """mesh.device_type's Device for a host of `local_ranks` ranks seeing `gpu_count` GPUs
    (torch's, by default): cpu or cuda taken as named (a cuda without enough GPUs is refused by
    validation); auto cuda only where every local rank gets a GPU."""
    if requested != "auto":
        return Device(requested, "nccl" if requested == "cuda" else "gloo", f"mesh.device_type={requested}")
    gpu_count = torch.cuda.device_count() if gpu_count is None else gpu_count
    if gpu_count == 0:
        return Device("cpu", "gloo", "auto: no GPU")
    why = f"auto: {gpu_count} GPU{'s' * (gpu_count > 1)} for {local_ranks} local rank{'s' * (local_ranks > 1)}"
    return Device("cuda", "nccl", why) if gpu_count >= local_ranks else Device("cpu", "gloo", why)


def local_ranks_here() -> int:
    """This host's ranks as torchrun's agent says (LOCAL_WORLD_SIZE, else WORLD_SIZE), else 1."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def settle_device(cfg: Any, local_ranks: Optional[int] = None) -> Device:
    """The config's Device: the one it carries when already settled, else resolved for a host of
    `local_ranks` ranks (default: local_ranks_here) and recorded in it, once: mesh.device_type
    made concrete for every reader after, and the `device` entry the ranks read."""
    settled = cfg.get("device")
    if settled:
        return Device(**settled)
    requested = getattr(cfg.mesh.device_type, "value", cfg.mesh.device_type)
    device = resolve_device(str(requested), local_ranks or local_ranks_here())
    with open_dict(cfg):
        cfg.mesh.device_type = device.type
        cfg.device = asdict(device)
    return device


def check_devices(c: Checked) -> None:
    """One device per rank on each host, before any rank starts (NCCL would fail in every rank);
    not for the dry run's simulated ranks (c.devices_here false)."""
    cfg, ranks_per_host = c.cfg, c.ranks_per_host
    if cfg.mesh.device_type != "cuda" or not c.devices_here:
        return
    if not torch.cuda.is_available():
        raise ConfigError("mesh.device_type", "cuda", "torch sees no CUDA device here (a CPU-only build, no GPU "
                                                      "or no driver); use mesh.device_type=cpu")
    if torch.cuda.device_count() < ranks_per_host:
        raise ConfigError("mesh.shape", list(cfg.mesh.shape),
                          f"{ranks_per_host} ranks per host need as many GPUs and this host has "
                          f"{torch.cuda.device_count()}; pick a smaller mesh or set mesh.ranks_per_host")
