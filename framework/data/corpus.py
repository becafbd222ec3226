"""Byte-level language-modelling data that needs no download.

By default the corpus is this Python's own standard library sources (the top-level *.py files,
sorted by name, so it is the same on every rank and every run on a machine); `path` may name
any file or directory instead (a directory: its files, recursively, sorted). Tokens are the
bytes (vocabulary 256). The last `val_fraction` of the bytes is held out for validation.
Sample i is the window of seq_len + 1 tokens starting at i * seq_len: inputs and next-token
targets (consecutive windows share one boundary token).
"""
import sysconfig
from pathlib import Path
from typing import List, Optional

import torch
from torch.utils.data import Dataset

from framework.config.errors import ConfigError

VOCAB_SIZE = 256


def corpus_files(path: Optional[str]) -> List[Path]:
    if path is None:
        return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    root = Path(path).expanduser()
    if not root.exists():
        raise ConfigError("data.dataset.path", path, "no such file or directory; point it at a text file or a "
                          "directory of them, or null for the Python standard library's sources")
    return [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())


class ByteCorpus(Dataset):
    def __init__(self, path: Optional[str] = None, seq_len: int = 128, split: str = "train",
                 val_fraction: float = 0.05, max_bytes: Optional[int] = None):
        if split not in ("train", "val"):
            raise ConfigError("data.dataset.split", split, "use train or val")
        data = b"".join(p.read_bytes() for p in corpus_files(path))[:max_bytes]
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        cut = int(len(tokens) * (1 - val_fraction))
        self.tokens = tokens[:cut] if split == "train" else tokens[cut:]
        self.seq_len = seq_len
        if len(self) == 0:
            raise ConfigError("data.dataset.path", path,
                              f"the {split} split of this corpus ({len(self.tokens)} bytes) holds no window of "
                              f"seq_len+1={seq_len + 1} bytes; give more text or a shorter seq_len")

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index: int):
        window = self.tokens[index * self.seq_len: (index + 1) * self.seq_len + 1].long()
        return window[:-1], window[1:]
