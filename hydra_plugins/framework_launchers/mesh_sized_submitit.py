"""The submitit plugin's launchers, except that each job of a sweep is submitted with its own
nodes and tasks per node, from its mesh (framework.launch.slurm.job_shape). Hydra only
instantiates launchers found in the hydra_plugins namespace, hence this module's home.
Without the plugin (the `slurm` extra), the same names say which pip command installs it.
"""
import sys
from pathlib import Path
from typing import Any, List, Sequence, Tuple

from hydra.core.singleton import Singleton
from hydra.plugins.launcher import Launcher
from omegaconf import OmegaConf

from framework.config.errors import ConfigError
from framework.launch.slurm import INSTALL, job_shape

try:
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher
except ImportError:
    class _Missing(Launcher):
        def __init__(self, **_: Any) -> None:
            raise ConfigError("hydra/launcher", "submitit", f"the SLURM launchers need the slurm extra: {INSTALL}")

        def setup(self, **_: Any) -> None: ...

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any: ...

    class MeshSizedSlurmLauncher(_Missing):
        pass

    class MeshSizedLocalLauncher(_Missing):
        pass

else:
    class _MeshSized:
        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> List[Any]:
            import submitit

            shapes = [self._job_shape(overrides) for overrides in job_overrides]  # all before any is submitted
            Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
            executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=self.params["submitit_folder"],
                                             **{f"{self._EXECUTOR}_max_num_timeout": self.params.get("max_num_timeout", 0)})
            # As the plugin does: its shared keys go as they are, the others with the executor's prefix.
            shared = set(OmegaConf.structured(BaseQueueConf).keys())
            params = {key if key in shared else f"{self._EXECUTOR}_{key}": value for key, value in self.params.items()
                      if key not in ("submitit_folder", "max_num_timeout", "nodes", "tasks_per_node")}
            jobs = []
            for idx, (overrides, (nodes, per_node)) in enumerate(zip(job_overrides, shapes), start=initial_job_idx):
                executor.update_parameters(**params, nodes=nodes, tasks_per_node=per_node)
                jobs.append(executor.submit(self, list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}",
                                            Singleton.get_state()))
            return [job.results()[0] for job in jobs]

        def _job_shape(self, overrides: Sequence[str]) -> Tuple[int, int]:
            """A job that cannot be sized is a config error: its one line and exit 2 (as
            framework.train), not a traceback through Hydra."""
            try:
                return job_shape(self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides)))
            except ConfigError as error:
                print(f"{error} (job {' '.join(overrides)})", file=sys.stderr)
                sys.exit(2)

    class MeshSizedSlurmLauncher(_MeshSized, SlurmLauncher):
        pass

    class MeshSizedLocalLauncher(_MeshSized, LocalLauncher):
        pass
