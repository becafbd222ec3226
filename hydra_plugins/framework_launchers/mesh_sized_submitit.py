"""The submitit plugin's launchers, except that each job of a sweep is submitted with its own
nodes and tasks per node, from its mesh (framework.launch.slurm.job_shape). On SLURM, every job's
allocation is tested before any is submitted, and the launcher watches the jobs itself
(framework.launch.slurm_watch: state changes on the console, hopeless jobs cancelled, no sacct);
a job that ended without a result or before its run finished (cancelled, timed out, never
started) is recorded in its job dir, so the sweep report lists it. Hydra only instantiates
launchers found in the hydra_plugins namespace, hence this module's home. Without the plugin (the
`slurm` extra), the same names say which pip command installs it.
"""
import json
import sys
import time
from pathlib import Path
from typing import Any, List, Sequence, Tuple

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, OmegaConf, open_dict

from framework.config.errors import ConfigError
from framework.launch.slurm import INSTALL, job_shape
from framework.launch.slurm_watch import sbatch_refusal, watch
from framework.report import clear_failure, record_failure

RESULT_GRACE_S = 30.0  # how long a COMPLETED job's result file may take to show on a shared filesystem


def saved(job_dir: Path) -> str:
    """`; checkpoint ... saved at step N` when the job's ranks saved where a signal stopped them
    (framework.training.interrupt), else ""."""
    summary = job_dir / "summary.json"
    stopped = json.loads(summary.read_text()).get("stopped") if summary.exists() else None
    return f"; checkpoint {stopped['checkpoint']} saved at step {stopped['step']}" \
        if stopped and stopped["checkpoint"] else ""

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
            if self._EXECUTOR == "slurm":
                for overrides, shape in zip(job_overrides, shapes):
                    self._check_allocation(overrides, *shape)
            Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
            for idx, overrides in enumerate(job_overrides, start=initial_job_idx):  # a reused sweep dir's
                clear_failure(str(self._job_config(overrides, idx).hydra.runtime.output_dir))
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
            if self._EXECUTOR != "slurm":
                return [job.results()[0] for job in jobs]
            labels = {job.job_id: f"job {idx}: {' '.join(overrides)}"
                      for idx, (job, overrides) in enumerate(zip(jobs, job_overrides), start=initial_job_idx)}
            ended = watch(labels)
            return [self._outcome(job, overrides, idx, ended[job.job_id])
                    for idx, (job, overrides) in enumerate(zip(jobs, job_overrides), start=initial_job_idx)]

        def _outcome(self, job: Any, overrides: Sequence[str], idx: int, how: str) -> JobReturn:
            """Task 0's JobReturn (it records a failed rank in the job dir itself), or, for a job
            that left none or did not complete, _unfinished's. (Cancelled or out of time, its ranks
            got Slurm's SIGTERM, saved where they stopped and returned: not a finished run.)"""
            import submitit

            task = job.task(0)
            deadline = time.monotonic() + (RESULT_GRACE_S if how == "COMPLETED" else 0)
            while not task.paths.result_pickle.exists() and time.monotonic() < deadline:
                time.sleep(1)  # a shared filesystem may show the file late
            if task.paths.result_pickle.exists():
                try:
                    result = task.results()[0]
                    if how == "COMPLETED":
                        return result
                except (submitit.core.utils.UncompletedJobError, submitit.core.utils.FailedJobError) as error:
                    how = f"{how} ({type(error).__name__})"
            return self._unfinished(overrides, idx, how)

        def _check_allocation(self, overrides: Sequence[str], nodes: int, per_node: int) -> None:
            """sbatch --test-only on the job's allocation, with every sbatch option the launcher
            passes: one that Slurm can never grant is a config error (exit 2) before anything is
            submitted, not a job pending forever."""
            refusal = sbatch_refusal(nodes, per_node, dict(self.params))
            if refusal:
                print(f"config error: {nodes} node(s) x {per_node} task(s) in partition "
                      f"{self.params.get('partition') or '(default)'}: Slurm cannot run it: {refusal} "
                      f"(job {' '.join(overrides)}); pick another partition, launcher.ranks_per_node or mesh",
                      file=sys.stderr)
                sys.exit(2)

        def _unfinished(self, overrides: Sequence[str], idx: int, how: str) -> JobReturn:
            """A job that left no result (cancelled, timed out, never started): its error line in its
            job dir, with the configs Hydra would have saved there, so the sweep report lists it."""
            sweep_config = self._job_config(overrides, idx)
            job_dir = Path(sweep_config.hydra.runtime.output_dir)
            (job_dir / ".hydra").mkdir(parents=True, exist_ok=True)
            if not (job_dir / ".hydra" / "hydra.yaml").exists():
                hydra_node = OmegaConf.create({"hydra": OmegaConf.to_container(sweep_config.hydra, resolve=False)})
                OmegaConf.save(hydra_node, job_dir / ".hydra" / "hydra.yaml")
                with open_dict(sweep_config):
                    del sweep_config["hydra"]
                OmegaConf.save(sweep_config, job_dir / ".hydra" / "config.yaml")
            line = how if "can never start" in how else f"slurm job ended {how} before the run finished{saved(job_dir)}"
            record_failure(str(job_dir), line)
            print(line, file=sys.stderr)
            # COMPLETED, as framework.train's own failed jobs return: a FAILED one would end the sweep
            # in Hydra before the report (which reads error.txt) is written.
            result = JobReturn(overrides=list(overrides), working_dir=str(job_dir), status=JobStatus.COMPLETED)
            result.return_value = None
            return result

        def _job_config(self, overrides: Sequence[str], idx: int) -> DictConfig:
            """The job's config as Hydra composes it, with its number and job dir set."""
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.num = idx
                sweep_config.hydra.runtime.output_dir = str(Path(str(self.config.hydra.sweep.dir),
                                                                str(sweep_config.hydra.sweep.subdir)))
            return sweep_config

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
