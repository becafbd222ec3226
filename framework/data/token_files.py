"""The token files `python -m framework.prepare` writes once and the datasets read
memory-mapped (nanoGPT's token file, Megatron's indexed dataset).

A prepared directory holds tokens.bin (uint16 or uint32 ids, documents back to back, each
ending with the tokenizer's EOS), doc_offsets.npy (int64: where each document starts, and the
end), mask.bin for instruction data (uint8 per token: 1 where it is a response token to learn),
labels.bin for unpaired preference data (uint8 per example), and meta.json (its kind, dtype,
counts, the tokenizer's identity and vocabulary, the inputs).
"""
import json
import os

import numpy as np

from framework.config.errors import ConfigError

FORMAT = "framework-tokens/1"
TOKENS, OFFSETS, MASK, META = "tokens.bin", "doc_offsets.npy", "mask.bin", "meta.json"
LABELS = "labels.bin"  # unpaired preference data: 1 for a desirable example, 0 for an undesirable one


def read_meta(path: str, key: str = "data.path") -> dict:
    """The prepared directory's meta.json, or one line naming the path and the fix."""
    if not path:
        raise ConfigError(key, path, "name a directory written by python -m framework.prepare")
    meta_path = os.path.join(os.path.expanduser(path), META)
    if not os.path.isfile(meta_path):
        raise ConfigError(key, path, f"no {META} there: not a directory python -m framework.prepare finished "
                          "writing (prepare writes under a temporary name and renames at the end)")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ConfigError(key, path, f"its format is {meta.get('format')!r}, not {FORMAT!r}; prepare it again")
    return meta


def split_range(count: int, val_fraction: float, split: str) -> tuple:
    """[start, end) of the train or val split of `count` items: val is the last val_fraction."""
    if split not in ("train", "val"):
        raise ConfigError("data.dataset.split", split, "use train or val")
    cut = int(count * (1 - val_fraction))
    return (0, cut) if split == "train" else (cut, count)


def packed_windows(tokens: int, seq_len: int, val_fraction: float, split: str) -> int:
    start, end = split_range(tokens, val_fraction, split)
    return max(0, (end - start - 1) // seq_len)


# Each kind of prepared data: the data= config that reads it, and framework.prepare's flags that make it.
KINDS = {"packed": ("data=tokens", "--text-field FIELD"),
         "instruction": ("data=instructions", "--prompt-field P --response-field R"),
         "preference": ("data=preferences", "--prompt-field P --chosen-field C --rejected-field R"),
         "prompts": ("data=prompts", "--prompt-field P [--answer-field A]"),
         "unpaired": ("data=kto", "--prompt-field P --response-field R --label-field L")}


class PreparedDocuments:
    """A prepared directory's documents: the token stream, where each document starts, and for
    instruction data which tokens are learned. The datasets below read documents through this
    face, so data=hf (framework.data.hf) packs and masks exactly as prepared data does."""

    def __init__(self, path: str, kind: str):
        self.path = os.path.expanduser(path)
        meta = read_meta(path)
        if meta["kind"] != kind:
            given, wanted = KINDS[meta["kind"]], KINDS[kind]
            raise ConfigError("data.path", path, f"holds {meta['kind']} data; this dataset reads {kind} data: prepare "
                                                 f"it again with python -m framework.prepare {wanted[1]} (then "
                                                 f"{wanted[0]}), or read it as it is with {given[0]}")
        self.tokenizer = meta["tokenizer"]  # path, identity, vocab_size, eos_id
        self.stream = np.memmap(os.path.join(self.path, TOKENS), dtype=meta["dtype"], mode="r")
        self.offsets = np.load(os.path.join(self.path, OFFSETS))
        self.learned = np.memmap(os.path.join(self.path, MASK), dtype=np.uint8, mode="r") if kind != "packed" else None

    def tokens(self, begin: int, end: int) -> np.ndarray:
        return self.stream[begin:end].astype(np.int64)

    def mask(self, begin: int, end: int) -> np.ndarray:
        return self.learned[begin:end].astype(np.bool_)

    def learned_at(self, positions: np.ndarray) -> np.ndarray:
        return self.learned[positions] == 1

    def prompt_lengths(self, first: int, end: int) -> np.ndarray:
        """Documents [first, end)'s prompt tokens: the mask's 0s (its 1s come last)."""
        begin, stop = int(self.offsets[first]), int(self.offsets[end])
        responses = np.add.reduceat(self.learned[begin:stop], self.offsets[first:end] - begin, dtype=np.int64)
        return np.diff(self.offsets[first:end + 1]) - responses

