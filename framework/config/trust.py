"""What a composed config may make Python run, checked before anything of it is instantiated.

Recipes and group files are what people share, so none of them may choose code to run:
- `_target_`s outside the `hydra` section: under `allowed_targets` (framework.config.validate);
  that list can be widened only on the command line (`allowed_targets=[...,pkg]`) or with the
  FRAMEWORK_ALLOWED_TARGETS environment variable (comma-separated packages), never by a file;
- Hydra's own section, which Hydra instantiates before the framework sees the config: callbacks,
  launcher and sweeper `_target_`s under Hydra, its plugins or the framework; the logging
  configs' handler `class`es and `()` factories under logging, Hydra or the framework, and their
  `ext://` references under sys; `hydra.job.env_set` (the ranks inherit it: LD_PRELOAD,
  PYTHONPATH) only from the command line.
"""
import os
from pathlib import Path
from typing import Any, Iterator, List, Sequence, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf

from framework.config.errors import ConfigError

ALLOWLIST_ENV = "FRAMEWORK_ALLOWED_TARGETS"
HYDRA_TARGETS = ("hydra", "hydra_plugins", "framework")
LOGGING_TARGETS = ("logging", "hydra", "framework")
EXTERNAL_REFERENCES = ("sys",)


def under(name: str, packages: Sequence[str]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def env_allowlist() -> List[str]:
    return [package for package in os.environ.get(ALLOWLIST_ENV, "").split(",") if package]


def _leaves(node: Any, path: str) -> Iterator[Tuple[str, str, Any]]:
    """(dotted key, key, value) of every leaf under `node`, unresolved."""
    if isinstance(node, DictConfig):
        for key, value in node.items_ex(resolve=False):
            child = f"{path}.{key}" if path else str(key)
            if isinstance(value, (DictConfig, ListConfig)):
                yield from _leaves(value, child)
            else:
                yield child, str(key), value
    elif isinstance(node, ListConfig):
        for i, value in enumerate(node):
            yield from _leaves(value, f"{path}[{i}]")


def check_hydra_section(hydra: DictConfig) -> None:
    """Every callable Hydra would instantiate from its own section."""
    for section in ("callbacks", "launcher", "sweeper"):
        for key, name, value in _leaves(hydra.get(section), f"hydra.{section}"):
            if name == "_target_" and not under(str(value), HYDRA_TARGETS):
                raise ConfigError(key, value, f"Hydra would instantiate it before any check; only classes under "
                                              f"{list(HYDRA_TARGETS)} may stand in hydra.{section}")
    for section in ("job_logging", "hydra_logging"):
        for key, name, value in _leaves(hydra.get(section), f"hydra.{section}"):
            if name in ("()", "class") and not under(str(value), LOGGING_TARGETS):
                raise ConfigError(key, value, f"logging would call it; only callables under {list(LOGGING_TARGETS)} "
                                              f"may configure Hydra's logging")
            if isinstance(value, str) and value.startswith("ext://") and not under(value[6:], EXTERNAL_REFERENCES):
                raise ConfigError(key, value, f"logging would import it; only {list(EXTERNAL_REFERENCES)} may be "
                                              f"referenced with ext://")


def check_env_set(hydra: DictConfig, overrides: Sequence[str]) -> None:
    """Environment variables for the job (and so the ranks) come from the command line only."""
    from_cli = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    for key, _, value in _leaves(hydra.job.get("env_set"), "hydra.job.env_set"):
        if key not in from_cli and "hydra.job.env_set" not in from_cli:
            raise ConfigError(key, value, "a config file may not set the job's environment (the ranks inherit it: "
                                          "LD_PRELOAD, PYTHONPATH would run code); give it on the command line")


def check_allowlist_files(choices: DictConfig, config_dir: str) -> None:
    """No recipe or group file widens allowed_targets: only the command line or the
    environment may."""
    for group, choice in choices.items():
        if choice is None or group.startswith("hydra/"):
            continue
        path = Path(config_dir, group, f"{choice}.yaml")
        if path.is_file() and "allowed_targets" in (OmegaConf.load(path) or {}):
            raise ConfigError("allowed_targets", OmegaConf.load(path).allowed_targets,
                              f"set in {path}: a config file may not widen what may be instantiated; give it on "
                              f"the command line (allowed_targets=[...]) or in {ALLOWLIST_ENV} if you trust it")


def check_composed(cfg: DictConfig, overrides: Sequence[str], config_dir: str) -> None:
    """The checks above on a config composed with its `hydra` section, before Hydra or the
    framework instantiates anything of it."""
    check_hydra_section(cfg.hydra)
    check_env_set(cfg.hydra, overrides)
    check_allowlist_files(cfg.hydra.runtime.choices, config_dir)
