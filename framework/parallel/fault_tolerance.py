"""launcher.fault_tolerance=torchft: the DP replicas of the mesh run as torchft replica groups.

Each replica group is a world of its own (its TP ranks inside, as usual), started and
restarted by its own elastic agent (framework.launch.replica_groups). Across groups the gradient
average goes through torchft's Manager: every step starts with a quorum of the live groups (the
lighthouse's), the gradients are averaged over the groups in it, and the optimizer steps only if
every group's all-reduce succeeded (`should_commit`). A group that fails is left out of the next
quorum (after the lighthouse's heartbeat timeout, launcher.ft_detection_s) while the others go
on; restarted, it receives a live group's weights, optimizer, schedule and training state over
torchft's checkpoint transport in its first quorum and trains on from that step.

A step a group failed in is not committed by any group: the live ones run it again on the same
batch (their samples of it: no data is skipped), so every step number in the history was trained once.
Its global batch is what the live groups trained (their samples; the learning rate is the step's).
"""
import logging
import os
import signal
import time
import warnings
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from framework.parallel.dtensors import whole
from framework.parallel.fault_tolerance_config import replica_group
from framework.parallel.replica_check import checksum

log = logging.getLogger("framework")


class NoFaultTolerance:
    """No fault tolerance: one world; every step commits; nothing to heal.

    What the loop (framework.training.trainer) calls, at each point of a step: begin(trainer)
    once before the first; before_step() at a step's start (True: the state was replaced,
    start the data again from its position); should_commit() after the gradients, before the
    optimizer; after_step(loss): the step's loss as the history keeps it, or None when no group
    committed the step (the loop runs it again on the same batch). mean() is evaluation's."""

    stopping_signals = (signal.SIGINT, signal.SIGTERM)  # stop the ranks together (framework.training.interrupt)

    def gradients_across(self) -> Optional["ReplicaGroups"]:
        """Where DataParallel averages the gradients instead of its DP group (None: there)."""
        return None

    def begin(self, trainer: Any) -> None:
        pass

    def before_step(self) -> bool:
        return False

    def should_commit(self) -> bool:
        return True

    def after_step(self, loss: torch.Tensor) -> Optional[torch.Tensor]:
        return loss

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def check(self, module: torch.nn.Module, step: int) -> None:
        pass

    def scalars(self) -> Dict[str, float]:
        return {}

    def summary(self) -> Dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def _local(tree: Any) -> Any:
    """DTensors as their local shards: what the checkpoint transport sends (same layout on both ends)."""
    return tree_map_only(DTensor, lambda t: t.to_local(), tree)


def _like(received: Any, live: Any) -> Any:
    """`received` (local shards) placed as the `live` state's DTensors are."""
    if isinstance(live, DTensor):
        return DTensor.from_local(received, live.device_mesh, live.placements, run_check=False,
                                  shape=live.shape, stride=live.stride())
    if isinstance(live, dict):
        return {key: _like(value, live[key]) if key in live else value for key, value in received.items()}
    return received


