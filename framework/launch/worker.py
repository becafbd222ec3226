"""What every rank runs, and the entry of a self-launched rank:
`python -m framework.launch.worker RESOLVED_CONFIG OUT_DIR`.

The launcher (framework.launch.local.launch_local) starts one per mesh position through the elastic
agent, which sets RANK, WORLD_SIZE and MASTER_ADDR/PORT. `record` writes the rank's error
where the agent reads it, so the launcher can name the failing rank and its exception. The
traceback goes to the rank's log, not the console: there a failure is one line, said once (by
the launcher, or by the rank itself when the agent restarts every rank after it).
"""
import logging
import os
import signal
import sys
from typing import Optional

import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from framework.launch.local import headline, lost_peer
from framework.launch.threads import apply_in_rank, binds_cores
from framework.launch.zygote import restart_note
from framework.parallel.fault_tolerance_config import replica_group
from framework.training.builder import build_and_run
from framework.training.watchdog import EXIT_LOCK
from framework.validate import validate

log = logging.getLogger("framework")


def _no_traceback(record_: logging.LogRecord) -> bool:
    return record_.exc_info is None


def setup_rank_logging(out_dir: str, rank: int) -> None:
    """Every rank logs to logs/rank<N>.log in the job's dir; rank 0 also to the console, where
    records that carry a traceback (a failure) are left out."""
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    handlers = [logging.FileHandler(os.path.join(out_dir, "logs", f"rank{rank}.log"))]
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        console.addFilter(_no_traceback)
        handlers.append(console)
    position = replica_group()  # launcher.fault_tolerance: each replica group numbers its own ranks
    name = f"group{position[0]} rank{rank}" if position else f"rank{rank}"
    logging.basicConfig(level=logging.INFO, format=f"[{name}] %(asctime)s %(message)s",
                        handlers=handlers, force=True)


def run_rank(cfg_container: dict, out_dir: str) -> Optional[dict]:
    """What every rank runs: re-check the config cheaply, build the stages, return rank 0's summary."""
    rank = int(os.environ["RANK"])
    setup_rank_logging(out_dir, rank)
    try:
        cfg = OmegaConf.create(cfg_container)
        bind = binds_cores(cfg)
        threads = apply_in_rank(cfg.launcher.threads_per_rank, bind)
        if rank == 0:
            log.info("%s", threads)
        # (this host's ranks: under torchrun across hosts, not the whole world)
        validate(cfg, world_size=int(os.environ["WORLD_SIZE"]), deep=False,
                 ranks_per_host=int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
        run = build_and_run(cfg, out_dir)
    except Exception as error:
        log.exception("rank %d failed", rank)
        # Said before the process group closes: that tells the peers, and the agent may stop
        # this rank (SIGTERM) as soon as one of them fails of it.
        ErrorFileUnderExitLock().record_exception(error)
        _say_before_restart(error, rank)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return run.summary if rank == 0 else None


def _say_before_restart(error: Exception, rank: int) -> None:
    """One line when the agent will restart every rank after this failure (the launcher says the
    last attempt's); a rank that lost its peer failed because of another and says nothing."""
    note = restart_note()
    line = headline(f"{type(error).__name__}: {error}")
    if note and not lost_peer(line):
        print(f"rank {rank} failed: {line} (traceback in logs/rank{rank}.log){note}", file=sys.stderr, flush=True)


class ErrorFileUnderExitLock(ErrorHandler):
    """The agent's error file, written holding the stall watchdog's exit lock (a watchdog that
    ends the process while the main thread writes the file would leave it cut short) and whole
    or not at all: torch writes it in place, and an agent polling while a rank wrote it read an
    empty file and failed (JSONDecodeError) instead of restarting the ranks."""

    _writing_to: Optional[str] = None

    def _get_error_file_path(self) -> Optional[str]:
        return self._writing_to or super()._get_error_file_path()

    def record_exception(self, e: BaseException) -> None:
        with EXIT_LOCK:
            final = super()._get_error_file_path()
            self._writing_to = f"{final}.tmp" if final else None
            try:
                super().record_exception(e)
                if final:
                    os.replace(self._writing_to, final)
            finally:
                self._writing_to = None


def _run_from_argv() -> None:
    config_path, out_dir = sys.argv[1:3]
    run_rank(OmegaConf.to_container(OmegaConf.load(config_path)), out_dir)


def main() -> None:
    try:
        record(_run_from_argv, ErrorFileUnderExitLock())()
    except KeyboardInterrupt:  # SIGINT before training (framework.training.interrupt handles it during)
        sys.exit(128 + signal.SIGINT)
    except Exception:  # logged with its traceback, in the error file, said by run_rank
        sys.exit(1)


if __name__ == "__main__":
    main()
