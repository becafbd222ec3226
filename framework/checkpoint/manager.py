"""Saving and loading inside the ranks, with torch.distributed.checkpoint (DCP), over the
parts of a run that follow torch's Stateful protocol (torchtitan's checkpoint manager is the
model): the model and the optimizer go into DCP's files, the LR scheduler and the TrainState
(step, data position, history) into framework.json (layout.py) with the config, the mesh and
the versions.

Model and optimizer go through DCP's get_/set_model_state_dict and get_/set_optimizer_state_dict
over the model inside the DataParallel wrapper, so keys are the model's own names and TP
parameters are DTensors that each rank writes as its own shards with their global layout
(replicated tensors once). DCP reshards on load, so a checkpoint loads into another mesh shape
or plan. Besides them the DCP files hold every rank's RNG state (`rng.rank<N>`).

Saves are synchronous or, with checkpoint.async_save, DCP's async_save over a gloo group of
their own (a background thread's collectives must not interleave with the training step's):
at most one is in flight, and the last one finishes before the run ends.
"""
import json
import logging
import os
import time
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Dict, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from framework.checkpoint.compat import checkpoint_dir
from framework.checkpoint.layout import (
    CheckpointError,
    keep_newest,
    partial_dir,
    read_meta,
    remove_partial,
    step_dir,
    write_meta_and_publish,
)
from framework.checkpoint.safe_load import load_checkpoint, read_checkpoint_metadata
from framework.data.loader import DataPosition
from framework.models.adapter_names import is_adapter
from framework.training.schedule import fitted_to_groups
from framework.training.state import TrainState

log = logging.getLogger("framework")
# A source tree's pyproject.toml (framework/checkpoint/ -> the tree's root)
SOURCE_PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "pyproject.toml")


def framework_version(pyproject: str = SOURCE_PYPROJECT) -> str:
    """The framework's version for a checkpoint's record, which is informational: a tree
    importable but not installed (PYTHONPATH=.) has no package metadata, and its first save
    once died there (PackageNotFoundError) after the training it was to keep. Then the tree's
    pyproject.toml says it, else it is unknown."""
    try:
        return version("framework")
    except PackageNotFoundError:
        pass
    try:
        with open(pyproject, "rb") as f:
            return f"{tomllib.load(f)['project']['version']} (source tree, not installed)"
    except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError):
        return "unknown (not installed)"


@dataclass
class Resumed:
    """Which checkpoint a run continues, for summary.json (its state went into the parts)."""
    path: str
    step: int
    load_s: float


class ModelState(Stateful):
    """The model's state dict by its own parameter names, DTensor shards as they are; with
    `adapters_only`, its LoRA adapters alone (the frozen base comes from its own source)."""

    def __init__(self, model: nn.Module, adapters_only: bool = False):
        self.model, self.adapters_only = model, adapters_only

    def state_dict(self) -> Dict[str, Any]:
        state = get_model_state_dict(self.model)
        return {k: v for k, v in state.items() if is_adapter(k)} if self.adapters_only else state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=not self.adapters_only))


