"""A file appears whole or not at all: written under a temporary name beside it, then renamed
over it in one step. Stdlib only (the launcher and the watchdog use it)."""
import os
from contextlib import contextmanager
from typing import IO, Iterator


@contextmanager
def atomic_file(path: str, mode: str = "w") -> Iterator[IO]:
    """`with atomic_file(path) as f: ...`: readers see the old file (or none) until the block
    ends, then the new one; a block that raises leaves no temporary file behind."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, mode) as f:
            yield f
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
