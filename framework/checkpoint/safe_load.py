"""Reading a checkpoint someone else wrote runs no code of theirs.

torch.distributed.checkpoint reads `.metadata` with `pickle.load` and the non-tensor items
(the optimizer's param_groups) with `torch.load(weights_only=False)`: either runs whatever a
crafted file names. SafeReader unpickles `.metadata` admitting only DCP's own metadata types
and the few torch and stdlib values they hold; SafeLoadPlanner loads non-tensor items with
`torch.load(weights_only=True)` (plain containers, numbers, strings). Tensors DCP already reads
with weights_only=True. Every reader of a checkpoint (resume, init_from, export, the launcher's
key check) goes through these two.
"""
import dataclasses
import enum
import io
import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from framework.checkpoint.layout import CheckpointError, complete_checkpoints, first_failure

# Callables a DCP `.metadata` pickle names besides DCP's own dataclasses and enums.
ADMITTED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
            ("collections", "OrderedDict"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class RefusedPickle(pickle.UnpicklingError):
    pass


def _admitted(module: str, name: str) -> bool:
    if (module, name) in ADMITTED:
        return True
    if module == "torch":  # dtypes and memory formats are pickled as torch.<name>
        return isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format, torch.layout))
    if module == dcp_metadata.__name__:
        value = getattr(dcp_metadata, name, None)
        return isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))
    return False


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _admitted(module, name):
            raise RefusedPickle(f"it names {module}.{name}, which is not checkpoint metadata (a crafted file?); "
                                f"nothing of it was run")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's file reader, with `.metadata` unpickled through the allowlist above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = _MetadataUnpickler(metadata_file).load()
        if not isinstance(metadata, Metadata):
            raise RefusedPickle(f"it holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_checkpoint_metadata(path: str) -> Metadata:
    """A checkpoint's `.metadata` through SafeReader; a truncated or foreign file (it unpickles
    into anything, or fails anywhere) is a CheckpointError that says which checkpoint to use
    instead."""
    try:
        return SafeReader(path).read_metadata()
    except Exception as error:
        raise CheckpointError(path, f"unreadable .metadata ({type(error).__name__}: {error}); "
                                    f"{_instead(path)}") from None


def _instead(path: str) -> str:
    """The fix for a checkpoint whose .metadata cannot be read: the checkpoint before it."""
    path = os.path.normpath(path)
    earlier = [p for _, p in complete_checkpoints(os.path.dirname(path)) if os.path.normpath(p) != path]
    before = f"checkpoint.resume={earlier[-1]}" if earlier else "checkpoint.resume=null to start afresh"
    return (f"the save was cut short or the file is not a DCP checkpoint's: delete {path} (checkpoint.resume=auto "
            f"then takes the one before it) or give {before}")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, with non-tensor items read by torch's weights-only unpickler (as
    DefaultLoadPlanner.load_bytes places them)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_checkpoint(state: dict, path: str, no_dist: bool = False) -> None:
    """DCP's load of `state` from `path` (resharding into whatever layout `state` has), through
    the reader and planner above; its errors become one line naming the checkpoint (a missing
    or truncated shard file, a key the checkpoint lacks, a refused pickle)."""
    try:
        dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), no_dist=no_dist)
    except (Exception, CheckpointException) as error:
        raise CheckpointError(path, f"cannot be loaded: {first_failure(error)}") from None
