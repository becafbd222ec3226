"""Self-launch: prod(mesh.shape) workers through torch.distributed's elastic launcher (the
engine behind torchrun) on loopback. Hydra and validation ran once, in the launching process;
ranks get the resolved config and the job's output dir and never compose or create directories
themselves. If any rank fails, the agent stops the others and the launcher reports the failing
rank and its error. (Under torchrun the process joins that world instead: framework.launch.torchrun.)
"""
import json
import logging
import math
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Dict, Optional

from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from framework.launch.handoff import write_resolved_config
from framework.launch.threads import apply_in_rank, binds_cores, for_ranks
from framework.launch.zygote import zygote_socket
from framework.training.watchdog import stall_message


class RankFailed(RuntimeError):
    """A rank raised or died; the message names the rank and its error."""


class Interrupted(Exception):
    """The launcher was signalled (Ctrl-C, SIGTERM) and its ranks have stopped; the message says
    where, and what was saved (framework.training.interrupt)."""

    def __init__(self, number: int, message: str = ""):
        super().__init__(message or f"interrupted by {signal.Signals(number).name}")
        self.number = number


def interrupted_message(number: int, summary: Optional[dict]) -> str:
    """What signal `number` left: rank 0's summary of this launch (None: it wrote none) says where
    the ranks stopped and which checkpoint they saved there."""
    name = signal.Signals(number).name
    if summary is None:
        return f"interrupted by {name}: the ranks stopped without saving (before training started, or at once on a " \
               "second signal)"
    stopped = summary.get("stopped")
    if not stopped:  # the signal came after the last step
        return f"interrupted by {name} after the last step: the run is complete"
    saved = (f"checkpoint {stopped['checkpoint']} saved; the same command resumes from it" if stopped["checkpoint"]
             else "no checkpoint saved (checkpoint.every is null)")
    return f"interrupted by {name}: every rank stopped after step {stopped['step']}; {saved}"


def _summary(out_dir: str, since: float = 0.0) -> Optional[dict]:
    """The job's summary.json, if rank 0 wrote it at or after `since`."""
    path = os.path.join(out_dir, "summary.json")
    if not os.path.exists(path) or os.path.getmtime(path) < since:
        return None
    with open(path) as f:
        return json.load(f)


# A rank whose peer died fails too, inside a collective; such errors are consequences.
_PEER_LOST = re.compile(r"gloo|nccl|connection closed|connection reset|broken pipe", re.IGNORECASE)


def headline(message: str) -> str:
    """The exception's own line, not the last line of a multi-line message (Hydra's
    InstantiationException ends with the error of the constructor it called)."""
    headlines = re.findall(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit)\b.*$", message, re.MULTILINE)
    return headlines[-1] if headlines else message.strip().splitlines()[-1]


def _headline(failure) -> str:
    return headline(failure.message["message"] if isinstance(failure.message, dict) else failure.message)


def lost_peer(error_line: str) -> bool:
    """An error of a collective whose peer died: the consequence of another rank's failure."""
    return bool(_PEER_LOST.search(error_line))


def _raised(failure) -> bool:
    """The rank wrote its own error (the agent's error file), even if the agent's SIGTERM then
    ended it before it exited: the error is the rank's account, not the signal."""
    return isinstance(failure.message, dict)  # a message of the error file, not the agent's own line


def _is_consequence(failure) -> bool:
    """Failures that follow another rank's: the agent's SIGTERM to the ranks still running, and
    a collective that lost its peer."""
    if failure.exitcode < 0 and not _raised(failure):
        return failure.exitcode == -signal.SIGTERM
    return lost_peer(_headline(failure))


def _failure_message(error: ChildFailedError) -> str:
    """Name the rank that failed first: a rank's own error or a rank killed by a signal (kill -9,
    the OOM killer, a crash) before the consequences; among equals, the earliest (the agent
    stamps failures to the second, so ties are common), an error before a signal, then by rank."""
    failures = error.failures
    ranks = sorted(failures, key=lambda r: (_is_consequence(failures[r]), failures[r].timestamp,
                                            failures[r].exitcode < 0, r))
    rank, failure = ranks[0], failures[ranks[0]]
    others = f"; ranks {ranks[1:]} failed after it" if len(ranks) > 1 else ""
    if failure.exitcode < 0 and not _raised(failure):
        return (f"rank {rank} was killed by signal {failure.signal_name()} (exit code {failure.exitcode}): from "
                f"outside the run (kill, the OOM killer) or by a crash, so it left no traceback{others}")
    # A rank that raised exits 1, or -15 when the agent's SIGTERM to the ranks still running
    # reaches it first: a race, so its error, not its exit code, is the account.
    code = "" if _raised(failure) else f" (exit code {failure.exitcode})"
    return f"rank {rank} failed{code}: {_headline(failure)} (traceback in logs/rank{rank}.log){others}"


