"""What a composed config may make Python run, checked before anything of it is instantiated.

Recipes and group files are what people share, so none of them may choose code to run:
- `_target_`s outside the `hydra` section: under `allowed_targets` (framework.validate);
  that list can be widened only on the command line (`allowed_targets=[...,pkg]`) or with the
  FRAMEWORK_ALLOWED_TARGETS environment variable (comma-separated packages), never by a file;
- Hydra's own section, which Hydra instantiates before the framework sees the config: callbacks,
  launcher and sweeper `_target_`s under Hydra, its plugins or the framework (the Optuna sweeper's
  sampler under optuna.samplers too); the logging configs' handler `class`es and `()` factories
  under logging, Hydra or the framework, and their `ext://` references under sys; the job's
  environment, the SLURM launcher's shell lines and the Optuna sweeper's custom_search_space
  function (COMMAND_LINE_ONLY) only from the command line;
- a Python file whose function scores GRPO's completions (reward.file), or whose class answers
  them between turns (environment.file): only from the command line.
"""
import functools
import os
from pathlib import Path
from typing import Any, Iterator, List, Sequence, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.config.errors import ConfigError

ALLOWLIST_ENV = "FRAMEWORK_ALLOWED_TARGETS"
HYDRA_TARGETS = ("hydra", "hydra_plugins", "framework")
# hydra/sweeper=optuna builds its sampler (TPESampler, RandomSampler, ...) from hydra.sweeper.sampler._target_
SECTION_TARGETS = {"callbacks": HYDRA_TARGETS, "launcher": HYDRA_TARGETS,
                   "sweeper": HYDRA_TARGETS + ("optuna.samplers",)}
LOGGING_TARGETS = ("logging", "hydra", "framework")
EXTERNAL_REFERENCES = ("sys",)


def under(name: str, packages: Sequence[str]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def env_allowlist() -> List[str]:
    return [package for package in os.environ.get(ALLOWLIST_ENV, "").split(",") if package]


def _resolved(node: Any, key: Any) -> Any:
    """node[key] as instantiate will see it: interpolations resolved (`${oc.create:{...}}` and
    `${oc.decode:...}` make whole configs out of strings); one that cannot be resolved yet (a
    value Hydra fills in at run time) as written."""
    try:
        return node[key]
    except OmegaConfBaseException:
        return node._get_node(key)._value()


def _leaves(node: Any, path: str) -> Iterator[Tuple[str, str, Any]]:
    """(dotted key, key, value) of every leaf under `node`, resolved."""
    if not isinstance(node, (DictConfig, ListConfig)) or node._is_none():  # absent, or a typed node set to null
        return
    for key in node.keys() if isinstance(node, DictConfig) else range(len(node)):
        child = (f"{path}.{key}" if path else str(key)) if isinstance(node, DictConfig) else f"{path}[{key}]"
        value = _resolved(node, key)
        if isinstance(value, (DictConfig, ListConfig)):
            yield from _leaves(value, child)
        else:
            yield child, str(key), value


def targets(node: Any, path: str = "") -> Iterator[Tuple[str, str]]:
    """Every `_target_` under `node`, with its dotted key."""
    return ((key, str(value)) for key, name, value in _leaves(node, path) if name == "_target_")


# Modules that moved when framework/ was grouped by concern: old `_target_` prefix -> new one.
MOVED_TARGETS = {"framework.transformer.": "framework.models.", "framework.corpus.": "framework.data."}


def check_targets(cfg: DictConfig) -> None:
    """A config must not run arbitrary code: every `_target_` outside the hydra section, its
    interpolations resolved, lies under an allowed package (allowed_targets, which only the
    command line widens, and FRAMEWORK_ALLOWED_TARGETS). A target under a module that moved is
    named with its new path."""
    allowed = list(cfg.allowed_targets) + env_allowlist()
    for key, target in (found for section in cfg if section != "hydra" for found in targets(cfg[section], section)):
        for old, new in MOVED_TARGETS.items():
            if target.startswith(old):
                raise ConfigError(key, target, f"this module moved; use {new}{target[len(old):]}")
        if not under(target, allowed):
            raise ConfigError(key, target,
                              f"only targets under {allowed} may be instantiated; if you trust the package, add it "
                              f"on the command line (allowed_targets=[...]) or in {ALLOWLIST_ENV}")


def check_hydra_section(hydra: DictConfig) -> None:
    """Every callable Hydra would instantiate from its own section."""
    for section, allowed in SECTION_TARGETS.items():
        for key, target in targets(hydra.get(section), f"hydra.{section}"):
            if not under(target, allowed):
                raise ConfigError(key, target, f"Hydra would instantiate it before any check; only classes under "
                                               f"{list(allowed)} may stand in hydra.{section}")
    for section in ("job_logging", "hydra_logging"):
        for key, name, value in _leaves(hydra.get(section), f"hydra.{section}"):
            if name in ("()", "class") and not under(str(value), LOGGING_TARGETS):
                raise ConfigError(key, value, f"logging would call it; only callables under {list(LOGGING_TARGETS)} "
                                              f"may configure Hydra's logging")
            if isinstance(value, str) and value.startswith("ext://") and not under(value[6:], EXTERNAL_REFERENCES):
                raise ConfigError(key, value, f"logging would import it; only {list(EXTERNAL_REFERENCES)} may be "
                                              f"referenced with ext://")


# What reaches a shell or the ranks' environment, or names code to import: given on the command line only.
COMMAND_LINE_ONLY = {
    "hydra.job.env_set": "the job's environment (the ranks inherit it: LD_PRELOAD, PYTHONPATH would run code)",
    "hydra.launcher.setup": "shell lines of the SLURM job script",
    "hydra.launcher.srun_args": "srun's arguments",
    "hydra.launcher.additional_parameters": "sbatch options",
    "hydra.sweeper.custom_search_space": "a function the Optuna sweeper imports and calls on every trial",
    "reward.file": "a Python file whose function scores completions (it runs as code)",
    "environment.file": "a Python file whose class answers completions between turns (it runs as code)",
}


def _set_under(cfg: DictConfig, section: str) -> Iterator[Tuple[str, Any]]:
    """(dotted key, value) of each leaf of `section` (itself when it is one), resolved."""
    parent, _, name = section.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig) or node._is_none() or name not in node:
        return
    value = _resolved(node, name)
    if isinstance(value, (DictConfig, ListConfig)):
        yield from ((key, leaf) for key, _, leaf in _leaves(value, section))
    else:
        yield section, value


