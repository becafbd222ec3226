"""The DP-derived DistributedSampler, the StatefulDataLoader over it, and the global position
in the batch order that a checkpoint saves and a resume continues from.

The sampler's replicas are the DP submesh: num_replicas is its size and rank this process's
coordinate on the DP dim, so every rank of a TP group draws the same batch and DP replicas
draw disjoint ones. With a fixed global batch, replica r's batch t is positions
r, r+dp, r+2dp, ... of the permutation's slice [t*G, (t+1)*G): the union over replicas is the
same global batch for every DP size, which is what makes mesh shapes comparable step by step.
"""
import warnings
from dataclasses import dataclass
from typing import Iterator

import torch

from torch.utils.data import Dataset, DistributedSampler, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from framework.config.errors import ConfigError


def check_loader(cfg, cores: int) -> None:
    """The loader's worker count, before torch refuses it in every rank, or starts more worker
    processes than the host's `cores` (each a process with its own copy of the dataset, which
    only contend for the cores: torch's own suggested maximum)."""
    workers = cfg.data.get("num_workers")
    if workers is not None and workers < 0:
        raise ConfigError("data.num_workers", workers, "must be >= 0 (0: the samples are read in the rank's own "
                                                       "process)")
    if workers is not None and workers > cores:
        raise ConfigError("data.num_workers", workers, f"is more than this host's {cores} cores: each worker is a "
                                                       f"process of its own for every rank, and more than the cores "
                                                       f"only contend for them; use at most {cores}")


class StreamEpochs:
    """A stream's (framework.data.stream) stand-in for the sampler: its replica's records, and
    the epoch. Where an epoch stands is the loader's own state, which the checkpoint saves per
    rank, not a global position."""

    def __init__(self, stream, dp_size: int, dp_rank: int):
        self.stream, self.num_replicas = stream, dp_size
        stream.for_replica(dp_rank, dp_size)

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def load_state_dict(self, state: dict) -> None:
        """(A resumed stream continues from the loader's state instead.)"""


def build_sampler(dataset: Dataset, dp_size: int, dp_rank: int, shuffle: bool, seed: int,
                  drop_last: bool):
    """torchdata's DistributedSampler that can start an epoch part-way (load_state_dict's
    `yielded`): a resumed run skips this replica's share of the samples already consumed. A
    stream is split among the replicas by itself."""
    if isinstance(dataset, IterableDataset):
        return StreamEpochs(dataset, dp_size, dp_rank)
    return StatefulDistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle,
                                      seed=seed, drop_last=drop_last)


def build_dataloader(dataset: Dataset, sampler: DistributedSampler, per_replica_batch: int,
                     num_workers: int) -> StatefulDataLoader:
    """Always drops a last batch shorter than the per-replica batch: every step, on every
    replica, uses exactly global_batch_size / DP samples (sampler.drop_last only decides whether
    the sampler trims or pads the epoch to a multiple of the DP size). Its own generator: a new
    iterator (every epoch, and a resumed one mid-epoch) would otherwise draw a worker seed from
    the global RNG, and a resumed run's RNG stream would drift from the uninterrupted run's."""
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(dataset, batch_size=per_replica_batch, drop_last=True,
                                  collate_fn=getattr(dataset, "collate", None),  # (framework.data.vision's)
                                  sampler=None if isinstance(sampler, StreamEpochs) else sampler,
                                  num_workers=dataset.workers(num_workers) if isinstance(sampler, StreamEpochs)
                                  else num_workers, generator=torch.Generator().manual_seed(0))


@dataclass
class DataPosition:
    """Where the global batch order stands: the epoch and the global samples consumed in it.
    Independent of the DP size: a new DP size skips samples / DP of its replica's indices."""
    epoch: int = 0
    samples: int = 0


def batches(sampler, dataloader, position: DataPosition, global_batch: int) -> Iterator:
    """Endless batches from `position` on, which advances as batches are taken. Each pass over
    the data is one epoch, with set_epoch before it so every epoch gets its own (seeded)
    permutation; a resumed epoch skips the samples its global position says were consumed
    (this replica's share of them, whatever the DP size)."""
    while True:
        sampler.set_epoch(position.epoch)
        sampler.load_state_dict({"yielded": position.samples // sampler.num_replicas})
        for batch in dataloader:
            position.samples += global_batch
            yield batch
        position.epoch += 1
        position.samples = 0
