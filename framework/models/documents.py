"""Document-masked attention for windows packed with several documents (torchtitan's
block-causal attention): a token attends to the earlier tokens of its own document only, and its
rotary angle counts from its document's first token.

Everything follows from one tensor per batch, `positions` (batch, seq): each token's place in
its document (0 where a document starts; framework.data.tokens makes it from doc_offsets.npy).
A token at sequence index i with position p belongs to the document that starts at i - p: two
tokens share a document when those starts are equal, which holds even when the sequence is
split over context-parallel ranks (framework.parallel.context_parallel), each rank holding
chunks of it.

On CPU the mask goes to scaled_dot_product_attention as an additive (batch, 1, queries, keys)
tensor, 0 where a key is seen and -inf where not, made once per forward in the dtype attention
computes in: a boolean mask is converted to that inside every attention call and the copy kept
for backward (measured: 128 MiB per layer at 2 x 4096 tokens, bench/README.md). FlexAttention
has no backward on CPU in torch 2.13.
"""
from typing import NamedTuple, Optional

import torch


class AttentionLayout(NamedTuple):
    """Where a batch's tokens sit, for attention: the cos and sin of each token's rotary angles
    (batch, seq, head_dim/2) and which keys each query sees (batch, 1, seq, keys; 0 or -inf).
    Made once per forward and handed to every block."""
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor


def attention_layout(freqs: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                     context_parallel=None) -> AttentionLayout:
    """The layout of tokens at `positions`, its mask in the dtype attention will compute in on
    `hidden` (the blocks' input: autocast's dtype when autocast is on). Under context
    parallelism the tokens are this rank's chunks of each sequence and the keys every CP rank's
    (in the order their all-gather stacks them), so a query's index and its keys' are their
    places in the whole sequence."""
    seq = positions.shape[1]
    if context_parallel is None:
        index = key_index = torch.arange(seq, device=positions.device)
    else:
        index, key_index = context_parallel.query_and_key_indices(seq, positions.device)
    starts = index - positions  # where each token's document starts in the sequence
    key_starts = starts if context_parallel is None else context_parallel.gather_starts(starts)
    seen = (starts[:, :, None] == key_starts[:, None, :]) & (index[:, None] >= key_index[None, :])
    device = hidden.device.type
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)  # (not on meta)
    dtype = torch.get_autocast_dtype(device) if autocast else hidden.dtype
    mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))
    angles = positions.float()[..., None] * freqs
    return AttentionLayout(angles.cos(), angles.sin(), mask[:, None])


def gather_keys(attention, keys: torch.Tensor) -> torch.Tensor:
    """An attention's keys (or values) for the layout's key axis: its own, or under context
    parallelism every CP rank's."""
    cp = attention.context_parallel
    return keys if cp is None else cp.gather_keys(keys)

