"""What the commands share (verify, inspect, dryrun, export; framework.train through Hydra):
the config framework.train would run, `--help`, and one exit status with one line.

Exit 0: done (or OK); 1: a run or a verdict failed; 2: bad input (a config error, an override
Hydra cannot apply, a recipe or config file that does not exist, an unusable checkpoint),
said in one line that names the key or the path and the fix, never a traceback.
"""
import argparse
import os
import signal
import sys
from typing import Callable, List, Optional, Sequence, Tuple

import yaml

from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from framework import imports_done
from framework.checkpoint.layout import CheckpointError, resolve
from framework.config.errors import ConfigError
from framework.config.overrides import check_overrides
from framework.config.schema import did_you_mean, register_schema, section_keys
from framework.data.dataset_config import tokens_vocab
from framework.config.trust import check_composed
from framework.launch.local import Interrupted, RankFailed
from framework.training.logger import check_logger_overrides

# The configs inside the package (framework/conf links to conf/ in the source tree; a wheel holds a copy).
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")


def register_config() -> None:
    """The schema and every resolver a config may use, data's `${tokens_vocab:${data.path},${data.tokenizer}}`
    (the vocabulary of prepared tokens) among them."""
    register_schema()
    if not OmegaConf.has_resolver("tokens_vocab"):
        OmegaConf.register_new_resolver("tokens_vocab", tokens_vocab)


def compose_checked(overrides: Sequence[str], config_name: str = "config") -> DictConfig:
    """The config for these overrides with its `hydra` section, refused (ConfigError) where a
    file would make anything run (framework.config.trust); nothing of it instantiated."""
    register_config()
    check_logger_overrides(overrides)
    check_overrides(overrides)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
    check_composed(cfg, overrides)
    return cfg


def compose_config(overrides: Sequence[str]) -> DictConfig:
    """The config framework.train would run for these overrides, for the commands that have no
    job dir."""
    cfg = compose_checked(overrides)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def check_before_hydra(argv: Sequence[str]) -> None:
    """framework.train's command line, composed and checked as Hydra would compose it (every job
    of a sweep), before Hydra instantiates its callbacks, launcher, sweeper and logging."""
    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion:
        return
    overrides = list(args.overrides)
    if args.config_dir:  # someone else's configs (recipes) beside ours, as Hydra adds them
        overrides.append(f"hydra.searchpath=[file://{os.path.abspath(args.config_dir)}]")
    name = args.config_name or "config"
    if not args.multirun:
        compose_checked(overrides, name)
        return
    parsed = OverridesParser.create().parse_overrides(overrides)
    base = compose_checked([o.input_line for o in parsed if not o.is_sweep_override()], name)
    params = base.hydra.sweeper.get("params") or {}
    swept = OverridesParser.create().parse_overrides([f"{key}={value}" for key, value in params.items()]) + parsed
    for batch in BasicSweeper.split_arguments(swept, None):
        for job in batch:
            compose_checked(job, name)


def hydra_error_line(error: Exception) -> str:
    """Hydra's and OmegaConf's multi-line composition errors as one `config error:` line."""
    if isinstance(error, MissingConfigException) and error.missing_cfg_file:
        group, _, name = error.missing_cfg_file.rpartition("/")
        options = ", ".join(error.options or [])
        return f"config error: {group}={name}: no such {group} config; the {group} configs are: {options}"
    cause = error.__cause__ or error.__context__  # (a key a recipe or group file sets: raised while handling)
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


def parsed(parser: argparse.ArgumentParser, argv: Sequence[str]) -> Tuple[Optional[argparse.Namespace], int]:
    """argparse's result, or None and the status it would exit with (--help 0, a usage error 2),
    so a command's main returns a status instead of raising SystemExit."""
    try:
        return parser.parse_args(argv), 0
    except SystemExit as exit_:
        return None, int(exit_.code or 0)


def parsed_status(parser: argparse.ArgumentParser, argv: Sequence[str], body: Callable[[argparse.Namespace], int],
                  failed: str) -> int:
    """An argparse command's status (export, generate): argparse's (--help 0, a usage error 2),
    else its body's, or 2 with one line for bad input: a ConfigError's own `config error: ...`
    (as train says it), an unusable checkpoint's `<failed>: <error>`."""
    args, status = parsed(parser, argv)
    if args is None:
        return status
    try:
        return body(args)
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    except CheckpointError as error:
        print(f"{failed}: {error}", file=sys.stderr)
        return 2


def command_status(body: Callable[[], int], failed: str, argv: List[str] = (), usage: str = "") -> int:
    """A command's exit status: `usage` for -h/--help (0); else its body's, or 2 with one
    `config error:` line, or 1 with `<failed>: <the failed rank and its error>`, or 128 + a signal's
    number (Ctrl-C, SIGTERM) with one line."""
    imports_done()
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
    except yaml.YAMLError as error:  # a config file that is not YAML
        print(f"config error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    except RankFailed as error:
        print(f"{failed}: {error}", file=sys.stderr)
        return 1
    except Interrupted as stop:  # Ctrl-C or SIGTERM while ranks ran: they have stopped
        print(stop, file=sys.stderr)
        return 128 + stop.number
    except KeyboardInterrupt:
        print("interrupted by SIGINT", file=sys.stderr)
        return 128 + signal.SIGINT


def checkpoint_source(source: str, sources: str) -> Optional[str]:
    """A command's SOURCE (generate, evaluate): None for a Hugging Face directory (it has a
    config.json), else the step_N checkpoint it names (a checkpoints dir: its newest); refused in
    one line naming SOURCE, `sources` saying what it may be."""
    if os.path.isfile(os.path.join(source, "config.json")):
        return None
    if not os.path.isdir(source):
        raise ConfigError("SOURCE", source, f"no such directory; give {sources}")
    try:
        return resolve(source, directory="")
    except CheckpointError as error:  # its message names only checkpoints
        raise ConfigError("SOURCE", source, f"no config.json there (a Hugging Face model directory has one), and "
                                            f"{error}") from None
