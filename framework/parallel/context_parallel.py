"""Context parallelism over the mesh's `cp` dim (parallel.cp_dim): every sequence of a
replica's batch split over the CP ranks, attention over the whole of it.

Layout (torchtitan's head-tail load balancer): the sequence is cut into 2c chunks and CP rank i
of c holds chunks i and 2c-1-i, so every rank has the same share of causal attention work.
The CP ranks of a replica read the same samples (the sampler keys on DP alone) and each keeps
its chunks of every sample's inputs, targets and positions (`SequenceChunks`). Each rank embeds
and runs its own tokens; attention all-gathers keys and values over CP (only those, never the
other activations) and backward returns their gradients to their owners (the all-gather's
autograd is a reduce-scatter). Queries and keys carry their real places in the sequence, so the
causal and document masks (framework.models.documents) and the rotary positions are those of
one process. For the loss and the gradients a CP rank is one more holder of other tokens: the
gradient average and the loss's count span the DP dims and the cp dim together
(framework.parallel.roles.MeshRoles.dp_cp_mesh), as torchtitan's dp_shard_cp.

torch's own context_parallel has no CPU attention strategy in torch 2.13; this is plain SDPA
with a mask over gathered keys, on every device.
"""
from typing import Optional, Tuple

import torch
from torch import nn
from torch.distributed._functional_collectives import all_gather_single, all_gather_single_autograd
from torch.utils.data import Dataset

from framework.models.protocol import offered


def chunk_indices(seq_len: int, rank: int, size: int) -> torch.Tensor:
    """The places in a sequence of `seq_len` tokens that CP rank `rank` of `size` holds: chunks
    rank and 2*size - 1 - rank of 2*size."""
    chunk = seq_len // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


class SequenceChunks(Dataset):
    """`dataset`'s samples cut to this CP rank's chunks: (inputs, targets, positions), the
    positions (each token's place in its document; its place in the window without document
    masking) kept for the attention masks. Anything else is the dataset's."""

    def __init__(self, dataset: Dataset, rank: int, size: int):
        self.dataset, self.rank, self.size = dataset, rank, size

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str):
        if name == "dataset":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, index: int):
        sample = self.dataset[index]
        if isinstance(sample, dict):  # a mixture's: its source kept
            return {**sample, **dict(zip(("inputs", "targets", "positions"), self._cut(
                sample["inputs"], sample["targets"], sample.get("positions"))))}
        inputs, targets, *positions = sample
        return self._cut(inputs, targets, positions[0] if positions else None)

    def _cut(self, inputs: torch.Tensor, targets: torch.Tensor, positions: Optional[torch.Tensor]) -> tuple:
        positions = torch.arange(len(inputs)) if positions is None else positions
        mine = chunk_indices(len(inputs), self.rank, self.size)
        return inputs[mine], targets[mine], positions[mine]


class ContextParallel:
    """What attention needs to see the whole sequence from this rank's chunks of it."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def query_and_key_indices(self, local_len: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """Places in the sequence of this rank's tokens, and of the gathered keys (rank order)."""
        seq_len = local_len * self.size
        keys = torch.cat([chunk_indices(seq_len, r, self.size) for r in range(self.size)])
        return chunk_indices(seq_len, self.rank, self.size).to(device), keys.to(device)

    def gather_starts(self, starts: torch.Tensor) -> torch.Tensor:
        """Every CP rank's tokens' document starts (batch, seq), for the keys' side of the mask."""
        return all_gather_single(starts, gather_dim=1, group=self.group)

    def gather_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Keys or values (batch, local seq, heads, head_dim) of every CP rank along the sequence;
        their gradients go back to their owners, summed (a reduce-scatter)."""
        return all_gather_single_autograd(keys.contiguous(), gather_dim=1, group=self.group)


def apply_cp(model: nn.Module, cp_mesh) -> None:
    """Every attention of `model` (and the model, which makes the masks) under CP over `cp_mesh`."""
    if cp_mesh is None:
        return
    offered(model).use_context_parallel(ContextParallel(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size()))


