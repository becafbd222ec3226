"""A function of each whole tensor, computed once, for tensors the ranks hold in parts.

Muon orthogonalizes each hidden matrix whole, while FSDP2, TP and EP leave each rank a part of
it (DTensor shards on any mesh, uneven or empty ones too). Gathering every matrix on every rank
(what torch.optim.Muon does to a DTensor: 15 all_gathers a 32 x 64 weight) computes each one
world-size times. Here each tensor has one owner rank, spread round-robin over its mesh's ranks;
the parts travel to their owner, the owner applies the function to the whole, and each rank gets
its part of the result back: one all_to_all_single each way for a bucket of tensors. A part that
several ranks hold (a Replicate dim: HSDP's replicas) is sent once and received by all of them.

Which part each rank holds (offset and shape in the whole, as DCP reads a DTensor) is exchanged
once, when the layout is made; the parts themselves travel in the dtype the function starts by
casting to (Muon's bf16), so what the owner computes is what one process would.
"""
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from framework.parallel.dtensors import global_offset, is_dtensor, local_tensor

Block = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offset, shape) of a rank's part in the whole


def _block(tensor: torch.Tensor) -> Block:
    return tuple(global_offset(tensor)), tuple(local_tensor(tensor).shape)


def _slices(block: Block) -> Tuple[slice, ...]:
    offset, shape = block
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _numel(block: Block) -> int:
    n = 1
    for size in block[1]:
        n *= size
    return n


@dataclass
class _Bucket:
    """Tensors of one mesh, each with its owner (a rank of the mesh's group) and every rank's part."""
    indices: List[int]          # positions in the caller's list
    owners: List[int]           # group rank owning each
    blocks: List[List[Block]]   # [group rank][tensor in bucket]
    senders: List[List[bool]]   # [group rank][tensor in bucket]: this rank sends its part to the owner


class WholeOnOwners:
    """The layout of `tensors` (parameters: DTensors or plain tensors) for `apply`. Plain tensors
    and DTensors whose mesh is one rank are computed where they are. `group_of(mesh)` gives the
    process group over all of a DTensor mesh's ranks (flattened where it has several dims)."""

    def __init__(self, tensors: Sequence[torch.Tensor], group_of: Callable, bucket_bytes: int):
        self.shapes = [tuple(t.shape) for t in tensors]
        self.local = [i for i, t in enumerate(tensors) if not is_dtensor(t) or t.device_mesh.size() == 1]
        by_mesh: Dict[object, List[int]] = {}
        for i, t in enumerate(tensors):
            if i not in self.local:
                by_mesh.setdefault(t.device_mesh, []).append(i)
        self.buckets: List[Tuple[object, _Bucket]] = []
        for mesh, indices in by_mesh.items():
            group = group_of(mesh)
            size = dist.get_world_size(group)
            mine = [_block(tensors[i]) for i in indices]
            everyone: List[List[Block]] = [None] * size  # type: ignore[list-item]
            dist.all_gather_object(everyone, mine, group=group)
            start = 0
            for chunk in _chunks(indices, [tensors[i].numel() * tensors[i].element_size() for i in indices],
                                 bucket_bytes):
                span = range(start, start + len(chunk))
                owners = [(start + k) % size for k in range(len(chunk))]
                blocks = [[everyone[r][j] for j in span] for r in range(size)]
                senders = [[_numel(blocks[r][k]) > 0 and all(blocks[q][k] != blocks[r][k] for q in range(r))
                            for k in range(len(chunk))] for r in range(size)]
                self.buckets.append((group, _Bucket(chunk, owners, blocks, senders)))
                start += len(chunk)

    def apply(self, parts: Sequence[torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor],
              dtype: torch.dtype) -> List[torch.Tensor]:
        """fn of each whole tensor, each rank's part of it: `parts` are this rank's parts (local
        tensors, in the layout's order), sent as `dtype`, and fn's results come back in it."""
        out: List[torch.Tensor] = [None] * len(parts)  # type: ignore[list-item]
        for i in self.local:
            out[i] = fn(parts[i].to(dtype)).to(dtype)
        for group, bucket in self.buckets:
            for i, part in zip(bucket.indices, self._exchange(group, bucket, parts, fn, dtype)):
                out[i] = part
        return out

    def _exchange(self, group, bucket: _Bucket, parts, fn, dtype) -> List[torch.Tensor]:
        me, size = dist.get_rank(group), dist.get_world_size(group)
        device = parts[bucket.indices[0]].device
        n = len(bucket.indices)
        # out: my parts, each to its owner (once per distinct part)
        sends = [[parts[bucket.indices[k]].to(dtype).flatten() for k in range(n)
                  if bucket.owners[k] == owner and bucket.senders[me][k]] for owner in range(size)]
        mine = [k for k in range(n) if bucket.owners[k] == me]
        receive = [[k for k in mine if bucket.senders[r][k]] for r in range(size)]
        gathered = _all_to_all(sends, [sum(_numel(bucket.blocks[r][k]) for k in receive[r]) for r in range(size)],
                               group, device, dtype)
        wholes = {k: torch.empty(self.shapes[bucket.indices[k]], dtype=dtype, device=device) for k in mine}
        for r in range(size):
            pieces = gathered[r].split([_numel(bucket.blocks[r][k]) for k in receive[r]])
            for k, piece in zip(receive[r], pieces):
                wholes[k][_slices(bucket.blocks[r][k])] = piece.view(bucket.blocks[r][k][1])
        results = {k: fn(wholes[k]).to(dtype) for k in mine}
        # back: each rank's part of what I computed
        replies = [[results[k][_slices(bucket.blocks[r][k])].flatten() for k in mine] for r in range(size)]
        answers = _all_to_all(replies, [sum(_numel(bucket.blocks[me][k]) for k in range(n) if bucket.owners[k] == r)
                                        for r in range(size)], group, device, dtype)
        back: List[torch.Tensor] = [None] * n  # type: ignore[list-item]
        for r in range(size):
            ks = [k for k in range(n) if bucket.owners[k] == r]
            for k, piece in zip(ks, answers[r].split([_numel(bucket.blocks[me][k]) for k in ks])):
                back[k] = piece.view(bucket.blocks[me][k][1])
        return back


def _all_to_all(sends: List[List[torch.Tensor]], receive_sizes: List[int], group, device,
                dtype: torch.dtype) -> List[torch.Tensor]:
    """One all_to_all_single: sends[r] (tensors) to rank r; what each rank sent me, by rank."""
    flat = [torch.cat(s) if s else torch.empty(0, dtype=dtype, device=device) for s in sends]
    output = torch.empty(sum(receive_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(output, torch.cat(flat).to(dtype), receive_sizes, [f.numel() for f in flat], group=group)
    return list(output.split(receive_sizes))


def _chunks(indices: List[int], sizes: List[int], limit: int) -> List[List[int]]:
    """Consecutive runs of indices, each at most `limit` bytes (a larger tensor alone)."""
    chunks: List[List[int]] = [[]]
    total = 0
    for i, size in zip(indices, sizes):
        if chunks[-1] and total + size > limit:
            chunks.append([])
            total = 0
        chunks[-1].append(i)
        total += size
    return chunks
