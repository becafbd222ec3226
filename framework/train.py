"""`python -m framework.train [overrides]`: compose the config with Hydra, validate it, launch.

A bad config exits with status 2 and one `config error: KEY=VALUE: FIX` line; a failed rank
exits with status 1 and names the rank and its error. In a sweep (-m) a failed job records that
line and the sweep goes on; the sweep report lists it and the command exits 1. A sweep's job
returns its objective (framework.hpo) to a sweeper that optimizes (`-m hydra/sweeper=optuna`).
Ctrl-C or SIGTERM ends the command (a sweep too) with 128 + the signal's number once the ranks
have stopped and saved (framework.training.interrupt), saying where.
"""
import os
import shutil
import signal
import sys
import warnings
from typing import Optional

from framework.launch.zygote import zygote_socket

if __name__ == "__main__" and "RANK" not in os.environ:  # self-launching (torchrun sets RANK):
    zygote_socket()  # start the ranks' zygote first, so its imports overlap Hydra's and validation's

import hydra  # noqa: E402 (after the zygote's start)
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from framework.checkpoint.compat import checkpoint_dir, nothing_to_train
from framework.cli import CONFIG_DIR, command_status, register_config
from framework.config.errors import ConfigError
from framework.validate import validate
from framework.hpo import check_before_sweep, check_objective, objective, optimizes
from framework.launch.handoff import HYDRA_ONLY, under_torchrun
from framework.launch.local import Interrupted, RankFailed, launch_local
from framework.launch.slurm import in_submitit_job
from framework.report import clear_failure, record_failure

register_config()
# conf/hydra/launcher/submitit_*.yaml take the submitit plugin's options as their schema, on purpose.
warnings.filterwarnings("ignore", message=r"(?s).*is validated against ConfigStore schema with the same name")


def choose_layout(cfg: DictConfig, world: Optional[int] = None) -> DictConfig:
    """mesh=auto: the planner's first choice for planner.world ranks, or torchrun's `world`."""
    from framework.planner.auto import choose_layout as planned  # (the planner: only when asked for)

    return planned(cfg, list(HydraConfig.get().overrides.task), world=world)


def launch(cfg: DictConfig, out_dir: str) -> Optional[dict]:
    """Join torchrun's world or a submitit job's when inside one, else validate and start the
    ranks here (with mesh=auto, on the planner's first choice)."""
    if in_submitit_job():
        from framework.launch.slurm import join_job_world  # see below

        return join_job_world(cfg, out_dir)
    if under_torchrun():
        # Rank 0 of torchrun's world runs as a rank itself; a self-launcher never imports
        # the ranks' machinery (DTensor and the rest), which keeps its start-up short.
        from framework.launch.torchrun import launch_in_torchrun_world

        return launch_in_torchrun_world(cfg, out_dir, choose_layout)
    if cfg.mesh.auto:
        cfg = choose_layout(cfg)
    validate(cfg, out_dir=out_dir)
    finished = nothing_to_train(cfg, checkpoint_dir(cfg, out_dir))
    if finished:
        print(finished)
        return None
    if cfg.launcher.fault_tolerance:
        from framework.launch.replica_groups import launch_replica_groups  # (torchft: only when asked for)

        return launch_replica_groups(cfg, out_dir)
    return launch_local(cfg, out_dir)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def hydra_app(cfg: DictConfig) -> Optional[float]:
    """A failed job of a sweep (-m) records its error line and returns None: sys.exit would end the
    whole sweep (Hydra's run_job catches Exception, not SystemExit), and an exception would skip
    the sweep report (Hydra re-raises it before on_multirun_end). The report lists the job and
    exits 1 (framework/report.py); Optuna's sweeper records a failed trial. A job that finished
    returns its objective (framework.hpo.objective), which the basic sweeper ignores."""
    out_dir = HydraConfig.get().runtime.output_dir
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    if multirun and not in_submitit_job():
        clear_failure(out_dir)  # a reused sweep dir (submitit's launchers clear theirs before submitting)
    try:
        if multirun and optimizes(HydraConfig.get()):
            check_objective(cfg)  # (a swept trainer.eval_every: the command checked the configured one)
        launch(cfg, out_dir)
        return objective(cfg, out_dir) if multirun else None
    except ConfigError as error:
        line, status = str(error), 2
    except RankFailed as error:
        line, status = f"training failed: {error}", 1
    except Interrupted as stop:  # in a sweep too: the signal ends the sweep, not just this job
        print(stop, file=sys.stderr)
        sys.exit(128 + stop.number)
    print(line, file=sys.stderr)
    if multirun:
        record_failure(out_dir, line)
        return None
    if status == 2 and set(os.listdir(out_dir)) <= HYDRA_ONLY:  # a job refused at validation leaves nothing
        shutil.rmtree(out_dir)
    sys.exit(status)


def main() -> None:
    if under_torchrun() and os.environ["RANK"] != "0":
        from framework.launch.torchrun import follow_rank0  # see launch()

        sys.exit(follow_rank0())
    refused = command_status(lambda: check_before_sweep(sys.argv[1:]) or 0, "")
    if refused:
        sys.exit(refused)
    try:
        hydra_app()
    except KeyboardInterrupt:  # Ctrl-C before the ranks started (after, the launcher's agent handles it)
        print("interrupted by SIGINT before training started: nothing saved", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except SystemExit as exit_:
        # Hydra prints its own errors (an override it cannot apply, a recipe that does not exist)
        # and exits 1 while handling them; those are config errors: exit 2, as the README says.
        if exit_.code == 1 and isinstance(exit_.__context__, (HydraException, OmegaConfBaseException)):
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