def check_command_line_only(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Each COMMAND_LINE_ONLY value that is set comes from an override of its section or of a key
    under it (`hydra.job.env_set={A: 1}` sets hydra.job.env_set.A); an override above the section,
    such as the group choice `reward=file`, does not count: the file it picks may not set it."""
    from_cli = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    for section, what in COMMAND_LINE_ONLY.items():
        given = [k for k in from_cli if k == section or k.startswith((section + ".", section + "["))]
        for key, value in _set_under(cfg, section):
            if value not in (None, "") and not any(key == k or key.startswith((k + ".", k + "[")) for k in given):
                raise ConfigError(key, value, f"a config file may not set {what}; give it on the command line")


def check_allowlist_files(runtime: DictConfig) -> None:
    """No recipe or group file sets allowed_targets: only the command line or the environment
    may widen it."""
    dirs = [source.path for source in runtime.config_sources if source.schema == "file"]
    for group, choice in runtime.choices.items():
        if choice is None or group.startswith("hydra/"):
            continue
        for path in (Path(d, group, f"{choice}.yaml") for d in dirs):
            sets, value = _allowed_targets_in(str(path), path.stat().st_mtime_ns) if path.is_file() else (False, None)
            if sets:
                raise ConfigError("allowed_targets", value,
                                  f"set in {path}: a config file may not widen what may be instantiated; give it "
                                  f"on the command line (allowed_targets=[...]) or in {ALLOWLIST_ENV} if you trust it")


@functools.lru_cache(maxsize=None)
def _allowed_targets_in(path: str, mtime_ns: int) -> Tuple[bool, Any]:
    """Whether the file sets allowed_targets, and to what: read once per version of the file (a
    process composes many configs of the same files)."""
    loaded = OmegaConf.load(path)
    if isinstance(loaded, DictConfig) and "allowed_targets" in loaded:
        return True, OmegaConf.to_container(loaded, resolve=False)["allowed_targets"]
    return False, None


def check_composed(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """The checks above on a config composed with its `hydra` section, before Hydra or the
    framework instantiates anything of it."""
    check_hydra_section(cfg.hydra)
    check_command_line_only(cfg, overrides)
    check_allowlist_files(cfg.hydra.runtime)
    check_targets(cfg)