def _name_rendezvous_events_by_frame() -> None:
    """torch's rendezvous names each of its telemetry events by its caller through
    inspect.stack(), which builds every frame's source context and looks each file up in
    sys.modules: ~0.3 CPU-s of a launch whose ranks train for less (9 events, 1,400 modules).
    The same name read off the frame (sys._getframe) costs nothing."""
    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = lambda depth=2: sys._getframe(depth).f_code.co_name


def _with_rank_threads(function: Callable, *args: Any) -> Any:
    apply_in_rank(None, False)  # decided by the launcher
    return function(*args)


def spawn_ranks(world: int, entrypoint: Callable | str, *args: Any, max_restarts: int = 0,
                threads_per_rank: Optional[int] = None, bind_cores: bool = False) -> Dict[int, Any]:
    """Run `entrypoint(*args)` (a function, or a command with its arguments) in `world` fresh
    processes forming one process group on loopback; return each rank's result (None for a
    command). Any rank failing stops them all; the agent then starts them all again, up to
    `max_restarts` times, and after that raises RankFailed. A function runs in forks of a server
    that imported the framework once (multiprocessing's forkserver), not in fresh interpreters.
    Each rank gets its share of this host's cores (framework.launch.threads), with `bind_cores`
    bound to them."""
    multiprocessing.set_forkserver_preload(["framework.training.builder"])
    _name_rendezvous_events_by_frame()
    if callable(entrypoint):
        entrypoint, args = _with_rank_threads, (entrypoint, *args)
    # The agent logs each failed rank's whole traceback; the rank's own log has it, and
    # RankFailed says which rank and why. Its agent also warns of the signal it relays to the
    # ranks; Interrupted says it.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="framework-elastic-") as log_dir:
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=str(uuid.uuid4()),
            rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1",
            max_restarts=max_restarts, monitor_interval=0.1, start_method="forkserver",
            logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        )
        try:
            with for_ranks(threads_per_rank, world, bind_cores):
                return elastic_launch(config, entrypoint)(*args)
        except ChildFailedError as error:
            raise RankFailed(_failure_message(error)) from None
        except SignalException as stop:  # the agent signalled the ranks and waited for them to end
            raise Interrupted(stop.sigval) from None


def launch_local(cfg: DictConfig, out_dir: str) -> Optional[dict]:
    """Start prod(mesh.shape) ranks as `python -m framework.launch.worker` processes, each handed the
    resolved config; return rank 0's summary (None when the pipeline stops before training).
    Separate processes (not a spawned function) let the agent see every failed rank; forks of a
    zygote that imported the framework once (framework.launch.zygote) make them start in ms.

    Two fast starts stay, each for what the other cannot do: a command rank is the same program
    torchrun runs (framework.launch.worker), and the zygote starts with the CLI, so its imports
    overlap Hydra's and validation's; a function rank (verify, inspect, tests) returns a value,
    which the agent hands back only from multiprocessing's processes, forked by its forkserver
    once the first rank starts."""
    config_path = write_resolved_config(cfg, out_dir)
    started = time.time()
    try:
        spawn_ranks(math.prod(cfg.mesh.shape), sys.executable, "-m", "framework.launch.zygote", zygote_socket(),
                    "framework.launch.worker", config_path, out_dir, max_restarts=cfg.launcher.max_restarts,
                    threads_per_rank=cfg.launcher.threads_per_rank,
                    bind_cores=binds_cores(cfg))
    except Interrupted as stop:
        raise Interrupted(stop.number, interrupted_message(stop.number, _summary(out_dir, started))) from None
    except RankFailed:
        stalled = stall_message(out_dir)  # the ranks' own account of a stall beats their exit codes
        if stalled:
            raise RankFailed(stalled) from None
        raise
    stopped = (_summary(out_dir, started) or {}).get("stopped")
    if stopped:  # a signal to a rank, not to this launcher: the ranks still stopped together and saved
        number = signal.Signals[stopped["signal"]]
        raise Interrupted(number, interrupted_message(number, _summary(out_dir)))
    return _summary(out_dir)
