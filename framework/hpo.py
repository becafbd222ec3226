"""Hyperparameter search: `-m hydra/sweeper=optuna` (the hpo extra; docs/scaling-out.md).

A sweeper that optimizes (Optuna's; any but Hydra's basic one) takes each job's return value as
the objective: here the job's trainer.sweep_metric, read from its summary.json (the last
validation loss unless set). A job that fails returns None, which the Optuna plugin records as a
failed trial before the sweep goes on; so does a diverged run's NaN (optuna 2.10 refuses a NaN
value twice, and the second refusal would end the sweep). Before Hydra starts, the search space is
composed and checked as framework.cli checks a basic sweep's points, and the study's trials are
read back for the sweep report (framework/report.py). Optuna is imported only where a study is read.
"""
import json
import math
import warnings
import os
from enum import Enum
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig

from framework.cli import check_before_hydra, compose_checked
from framework.config.errors import ConfigError

INSTALL = "pip install -e '.[hpo]' && pip install --no-deps hydra-optuna-sweeper"
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
# trainer.sweep_metric: what a job returns to the sweeper, from its summary.json
METRICS = {"val_loss": "the last validation loss", "best_val_loss": "the lowest validation loss",
           "final_loss": "the last step's training loss", "samples_per_s": "samples/s", "tokens_per_s": "tokens/s"}
VALIDATION_METRICS = ("val_loss", "best_val_loss")
DIRECTIONS = ("minimize", "maximize")


def optimizes(hydra_cfg: DictConfig) -> bool:
    """Whether the sweeper takes the jobs' return values as its objective."""
    return hydra_cfg.sweeper.get("_target_", BASIC_SWEEPER) != BASIC_SWEEPER


def sweep_metric(cfg: DictConfig) -> str:
    return cfg.trainer.get("sweep_metric") or "val_loss"


def check_objective(cfg: DictConfig) -> None:
    """The run has the number the sweeper optimizes: a known metric, and a validation loss when
    the metric is one."""
    metric = sweep_metric(cfg)
    if metric not in METRICS:
        raise ConfigError("trainer.sweep_metric", metric, f"pick one of {list(METRICS)}")
    if metric in VALIDATION_METRICS and not cfg.trainer.eval_every:
        raise ConfigError("trainer.eval_every", cfg.trainer.eval_every,
                          f"the sweeper optimizes {METRICS[metric]} (trainer.sweep_metric={metric}) and this run "
                          f"never validates; set trainer.eval_every (a divisor of trainer.max_steps), or "
                          f"trainer.sweep_metric=final_loss")


def objective(cfg: DictConfig, out_dir: str) -> Optional[float]:
    """The job's trainer.sweep_metric from its summary.json; None where it has none (the run
    stopped before training) or the value is not finite (a diverged run)."""
    path = Path(out_dir, "summary.json")
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    validated = [loss for _, loss in summary.get("val_losses") or []]
    metric = sweep_metric(cfg)
    value = {"val_loss": validated[-1] if validated else None,
             "best_val_loss": min(validated, default=None)}.get(metric, summary.get(metric))
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _bounds(override: Override) -> Iterator[str]:
    """The values of a search dimension the config must take: each choice, a range's first and
    last, an interval's two ends."""
    if override.is_interval_sweep():
        yield from (str(override.value().start), str(override.value().end))
    else:
        values = list(override.sweep_string_iterator())
        yield from (values if override.is_choice_sweep() else values[:1] + values[-1:])


def check_before_sweep(argv: Sequence[str]) -> None:
    """framework.cli.check_before_hydra for every sweeper. An optimizing sweeper's points are
    known only as it runs, so each value its search space can take at its ends is composed and
    checked, one dimension at a time with the others as configured (a mistyped key or a value of
    the wrong type is refused before the first trial), and the objective is checked once."""
    args = get_args_parser().parse_args(argv)
    if not args.multirun or args.help or args.hydra_help or args.info or args.shell_completion:
        check_before_hydra(argv)
        return
    overrides = list(args.overrides)
    if args.config_dir:  # as check_before_hydra adds them
        overrides.append(f"hydra.searchpath=[file://{os.path.abspath(args.config_dir)}]")
    name = args.config_name or "config"
    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    base = compose_checked([o.input_line for o in parsed if not o.is_sweep_override()], name)
    if not optimizes(base.hydra):
        check_before_hydra(argv)
        return
    if "optuna" in base.hydra.sweeper._target_:
        try:
            import hydra_plugins.hydra_optuna_sweeper  # noqa: F401 (only whether it is installed)
        except ImportError:
            raise ConfigError("hydra/sweeper", "optuna", f"the Optuna sweeper needs the hpo extra: {INSTALL}") from None
        # the plugin builds its search space with optuna 2's distributions, deprecated in optuna 3: a line each, per trial
        warnings.filterwarnings("ignore", message=r".*Distribution has been deprecated in v3\.0\.0", category=FutureWarning)
        # and its TPESampler config hands optuna 4's TPE the options optuna 4.3 / 4.9 deprecated
        # (consider_prior, prior_weight, ...): a line each, per sweep, none of them the user's
        warnings.filterwarnings("ignore", message=r"`\w+` has been deprecated in v4\.\d+\.0", category=FutureWarning)
    check_objective(base)
    params = base.hydra.sweeper.get("params") or {}
    dims = parser.parse_overrides([f"{key}={value}" for key, value in params.items()]) + parsed
    fixed = [o.input_line for o in dims if not o.is_sweep_override()]
    if "optuna" in base.hydra.sweeper._target_:
        check_study(base.hydra.sweeper)
    for dim in (o for o in dims if o.is_sweep_override()):
        check_dimension(dim)
        for value in _bounds(dim):
            compose_checked([*fixed, f"{dim.get_key_element()}={value}"], name)


