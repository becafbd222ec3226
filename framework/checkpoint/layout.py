"""The checkpoint directory: `<dir>/step_<N>/`, complete or absent.

A save writes into `<dir>/.partial_step_<N>/`; rank 0 renames it to `step_<N>` only after every
rank's shards and DCP's `.metadata` are written and `framework.json` (step, data position,
history, config, versions) is in it. So a kill during a save leaves at most a `.partial_*`
directory, which `auto` never picks and the next run removes. No torch.distributed import here:
the launcher resolves and checks checkpoints without loading the ranks' machinery.
"""
import json
import os
import re
import shutil
from typing import List, Optional, Tuple

from framework.atomic import atomic_file

STEP_DIR = re.compile(r"^step_(\d+)$")
PARTIAL_PREFIX = ".partial_"
META_FILE = "framework.json"
DCP_METADATA = ".metadata"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names its path and the problem."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"checkpoint {path}: {problem}")


def first_failure(error: BaseException) -> str:
    """One line for what went wrong in a DCP call: DCP gathers every rank's exception into a
    CheckpointException (a BaseException, which `except Exception` misses); take the first."""
    failures = getattr(error, "failures", None)
    if failures:
        rank, (cause, _) = sorted(failures.items())[0]
        return f"{_describe(cause)} (on rank {rank})"
    return _describe(error)


def _describe(error: BaseException) -> str:
    if isinstance(error, EOFError) and not str(error):
        return "EOFError: a file ends early (truncated?)"
    return f"{type(error).__name__}: {error}"


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step}")


def partial_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"{PARTIAL_PREFIX}step_{step}")


def complete_checkpoints(directory: str) -> List[Tuple[int, str]]:
    """(step, path) of every complete checkpoint under `directory`, oldest first: in the order
    they were completed (framework.json is written last), steps breaking ties. A run started
    with checkpoint.resume=null in a dir that holds a higher step saves the newest one."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = STEP_DIR.match(name)
        meta = os.path.join(directory, name, META_FILE)
        if match and os.path.isfile(meta):
            found.append((os.stat(meta).st_mtime_ns, int(match.group(1)), os.path.join(directory, name)))
    return [(step, path) for _, step, path in sorted(found)]


def newest_checkpoint(directory: str) -> Optional[str]:
    found = complete_checkpoints(directory)
    return found[-1][1] if found else None


def resolve(source: str, directory: str) -> Optional[str]:
    """`auto`: the newest complete checkpoint under `directory` (the last completed), or None (a
    fresh start). A path: a `step_N` dir, or a checkpoints dir meaning its newest; anything else
    raises."""
    if source == "auto":
        return newest_checkpoint(directory)
    path = os.path.abspath(os.path.expanduser(source))
    if not os.path.isdir(path):
        raise CheckpointError(path, "no such directory; give a step_N checkpoint or a checkpoints dir")
    if os.path.exists(os.path.join(path, DCP_METADATA)) or os.path.exists(os.path.join(path, META_FILE)):
        read_meta(path)  # a step dir: it must be complete
        return path
    newest = newest_checkpoint(path)
    if newest is None:
        inner = os.path.join(path, "checkpoints")
        hint = f"; a run's dir: give its checkpoints dir, {inner}" if newest_checkpoint(inner) else ""
        raise CheckpointError(path, f"holds no complete checkpoint (no step_N dir with framework.json){hint}")
    return newest


def read_meta(path: str) -> dict:
    """framework.json of a checkpoint; a missing or unreadable one is a CheckpointError."""
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise CheckpointError(path, f"no {META_FILE}: not a complete checkpoint (a save interrupted?)")
    if not os.path.isfile(os.path.join(path, DCP_METADATA)):
        raise CheckpointError(path, f"no {DCP_METADATA}: the torch.distributed.checkpoint metadata is missing")
    try:
        with open(meta_path) as f:
            return json.load(f)
    except (OSError, ValueError) as error:
        raise CheckpointError(path, f"{META_FILE} is unreadable: {error}") from None


def write_meta_and_publish(partial: str, final: str, meta: dict) -> None:
    """Rank 0, once every rank's files are in `partial`: add framework.json, then make the
    checkpoint visible under its final name in one rename."""
    with atomic_file(os.path.join(partial, META_FILE)) as f:
        json.dump(meta, f, indent=1)
    if os.path.isdir(final):  # a run resumed from an older checkpoint reaches this step again
        shutil.rmtree(final)
    os.rename(partial, final)


def remove_partial(directory: str) -> List[str]:
    """Delete what interrupted saves left; return their paths."""
    if not os.path.isdir(directory):
        return []
    removed = [os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(PARTIAL_PREFIX)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def keep_newest(directory: str, keep_last: Optional[int]) -> List[str]:
    """Remove all but the newest `keep_last` complete checkpoints; return the removed paths."""
    if keep_last is None:
        return []
    old = [path for _, path in complete_checkpoints(directory)[:-keep_last]]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old
