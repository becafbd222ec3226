"""What the launcher hands every rank: the resolved config (plain values, plus the job's
command-line overrides), also kept with the job as .hydra/resolved_config.yaml."""
import os

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

# What Hydra puts in a job's dir before the task runs.
HYDRA_ONLY = {".hydra", "train.log"}


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_config(cfg: DictConfig) -> dict:
    """The config the ranks run: resolved, plain values (enums as their names), plus the
    job's command-line overrides (TensorBoard's hparams show what a sweep varied) and its
    sweep and recipe (what W&B and MLflow group runs by)."""
    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    container["overrides"] = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    container["job"] = job_context()
    return container


def job_context() -> dict:
    """What the loggers name a run by (framework.training.logger): the sweep it belongs to (its
    dir's name) in a multirun, the recipe chosen."""
    if not HydraConfig.initialized():
        return {}
    hydra = HydraConfig.get()
    multirun = hydra.mode == RunMode.MULTIRUN
    return {"sweep": "/".join(os.path.normpath(hydra.sweep.dir).split(os.sep)[-2:]) if multirun else None,
            "sweep_dir": os.path.abspath(hydra.sweep.dir) if multirun else None,
            "recipe": hydra.runtime.choices.get("recipe")}


def write_resolved_config(cfg: DictConfig, out_dir: str) -> str:
    """The config every rank runs, interpolations resolved, kept with the job (.hydra/)."""
    path = os.path.join(out_dir, ".hydra", "resolved_config.yaml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    OmegaConf.save(OmegaConf.create(rank_config(cfg)), path)
    return path