def check_study(sweeper: DictConfig) -> None:
    """The Optuna study's settings, which the plugin takes as given: n_trials=0 ran nothing and
    ended with an empty report and exit 1, an unknown direction in a traceback from the study."""
    for key, what in (("n_trials", "the study's trials, counting those of earlier runs"),
                      ("n_jobs", "trials asked for at once")):
        value = sweeper.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"hydra.sweeper.{key}", value, f"must be an integer >= 1 ({what})")
    direction = sweeper.get("direction")
    named = [d.name if isinstance(d, Enum) else d for d in (direction if isinstance(direction, Sequence) and
                                                              not isinstance(direction, str) else [direction])]
    if len(named) != 1 or named[0] not in DIRECTIONS:
        raise ConfigError("hydra.sweeper.direction", named if len(named) != 1 else named[0],
                          f"use {' or '.join(DIRECTIONS)}: each job returns one number (trainer.sweep_metric)")
    rate = sweeper.get("max_failure_rate")
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 <= rate <= 1:
        raise ConfigError("hydra.sweeper.max_failure_rate", rate, "must be in [0, 1]: the share of failed trials "
                                                                  "the sweep goes on after")
    seed = (sweeper.get("sampler") or {}).get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise ConfigError("hydra.sweeper.sampler.seed", seed, "must be an integer >= 0, or null for an unseeded "
                                                              "sampler")


def check_dimension(dim: Override) -> None:
    """A search dimension Optuna can draw from: an interval low < high (reversed, the study failed
    in two tracebacks), finite, above 0 on a log scale; a range that holds a value; no choice twice."""
    key, value = dim.get_key_element(), dim.value()
    given = dim.input_line.partition("=")[2]
    if dim.is_interval_sweep():
        start, end = value.start, value.end
        if not (math.isfinite(start) and math.isfinite(end)) or start >= end:
            raise ConfigError(key, given, "give an interval(low, high) of finite numbers with low < high")
        if "log" in value.tags and start <= 0:
            raise ConfigError(key, given, "a log-scale interval needs low > 0; give e.g. interval(1e-5, ...)")
    elif dim.is_range_sweep():
        if value.step is None or value.step <= 0 or value.start >= value.stop:
            raise ConfigError(key, given, "give a range(start, stop, step) with start < stop and step > 0")
    elif dim.is_choice_sweep():
        choices = [str(choice) for choice in dim.sweep_string_iterator()]
        repeated = next((choice for choice in choices if choices.count(choice) > 1), None)
        if repeated is not None:
            raise ConfigError(key, given, f"names {repeated} twice: a repeated choice is drawn twice as often; "
                                          f"name each once")


def resume_study(storage: str, study_name: str) -> int:
    """How many trials the study holds (0 when there is none yet); each one an interrupted sweep
    left RUNNING is marked failed."""
    import optuna

    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:  # optuna 2.10's word for a study that does not exist
        return 0
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
    return len(study.trials)


def completed_trials(storage: str, study_name: str) -> int:
    """How many of the study's trials completed."""
    import optuna

    study = optuna.load_study(study_name=study_name, storage=storage)
    return len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))


def study_trials(storage: str, study_name: str) -> Tuple[str, List[dict]]:
    """The study's direction(s) and every trial, best first: completed ones by value in the
    study's direction, then the others by number (a multi-objective study: all by number). Each
    trial: rank (None unless complete and single-objective), trial, state, value(s), params."""
    import optuna

    study = optuna.load_study(study_name=study_name, storage=storage)
    directions = [d.name.lower() for d in study.directions]
    trials = study.get_trials(deepcopy=False)
    sign = -1 if directions == ["maximize"] else 1
    ranked = sorted((t for t in trials if t.state == optuna.trial.TrialState.COMPLETE),
                    key=lambda t: (sign * t.value, t.number)) if len(directions) == 1 else []
    numbers = {t.number for t in ranked}
    rest = sorted((t for t in trials if t.number not in numbers), key=lambda t: t.number)
    return "/".join(directions), [
        {"rank": rank if rank <= len(ranked) else None, "trial": t.number, "state": t.state.name,
         "value": t.value if len(directions) == 1 else t.values, "params": dict(t.params)}
        for rank, t in enumerate(ranked + rest, start=1)]
