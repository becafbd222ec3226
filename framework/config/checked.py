"""What a capability's checks read before launch: one object, so every capability's check has
the same signature, `check(c: Checked)`, and framework.config.validate lists them in a table
instead of calling each with its own arguments in an order that matters."""
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig, OmegaConf
from torch import nn

from framework.parallel.roles import MeshRoles


@dataclass
class Checked:
    cfg: DictConfig
    # validation's meta model as the run will hold it: built from the config, its adapters added
    # by the lifecycle's adapt (framework.models.lifecycle) as the adapters stage adds them
    model: Optional[nn.Module] = None
    out_dir: Optional[str] = None  # the job's directory, when the launcher knows it
    # and where its checkpoints go: the checkpoint the run starts from is checked too
    checkpoint_dir: Optional[str] = None
    roles: MeshRoles = field(init=False)

    def __post_init__(self) -> None:
        self.roles = MeshRoles.from_config(self.cfg)

    @property
    def plan(self) -> dict:
        return OmegaConf.to_container(self.cfg.plan, resolve=True) if self.cfg.plan else {}
