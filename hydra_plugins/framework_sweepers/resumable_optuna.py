"""`-m hydra/sweeper=optuna`: the Optuna plugin's sweeper (the hpo extra), whose study resumes.

The plugin runs n_trials more trials on every run and numbers its jobs from 0, so the same command
run again into the same sweep dir would run n_trials again and write over the first run's job
dirs. Here n_trials counts the study's trials: a study in storage that already holds some runs
only those still missing, and its jobs are numbered after the study's trials (job N is trial N, so
the sweep report puts each trial beside its job dir). A seeded sampler is seeded again with its
seed + the trials the study holds (seeded as before, it would draw the first run's points again);
a trial that an interrupted sweep left RUNNING is marked failed first: one sweep drives a study
at a time. A sweep in which no trial completed ends with its report (the plugin would raise).
Everything else is the plugin's: hydra.sweeper.params, sampler, direction, n_jobs, max_failure_rate.

Its config replaces the plugin's own as hydra/sweeper/optuna, so `hydra/sweeper=optuna` picks it:
a YAML file of that name cannot extend the plugin's (Hydra refuses a same-name file when the
schema has a defaults list, as the plugin's has: its sampler), and a store when this module is
imported can be undone, since Hydra's plugin scan runs every hydra_plugins module again (the
plugin's config among them) in an order that depends on how each was installed. Hydra asks its
search path plugins for their paths after the scan and before it composes anything: StoreConfig
adds no path and stores the config then. Without the plugin the name still composes, and the
sweeper says which pip command installs it.
"""
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.config_store import ConfigStore
from hydra.plugins.search_path_plugin import SearchPathPlugin
from hydra.plugins.sweeper import Sweeper
from hydra.utils import instantiate

from framework.config.errors import ConfigError
from framework.hpo import INSTALL, completed_trials, resume_study

log = logging.getLogger(__name__)

try:
    from hydra_plugins.hydra_optuna_sweeper.config import OptunaSweeperConf
    from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
except ImportError:
    class ResumableOptunaSweeper(Sweeper):
        def __init__(self, **_: Any) -> None:
            raise ConfigError("hydra/sweeper", "optuna", f"the Optuna sweeper needs the hpo extra: {INSTALL}")

        def setup(self, **_: Any) -> None: ...

        def sweep(self, arguments: List[str]) -> Any: ...

    CONFIG: Any = {"_target_": f"{__name__}.ResumableOptunaSweeper"}
else:
    # alembic, which optuna imports with its RDB storage when Hydra builds the sampler, logs a line
    # per plugin of its own at INFO, and Hydra prints INFO
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)

    class ResumableOptunaSweeper(OptunaSweeper):
        def sweep(self, arguments: List[str]) -> None:
            impl = self.sweeper
            stored = impl.storage is not None and impl.study_name is not None
            if stored:
                self._resume()
            try:
                super().sweep(arguments)
            except ValueError:
                # The plugin ends by asking the study for its best trial, which raises when none completed
                # (every trial failed): the sweep report lists them and the command exits 1 (framework/report.py).
                if not stored or completed_trials(str(impl.storage), impl.study_name):
                    raise
                log.error(f"Study {impl.study_name}: no trial completed")

        def _resume(self) -> None:
            """n_trials less the study's trials, jobs numbered after them, a seeded sampler seeded
            again (seeded as before, it would draw the first run's points again)."""
            impl = self.sweeper
            Path(impl.sweep_dir).mkdir(parents=True, exist_ok=True)  # sqlite's file may go in it, before any job
            trials = resume_study(str(impl.storage), impl.study_name)
            if not trials:
                return
            log.info(f"Study {impl.study_name} holds {trials} trial(s) of n_trials={impl.n_trials}: "
                     f"running {max(0, impl.n_trials - trials)} more, from job {trials}")
            impl.job_idx, impl.n_trials = trials, max(0, impl.n_trials - trials)
            seed = impl.config.hydra.sweeper.sampler.get("seed")
            if seed is not None:
                impl.sampler = instantiate(impl.config.hydra.sweeper.sampler, seed=seed + trials)

    @dataclass
    class ResumableOptunaSweeperConf(OptunaSweeperConf):
        _target_: str = f"{__name__}.ResumableOptunaSweeper"
        # The study beside its jobs. The default sweep dir is new on every run (multirun/<date>/<time>):
        # to resume, give the same hydra.sweep.dir (recipes/hpo_lm.yaml sets one). null: in memory.
        storage: Optional[Any] = "sqlite:///${hydra.sweep.dir}/optuna.db"
        study_name: Optional[str] = "${hydra.job.name}"
        # Trials asked for at once. Hydra's basic launcher runs jobs one after another, so 1 lets each
        # trial learn from every one before it; a submitit launcher runs a batch's jobs side by side.
        n_jobs: int = 1

    CONFIG = ResumableOptunaSweeperConf


class StoreConfig(SearchPathPlugin):
    """Stores this sweeper's config as hydra/sweeper/optuna once the plugin scan is over (above)."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=CONFIG, provider="framework")
