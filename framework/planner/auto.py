"""mesh=auto (framework.train): the planner's first choice for planner.world ranks (under
torchrun: for its world, planned by rank 0, whose config the other ranks take), said with the
runner-up, as the config the run launches with."""
import logging
from contextlib import contextmanager
from typing import Iterator, List, Optional

from omegaconf import DictConfig, OmegaConf

from framework.cli import compose_config
from framework.config.errors import ConfigError
from framework.dryrun import human
from framework.planner.plan import device_profile, plan

log = logging.getLogger("framework")

CHOSEN = ("mesh.shape", "mesh.dim_names")  # what the planner chooses, which mesh=auto must not be given


def choose_layout(cfg: DictConfig, overrides: List[str], world: Optional[int] = None) -> DictConfig:
    """The config of `overrides` with the planner's best layout for planner.world ranks, or for
    the `world` torchrun started (rank 0 plans; the other ranks take its config)."""
    given = [o for o in overrides if o.lstrip("+~").split("=")[0] in CHOSEN]
    if given:
        raise ConfigError("mesh", "auto", f"lets the planner choose the mesh, and {given[0]} gives one too; "
                                          f"drop one of them")
    if world is not None and cfg.planner.world not in (None, world):
        raise ConfigError("planner.world", cfg.planner.world, f"torchrun started {world} ranks; drop planner.world "
                                                              f"(mesh=auto plans for torchrun's world) or match it")
    if world is None and cfg.planner.world is None:
        raise ConfigError("planner.world", None, "mesh=auto plans for this many ranks: give planner.world=N")
    planner = OmegaConf.merge(cfg.planner, {"world": world or cfg.planner.world})
    user = [*(o for o in overrides if not o.startswith("planner.")), "mesh.auto=false"]
    with beside_running_hydra():
        result = plan(user, planner, device_profile(planner))
        chosen = compose_config([*overrides, "mesh.auto=false", *result.ranked[0][0].overrides])
    (best, predicted), *rest = result.ranked
    runner_up = f"; runner-up {' '.join(rest[0][0].overrides)} at {1000 * rest[0][1].step_s:.1f} ms" if rest else ""
    log.info("mesh=auto: %s (predicted %.1f ms per step, %s per rank; %d layouts weighed%s)",
             " ".join(best.overrides), 1000 * predicted.step_s, human(predicted.memory_bytes),
             len(result.ranked) + len(result.over) + len(result.refused), runner_up)
    return chosen


@contextmanager
def beside_running_hydra() -> Iterator[None]:
    """Compose configs (the candidates') from inside framework.train's Hydra app, which holds
    Hydra's global state: set aside, then put back as it was."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    backup, runtime = get_gh_backup(), HydraConfig.instance().cfg
    GlobalHydra.instance().clear()
    try:
        yield
    finally:
        restore_gh_from_backup(backup)
        HydraConfig.instance().cfg = runtime
