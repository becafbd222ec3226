"""Document-masked attention for windows packed with several documents (torchtitan's
block-causal attention): a token attends to the earlier tokens of its own document only, and its
rotary angle counts from its document's first token.

Everything follows from one tensor per batch, `positions` (batch, seq): each token's place in
its document (0 where a document starts; framework.data.datasets makes it from doc_offsets.npy).
A token at sequence index i with position p belongs to the document that starts at i - p: two
tokens share a document when those starts are equal, which holds even when the sequence is
split over context-parallel ranks (framework.parallel.context_parallel), each rank holding
chunks of it.

On CUDA the mask is FlexAttention's block mask, whose kernel skips the blocks no query sees
(written, not yet run on a GPU: its forward is tested on CPU against the dense path). On CPU
the mask goes to scaled_dot_product_attention as an additive (batch, 1, queries, keys) tensor, 0 where a key is seen and -inf where not, made once per forward in the dtype attention
computes in: a boolean mask is converted to that inside every attention call and the copy kept
for backward (measured: 128 MiB per layer at 2 x 4096 tokens, bench/README.md). FlexAttention
has no backward on CPU in torch 2.13.
"""
import functools
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F


class AttentionLayout(NamedTuple):
    """Where a batch's tokens sit, for attention: the cos and sin of each token's rotary angles
    (batch, seq, head_dim/2) and which keys each query sees (batch, 1, seq, keys; 0 or -inf), or
    FlexAttention's BlockMask of the same. Made once per forward and handed to every block."""
    cos: torch.Tensor
    sin: torch.Tensor
    mask: Any


def attention_layout(freqs: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                     context_parallel=None, flex: Optional[bool] = None) -> AttentionLayout:
    """The layout of tokens at `positions`, its mask in the dtype attention will compute in on
    `hidden` (the blocks' input: autocast's dtype when autocast is on). Under context
    parallelism the tokens are this rank's chunks of each sequence and the keys every CP rank's
    (in the order their all-gather stacks them), so a query's index and its keys' are their
    places in the whole sequence. `flex`: a FlexAttention block mask (None: on CUDA)."""
    seq = positions.shape[1]
    if context_parallel is None:
        index = key_index = torch.arange(seq, device=positions.device)
    else:
        index, key_index = context_parallel.query_and_key_indices(seq, positions.device)
    starts = index - positions  # where each token's document starts in the sequence
    key_starts = starts if context_parallel is None else context_parallel.gather_starts(starts)
    angles = positions.float()[..., None] * freqs
    if flex if flex is not None else hidden.device.type == "cuda":
        return AttentionLayout(angles.cos(), angles.sin(), block_mask(starts, key_starts, index, key_index))
    seen = (starts[:, :, None] == key_starts[:, None, :]) & (index[:, None] >= key_index[None, :])
    return AttentionLayout(angles.cos(), angles.sin(), additive_mask(seen, hidden)[:, None])


def additive_mask(seen: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """`seen` (which keys each query sees) as SDPA's additive mask, 0 or -inf, in the dtype
    attention computes in on `hidden` (autocast's when autocast is on)."""
    device = hidden.device.type
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)  # (not on meta)
    dtype = torch.get_autocast_dtype(device) if autocast else hidden.dtype
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))


def block_mask(starts: torch.Tensor, key_starts: torch.Tensor, index: torch.Tensor, key_index: torch.Tensor):
    """The same mask as FlexAttention's BlockMask: query q sees key k when they share a document
    and k is not after q."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q, k):
        return (starts[b, q] == key_starts[b, k]) & (index[q] >= key_index[k])

    # Compiled on CUDA, as torchtitan builds its masks: eager, create_block_mask evaluates the mask
    # over every (query, key) pair through vmap, a dense pass per forward that costs more than the
    # attention it saves; compiled, one fused kernel per block row. (Not on CPU: there only the
    # forward runs, in tests, and an inductor compile there costs seconds.)
    return create_block_mask(same_document_causal, starts.shape[0], None, starts.shape[1], key_starts.shape[1],
                             device=starts.device, _compile=starts.device.type == "cuda")


@functools.cache
def flex_attention(compiled: bool):
    """torch's flex_attention, compiled where its kernel is meant to run (eager, it is a slow
    reference; on CPU only its forward works in torch 2.13)."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    return torch.compile(flex) if compiled else flex


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
    """Attention of q (batch, heads, seq, head_dim) over k and v (grouped-query heads allowed):
    causal with no mask, masked by a dense mask (SDPA) or a BlockMask (FlexAttention)."""
    gqa = k.shape[1] != q.shape[1]
    if mask is not None and not isinstance(mask, torch.Tensor):
        return flex_attention(q.is_cuda)(q, k, v, block_mask=mask, enable_gqa=gqa)
    if type(q) is torch.Tensor and q.is_meta:  # (a torch.fx Proxy: not here)
        return _FusedOnMeta.apply(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)


class _FusedOnMeta(torch.autograd.Function):
    """Attention in framework.dryrun, saving for backward what the fused kernels of real runs
    save (CPU flash, CUDA flash / memory-efficient, FlexAttention): q, k and v (grouped-query
    ones not repeated), the output, the log-sum-exp, and a dense mask when there is one (made
    once per forward, shared by every block). On meta SDPA takes its math path, which saves the
    attention weights (batch x heads x seq x seq) instead (lm_small 1x1: 121.1 MiB counted with
    it, 89.4 without; Llama 3 8B on TP 8 at 8192 tokens: 110.1 GiB, 44.7 without). Shapes only:
    its backward returns gradients of the right shapes, on meta."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        repeat = q.shape[1] // k.shape[1]
        wide_k, wide_v = (t.repeat_interleave(repeat, dim=1) for t in (k, v))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, wide_k, wide_v, 0.0, mask is None,
                                                                               attn_mask=mask)
        ctx.save_for_backward(q, k, v, out, lse, *([] if mask is None else [mask]))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def gather_keys(attention, keys: torch.Tensor) -> torch.Tensor:
    """An attention's keys (or values) for the layout's key axis: its own, or under context
    parallelism every CP rank's."""
    cp = attention.context_parallel
    return keys if cp is None else cp.gather_keys(keys)

