"""What a capability's checks read before launch: one object, so every check has the same
signature, `check(c: Checked)`, and framework.validate runs them all from one table instead
of calling each with its own arguments in an order that matters."""
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError, InterpolationResolutionError
from torch import nn

from framework.config.errors import ConfigError

if TYPE_CHECKING:  # (made by framework.validate.checked_config: parallel/ is a layer above config/)
    from framework.parallel.roles import MeshRoles


@dataclass
class Checked:
    cfg: DictConfig
    roles: "MeshRoles"
    # validation's meta model as the run will hold it: built from the config, its adapters added
    # by the lifecycle's adapt (framework.models.lifecycle) as the adapters stage adds them
    model: Optional[nn.Module] = None
    out_dir: Optional[str] = None  # the job's directory, when the launcher knows it
    # and where its checkpoints go: the checkpoint the run starts from is checked too
    checkpoint_dir: Optional[str] = None
    world_size: Optional[int] = None  # the world a launcher joined (torchrun), else None
    ranks_per_host: Optional[int] = None  # how many of the ranks share this host
    devices_here: bool = True  # this host's GPUs are the run's (not the dry run's simulated ranks)

    @property
    def plan(self) -> dict:
        return OmegaConf.to_container(self.cfg.plan, resolve=True) if self.cfg.plan else {}


def reads_config(check: Callable[[DictConfig], None]) -> Callable[[Checked], None]:
    """A check of the config alone (called elsewhere with the config too) as a table entry."""
    def entry(c: Checked) -> None:
        check(c.cfg)
    entry.__name__ = entry.__qualname__ = check.__name__
    return entry


def instantiate_checked(node: Any, **kwargs: Any) -> Any:
    """instantiate, letting a ConfigError raised by the target or by a resolver (a bad data path,
    say) through unwrapped, so it prints as the one-line config error it is; an interpolation of
    a key the config lacks (data=random_tokens' ${model.vocab_size} under a model without one)
    as one too, naming the key that holds it."""
    try:
        return instantiate(node, **kwargs)
    except (InstantiationException, InterpolationResolutionError) as error:
        cause = error.__cause__ or error.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        if isinstance(error, InterpolationKeyError) and isinstance(node, DictConfig):
            _refuse_unresolvable(node)
        raise


def _refuse_unresolvable(node: DictConfig) -> None:
    for key in node.keys():
        try:
            value = node[key]
        except InterpolationKeyError as error:
            raw = OmegaConf.to_container(node)[key]
            raise ConfigError(node._get_full_key(key), raw, f"{str(error).splitlines()[0]}: set the key itself, "
                                                            f"or use a config that has what it names") from None
        if isinstance(value, DictConfig):
            _refuse_unresolvable(value)
