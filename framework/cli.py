"""What the commands share (verify, inspect, dryrun, export; framework.train through Hydra):
the config framework.train would run, `--help`, and one exit status with one line.

Exit 0: done (or OK); 1: a run or a verdict failed; 2: bad input (a config error, an override
Hydra cannot apply, a recipe or config file that does not exist, an unusable checkpoint),
said in one line that names the key or the path and the fix, never a traceback.
"""
import os
import sys
from typing import Callable, List

from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from framework.checkpoint.layout import CheckpointError
from framework.config.errors import ConfigError
from framework.config.schema import did_you_mean, register_schema, section_keys
from framework.launch.local import RankFailed

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def compose_config(overrides: List[str]) -> DictConfig:
    """The config framework.train would run for these overrides, for the commands that have no
    job dir."""
    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def hydra_error_line(error: Exception) -> str:
    """Hydra's and OmegaConf's multi-line composition errors as one `config error:` line."""
    if isinstance(error, MissingConfigException) and error.missing_cfg_file:
        group, _, name = error.missing_cfg_file.rpartition("/")
        options = ", ".join(error.options or [])
        return f"config error: {group}={name}: no such {group} config; the {group} configs are: {options}"
    cause = error.__cause__
    key = getattr(cause, "full_key", None)
    if isinstance(error, ConfigCompositionException) and key and "not in" in str(cause):
        section = key.rpartition(".")[0]
        known = section_keys(section)
        hint = did_you_mean(key, known) if known else f"{section} has no such key"
        return f"config error: {key}: no such key; {hint}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if cause is not None:
        lines.append(str(cause).splitlines()[0])
    return "config error: " + "; ".join(lines)


def command_status(body: Callable[[], int], failed: str, argv: List[str] = (), usage: str = "") -> int:
    """A command's exit status: `usage` for -h/--help (0); else its body's, or 2 with one
    `config error:` line, or 1 with `<failed>: <the failed rank and its error>`."""
    if usage and any(arg in ("-h", "--help") for arg in argv):
        print(usage)
        return 0
    try:
        return body()
    except (ConfigError, CheckpointError) as error:
        print(error, file=sys.stderr)
        return 2
    except (HydraException, OmegaConfBaseException) as error:
        print(hydra_error_line(error), file=sys.stderr)
        return 2
    except RankFailed as error:
        print(f"{failed}: {error}", file=sys.stderr)
        return 1
