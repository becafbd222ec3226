"""data=hf with data.streaming=true: a Hugging Face dataset read record by record (a Hub
dataset too large to download, or local files), tokenized and packed as it streams.

The same packing as data=hf (windows of seq_len + 1 tokens every seq_len tokens, documents
masked the same way), but of each DP replica's own records: `datasets.distributed.
split_dataset_by_node` gives replica r its own shards (or, when the shards do not divide among
the replicas, every replica-th record), and the loader's workers share out the replica's shards
again. So no rank reads the whole set, and the windows depend on the DP size: a stream's global
batches are not the map-style dataset's, and a checkpoint of a stream resumes on the same mesh
only. The position inside the stream is each rank's loader state (the shard and the record in
it, from `datasets`, and the tokens read but not yet trained on), saved per rank with the model.
"""
import copy
import logging
from typing import Optional

import numpy as np
import torch
from torch.utils.data import IterableDataset

from framework.config.errors import ConfigError
from framework.data.hf import check_fields, open_dataset
from framework.data.tokenizer import described, load_tokenizer
from framework.data.datasets import positions_in_documents

log = logging.getLogger("framework")


class HFTokenStream(IterableDataset):
    """Windows of the replica's records' texts, packed; state_dict / load_state_dict are what
    torchdata's StatefulDataLoader saves and restores in each worker."""
    kind = "packed"
    streamed = True
    said = False  # (workers: the cap said once a process)

    def __init__(self, path: str, tokenizer: Optional[str], text_field: str = "text", hf_split: str = "train",
                 name: Optional[str] = None, seq_len: int = 128, document_masking: bool = False):
        if not tokenizer:
            raise ConfigError("data.tokenizer", tokenizer, "data=hf tokenizes as it reads: name the model's "
                                                           "tokenizer.json (or its directory), or 'bytes'")
        self.path, self.field, self.seq_len, self.masking = path, text_field, seq_len, document_masking
        self.source = self.replica = open_dataset(path, hf_split, name, streaming=True)
        check_fields(self.source, path, [text_field])
        self.text = load_tokenizer(tokenizer)
        self.tokenizer = described(self.text)
        self.vocab_size = self.tokenizer["vocab_size"]
        self._state: dict = {"records": None, "tokens": [], "starts": [0]}
        self._resume: Optional[dict] = None

    def for_replica(self, rank: int, replicas: int) -> None:
        """Read DP replica `rank`'s records only."""
        from datasets.distributed import split_dataset_by_node

        self.replica = split_dataset_by_node(self.source, rank=rank, world_size=replicas)

    def workers(self, asked: int) -> int:
        """The loader's workers for this replica: at most its shards (datasets would stop the rest
        itself, with a warning at every iterator: each epoch, the validation loader's too)."""
        shards = self.replica.num_shards
        if asked > shards and not HFTokenStream.said:
            HFTokenStream.said = True
            log.info("data.num_workers=%d: %d worker(s), one a shard of the replica's %d", asked, shards, shards)
        return min(asked, shards)

    def set_epoch(self, epoch: int) -> None:
        self.replica.set_epoch(epoch)

    def state_dict(self) -> dict:
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict) -> None:
        self._resume = state

    def __iter__(self):
        """`tokens` holds what was read and not yet a window's inputs; `starts`, where its
        documents start (0 for the one the first token is in: a window's positions count from
        its own start at the earliest)."""
        state, self._resume = self._resume or {"records": None, "tokens": [], "starts": [0]}, None
        if state["records"] is not None:
            self.replica.load_state_dict(state["records"])
        tokens, starts, eos, seq_len = list(state["tokens"]), list(state["starts"]), self.text.eos_id, self.seq_len
        for number, record in enumerate(self.replica):
            text = record[self.field]
            if not isinstance(text, str):
                raise ConfigError("data.dataset.text_field", self.field, f"record {number} of {self.path} (this "
                                  f"replica's) holds {type(text).__name__}, not text")
            if len(tokens):
                starts.append(len(tokens))
            tokens += self.text.encode_batch([text])[0] + [eos]
            while len(tokens) >= seq_len + 1:
                window = torch.tensor(tokens[:seq_len + 1])
                positions = positions_in_documents(np.array(starts), 0, seq_len)
                tokens, starts = tokens[seq_len:], [0] + [s - seq_len for s in starts if s > seq_len]
                self._state = {"records": self.replica.state_dict(), "tokens": tokens, "starts": starts}
                yield (window[:-1], window[1:], positions) if self.masking else (window[:-1], window[1:])
