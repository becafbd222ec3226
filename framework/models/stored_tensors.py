"""A Hugging Face model directory's *.safetensors, read by plain file reads: which files (the index
must name only files that are there), each tensor's name and shape from the headers alone, and one
tensor at a time (framework.checkpoint.weights streams a load through it)."""
import json
import os
import struct
from typing import Any, Dict, Iterator, List, Tuple

import torch

from framework.config.errors import ConfigError


def _safetensors_header(file: str) -> Tuple[Dict[str, Any], int]:
    """A safetensors file's entries by tensor name, and where its data starts."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class StoredTensors:
    """A model directory's tensors by their Hugging Face names, each read alone with plain file
    reads: safetensors' safe_open maps the whole file, whose pages then count in the process's
    resident memory as they are read (a streamed load must hold one tensor at a time)."""

    def __init__(self, path: str):
        self.entries = {name: (file, start, entry) for file in weight_files(path)
                        for header, start in [_safetensors_header(file)] for name, entry in header.items()}

    def shapes(self) -> Dict[str, List[int]]:
        return {name: entry["shape"] for name, (_, _, entry) in self.entries.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        file, start, entry = self.entries[name]
        begin, end = entry["data_offsets"]
        with open(file, "rb") as f:
            f.seek(start + begin)
            data = bytearray(f.read(end - begin))
        return torch.frombuffer(data, dtype=_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def weight_files(path: str) -> List[str]:
    """The *.safetensors files of `path`; those an index names must all be there."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        for name in files:
            if not os.path.isfile(os.path.join(path, name)):
                raise ConfigError("model.path", path, f"model.safetensors.index.json names {name}, which is missing")
        return [os.path.join(path, name) for name in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ConfigError("model.path", path, "holds no *.safetensors weights")
    return [os.path.join(path, f) for f in files]


def stored_shapes(path: str) -> Iterator[Tuple[str, List[int]]]:
    """Each tensor's name and shape from the files' headers; a file that is not safetensors named."""
    for file in weight_files(path):
        try:
            header, _ = _safetensors_header(file)
        except (OSError, ValueError, struct.error) as error:
            raise ConfigError("model.path", path, f"{os.path.basename(file)} is not a safetensors file: {error}") from None
        for name, entry in header.items():
            yield name, entry["shape"]