class ReplicaGroups:
    """This rank's side of the replica groups: torchft's Manager (made at the first step, so the
    lighthouse never waits on a group still building), the gradient all-reduce across groups
    (DataParallel calls all_reduce / size, and ride / arrived for the step's loss), and the commit
    of each step (the loop's hooks, as NoFaultTolerance's).

    The quorum can change from one step to the next, so each step's loss is averaged over the
    groups that trained it in that step: it rides in the last gradient bucket's all-reduce (one
    value more in it), so no collective is added for it."""

    # SIGTERM ends a rank at once: its group's agent sends it when one of the group's ranks died,
    # and a rank then waiting in torchft's quorum or commit for the dead one would otherwise sit
    # there until the agent's SIGKILL (30 s), its group still heartbeating, so that the lighthouse
    # held the live groups' quorum that long. Ctrl-C (SIGINT) still stops each group cleanly.
    stopping_signals = (signal.SIGINT,)

    def __init__(self, cfg: DictConfig, group: int, groups: int):
        self.cfg, self.group, self.groups = cfg, group, groups
        self.manager = None
        self._committed = True
        self.live: List[int] = []  # per committed step: the replica groups that trained it
        self._healed = False
        self._trainer: Any = None
        self._loss: Optional[torch.Tensor] = None  # the step's loss averaged over the quorum's groups

    # -- what DataParallel calls ---------------------------------------------------------

    def all_reduce(self, flat: torch.Tensor):
        """Sum over the quorum's groups (a failure is reported to the Manager, not raised)."""
        return self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM)

    def size(self) -> int:
        return self.manager.num_participants()

    riders = 1  # values that ride in the last bucket: the step's loss

    def ride(self, tail: torch.Tensor) -> None:
        """This group's share of the step's loss (so far: the last micro-batch's forward is done)."""
        tail.copy_(whole(self._trainer.step.loss))

    def arrived(self, tail: torch.Tensor) -> None:
        self._loss = tail[0].clone()

    # -- what the builder and the loop call ------------------------------------------------

    def gradients_across(self) -> "ReplicaGroups":
        return self

    def begin(self, trainer: Any) -> None:
        """Make the Manager, carrying what a restarted group receives from a live one: the model,
        optimizer and schedule (the checkpointer's parts, as local shards), the training state
        with the losses not yet logged (the trainer's pending ones), and the live-group counts."""
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.http_transport import HTTPTransport

        self._trainer = trainer
        run, pending = trainer.run, trainer.pending
        detection = timedelta(seconds=self.cfg.launcher.ft_detection_s)
        patient = timedelta(seconds=self.cfg.trainer.collective_timeout_s)
        checkpointer = run.checkpointer

        def state_dict() -> Dict[str, Any]:
            history = checkpointer.state.state_dict()
            history["history"]["losses"] += pending.buffer[: pending.count].tolist()
            return {"model": _local(checkpointer.model.state_dict()), "optim": _local(checkpointer.optimizer.state_dict()),
                    "scheduler": checkpointer.scheduler.state_dict(), "train": history, "live": list(self.live)}

        def load_state_dict(received: Dict[str, Any]) -> None:
            """(The transport's tensors view its read-only receive buffer: cloned before use.)"""
            received = tree_map_only(torch.Tensor, torch.clone, received)
            checkpointer.model.load_state_dict(_like(received["model"], checkpointer.model.state_dict()))
            checkpointer.optimizer.load_state_dict(_like(received["optim"], checkpointer.optimizer.state_dict()))
            checkpointer.scheduler.load_state_dict(received["scheduler"])
            state, train = checkpointer.state, received["train"]
            state.step = train["step"]
            state.position.epoch, state.position.samples = train["data"]["epoch"], train["data"]["samples"]
            for key, values in train["history"].items():  # in place: the loop's Metrics hold these lists
                state.history.setdefault(key, [])[:] = values
            pending.count = 0
            self.live[:] = received["live"]
            self._healed = True
            log.info("replica group %d: healed from a live group at step %d", self.group, state.step)

        # its per-step INFO lines, and a warning per quorum that gloo has no NCCL flight recorder
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")  # (see load_state_dict)
        transport = HTTPTransport(timeout=patient, num_chunks=0)  # torchft's default, minus a console line per request
        transport._server.RequestHandlerClass.log_message = lambda *args: None
        host, port = self._attempt_store()
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=detection), load_state_dict=load_state_dict, state_dict=state_dict,
            min_replica_size=1, use_async_quorum=False, timeout=patient, quorum_timeout=patient,
            connect_timeout=patient, replica_id=f"replica_group_{self.group}", init_sync=False,
            checkpoint_transport=transport, store_addr=host, store_port=port)
        self.manager.load_state_dict({"step": run.state.step, "batches_committed": 0})
        self._wait_for_every_group(run.state.step, patient.total_seconds())

    def _attempt_store(self) -> Tuple[str, int]:
        """A TCPStore of this attempt's own for the Manager (served by the group's rank 0; its port
        broadcast over the group): the elastic agent's store outlives a restart, and a restarted
        rank read the dead attempt's manager address from it and waited on it."""
        host = os.environ["MASTER_ADDR"]
        port = [None]
        if dist.get_rank() == 0:
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            port = [self._store.port]
        dist.broadcast_object_list(port, src=0)
        return host, port[0]

    def _wait_for_every_group(self, step: int, patience: float) -> None:
        """Launched groups start together (else the first to arrive would train alone):
        quorums until every group is in one, or `patience` seconds. A restarted group heals instead."""
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        deadline = time.monotonic() + patience
        while True:
            self.manager.start_quorum()
            if self.manager.num_participants() >= self.groups or time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def before_step(self) -> bool:
        """The step's quorum; True when this group just took a live group's state (the loop then
        continues from its step and data position)."""
        self.manager.start_quorum()
        healed, self._healed = self._healed, False
        return healed

    def should_commit(self) -> bool:
        """Whether every group of the quorum finished the step, so the optimizer and the LR
        schedule step (asked once, before them: torchft's OptimizerWrapper, except that the
        quorum starts at the step's start, before its data: before_step)."""
        self._committed = self.manager.should_commit()
        if self._committed:
            self.live.append(self.manager.num_participants())
        else:
            log.warning("replica group %d: step %d not committed (a replica group failed in it); the live groups "
                        "run it again", self.group, self.manager.current_step() + 1)
        return self._committed

    def after_step(self, loss: torch.Tensor) -> Optional[torch.Tensor]:
        """The step's loss averaged over the groups that trained it (it rode with the gradients),
        or None when the step was not committed."""
        return self._loss if self._committed else None

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean over the quorum's groups of per-group values (evaluation's loss sum and
        count), in their shape."""
        flat = value.detach().float().reshape(-1).clone()
        self.manager.allreduce(flat).wait()
        return flat.reshape(value.shape)

    @torch.no_grad()
    def check(self, module: torch.nn.Module, step: int) -> None:
        """The replica check across groups (trainer.check_replicas_every): each parameter's local
        shard the same in every live group (one all-reduce of checksums under MAX)."""
        names, sums = zip(*[(name, checksum(p.to_local() if isinstance(p, DTensor) else p))
                            for name, p in module.named_parameters()])
        local = torch.stack(sums)
        both = torch.cat([local, -local])
        self.manager.allreduce(both, reduce_op=dist.ReduceOp.MAX).wait()
        differing = [name for name, differs in zip(names, (both[: len(local)] != -both[len(local):]).any(dim=1).tolist())
                     if differs]
        if differing:
            raise RuntimeError(f"replica check at step {step}: parameter {differing[0]} differs across replica groups "
                               f"(they must hold the same weights after every committed step)")

    def scalars(self) -> Dict[str, float]:
        return {"live_replica_groups": float(self.live[-1])} if self.live else {}

    def summary(self) -> Dict[str, Any]:
        return {"replica_groups": self.groups, "replica_group": self.group, "live_replica_groups": list(self.live)}

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)


def build_fault_tolerance(cfg: DictConfig):
    """This rank's ReplicaGroups under launcher.fault_tolerance=torchft, else NoFaultTolerance."""
    position = replica_group()
    if cfg.launcher.get("fault_tolerance") != "torchft" or position is None:
        return NoFaultTolerance()
    return ReplicaGroups(cfg, *position)