class OptimizerState(Stateful):
    """The optimizer's state keyed by parameter names (not positions), so it reshards too.
    Flattened (each hyperparameter under its parameter's name, as torchtitan saves it): a
    pipeline stage holds only some parameters, and one saved list of param_groups would name
    only the saving rank's. `flat=False` reads checkpoints saved before (one param_groups list)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, flat: bool = True):
        self.model, self.optimizer = model, optimizer
        self.options = StateDictOptions(flatten_optimizer_state_dict=flat)

    def state_dict(self) -> Dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=self.options)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state, options=self.options)


class SaveFailed(RuntimeError):
    """A checkpoint DCP could not write, said in one line (DCP's CheckpointException is a
    BaseException whose message holds every rank's traceback)."""


@contextmanager
def said_in_one_line(partial: str) -> Iterator[None]:
    try:
        yield
    except CheckpointException as error:
        ranks = sorted(error.failures)
        cause = error.failures[ranks[0]][0] if ranks else error
        raise SaveFailed(f"the checkpoint could not be written to {partial} (ranks {ranks}): "
                         f"{type(cause).__name__}: {cause}; check checkpoint.dir") from error


def optimizer_saved_flat(path: str) -> bool:
    """Whether the checkpoint holds the optimizer flattened (this version) or, as before, one
    param_groups list (whose first group's `params` is then a key of its own)."""
    return "optim.param_groups.0.params" not in read_checkpoint_metadata(path).state_dict_metadata


class Checkpointer:
    """Saves and loads the parts given: `model` (the module inside any DP wrapper), `optimizer`,
    `scheduler` and `state`; the only writer of checkpoints and of their records. With `base`
    (a LoRA run: its base model's identity, framework.checkpoint.base_model) a checkpoint holds
    the adapters alone and names that base. With `stream` (the loader of a streamed dataset,
    framework.data.stream) each rank's place in its stream is saved too, as its RNG state is."""

    def __init__(self, cfg: DictConfig, out_dir: str, rank: int, model: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, state: TrainState, base: Optional[dict] = None,
                 stream: Any = None):
        self.cfg, self.rank, self.base, self.stream = cfg, rank, base, stream
        self.model, self.optimizer = ModelState(model, adapters_only=base is not None), OptimizerState(model, optimizer)
        self.scheduler, self.state = scheduler, state
        self.every = cfg.checkpoint.every
        self.dir = checkpoint_dir(cfg, out_dir)
        self.in_flight = None  # an async save: (future, then what _publish takes)
        self.async_group = dist.new_group(backend="gloo") if self.every and cfg.checkpoint.async_save else None

    # -- saving -------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.cfg.trainer.max_steps)

    def save(self, step: int) -> float:
        """Write checkpoint `step` and record it in the TrainState's history (the save's step,
        the seconds training was blocked, and once published the seconds until the files were
        all written); return the blocking seconds."""
        start = time.perf_counter()
        self.wait()  # at most one save in flight
        entry = {"step": step, "blocking_s": None}
        self.state.history["checkpoints"].append(entry)
        state = self._dcp_state()
        partial, final = partial_dir(self.dir, step), step_dir(self.dir, step)
        meta = self._meta()
        if self.async_group is None:
            with said_in_one_line(partial):
                dcp.save(state, checkpoint_id=partial)  # returns once every rank's files and .metadata are written
            self._record_blocking(entry, meta, start)
            self._publish(partial, final, meta, entry, start)
        else:
            future = dcp.async_save(state, checkpoint_id=partial, process_group=self.async_group)
            self._record_blocking(entry, meta, start)
            self.in_flight = (future, partial, final, meta, entry, start)
        return entry["blocking_s"]

    @staticmethod
    def _record_blocking(entry: dict, meta: dict, start: float) -> None:
        """The save's record, in the history and in the copy of it the checkpoint carries."""
        entry["blocking_s"] = meta["history"]["checkpoints"][-1]["blocking_s"] = time.perf_counter() - start

    def poll(self) -> None:
        """Publish a finished async save without waiting for one that is still writing."""
        if self.in_flight is not None and self.in_flight[0].done():
            self.wait()

    def wait(self) -> None:
        """Finish the save in flight, if any (every rank's future completes once all files are in)."""
        if self.in_flight is None:
            return
        future, *publish = self.in_flight
        self.in_flight = None
        with said_in_one_line(publish[0]):
            future.result()
        self._publish(*publish)

    def _publish(self, partial: str, final: str, meta: dict, entry: dict, start: float) -> None:
        if self.rank != 0:
            return
        write_meta_and_publish(partial, final, meta)
        entry["total_s"] = time.perf_counter() - start  # async: until the files were all in (to a step)
        removed = keep_newest(self.dir, self.cfg.checkpoint.keep_last)
        log.info("checkpoint %s saved%s", final, f"; removed {removed}" if removed else "")

    def _dcp_state(self) -> Dict[str, Any]:
        state = {"model": self.model, "optim": self.optimizer, f"rng.rank{self.rank}": torch.get_rng_state()}
        if self.stream is not None:
            # one JSON string: DCP would flatten a dict into keys a fresh loader's state lacks
            state[f"stream.rank{self.rank}"] = json.dumps(self.stream.state_dict())
        return state

    def _meta(self) -> dict:
        cfg, state = self.cfg, self.state.state_dict()
        state["data"]["global_batch_size"] = cfg.data.global_batch_size
        return {
            **state,
            "scheduler": self.scheduler.state_dict(),
            **({"base": self.base} if self.base is not None else {}),
            "mesh": {"shape": list(cfg.mesh.shape), "dim_names": list(cfg.mesh.dim_names)},
            "world_size": dist.get_world_size(),
            "config": OmegaConf.to_container(cfg, resolve=True),
            "versions": {"torch": torch.__version__, "framework": framework_version()},
            "saved_unix": time.time(),
        }

    # -- loading ------------------------------------------------------------------------

    def remove_partial(self) -> None:
        """Rank 0 removes what interrupted saves left (a resume never reads those)."""
        if self.rank == 0:
            for path in remove_partial(self.dir):
                log.info("removed %s, left by an interrupted save", path)

    def load(self, path: str) -> Resumed:
        """Every part from `path`; the RNG states too when the world is the same (another
        world's ranks are other processes)."""
        start = time.perf_counter()
        meta = read_meta(path)
        same_world = meta["world_size"] == dist.get_world_size() and meta["mesh"]["shape"] == list(self.cfg.mesh.shape)
        state = self._dcp_state()
        # a checkpoint of adapters alone (its base loaded before), or one of the whole model
        state["model"] = ModelState(self.model.model, adapters_only="base" in meta)
        if not same_world:
            del state[f"rng.rank{self.rank}"]
            if self.stream is not None and not self.cfg.checkpoint.reset_data:
                raise CheckpointError(path, f"holds each rank's place in a stream (data.streaming) for the mesh "
                                            f"{meta['mesh']['shape']}; resume it on that mesh, or set checkpoint."
                                            f"reset_data=true to start the stream again")
        if self.stream is not None and self.cfg.checkpoint.reset_data:
            del state[f"stream.rank{self.rank}"]
        if not optimizer_saved_flat(path):
            state["optim"] = OptimizerState(self.optimizer.model, self.optimizer.optimizer, flat=False)
        load_checkpoint(state, path)
        if same_world:
            torch.set_rng_state(state[f"rng.rank{self.rank}"])
        if self.stream is not None and not self.cfg.checkpoint.reset_data:
            self.stream.load_state_dict(json.loads(state[f"stream.rank{self.rank}"]))
        self.scheduler.load_state_dict(fitted_to_groups(meta["scheduler"], self.scheduler.optimizer))
        self.state.load_state_dict(meta)
        if self.cfg.checkpoint.reset_data:
            position = self.state.position
            self.state.position = DataPosition(position.epoch + (position.samples > 0), 0)
            if self.rank == 0:
                log.info("checkpoint.reset_data: the data restarts at the start of epoch %d", self.state.position.epoch)
        return Resumed(path, meta["step"], time.perf_counter() - start)

    def close(self) -> None:
        self.wait()
        if self.async_group is not None:
            dist.destroy_process_group(self.async_group)
            self.async_group = None
