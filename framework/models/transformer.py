"""A decoder-only transformer LM laid out for Megatron-style TP (names as in torchtitan).

tok_embeddings -> N x [attention_norm -> attention(wq, wk, wv, wo) -> ffn_norm ->
feed_forward(w1, w2, w3: SwiGLU)] -> norm -> output. Attention uses rotary position
embeddings computed from the full sequence inside the block, so the plans can shard the
residual stream on the sequence (sequence parallel) without any position bookkeeping.

Under TP, wq/wk/wv are colwise: each rank holds n_heads / TP whole heads, which is why the
reshapes below infer the head count (-1) from the local tensor instead of reading n_heads.
"""
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from framework.config.errors import ConfigError


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (batch, seq, heads, head_dim) by position-dependent angles."""
    seq, head_dim = x.shape[1], x.shape[-1]
    freqs = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), freqs)  # (seq, head_dim/2)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = rotary(q), rotary(k)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden_dim: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, vocab_size: int = 256, dim: int = 64, n_layers: int = 2, n_heads: int = 4,
                 hidden_dim: int = 128, activation_checkpointing: str = "none"):
        super().__init__()
        if dim % n_heads:
            raise ConfigError("model.dim", dim, f"must be a multiple of model.n_heads={n_heads} (heads of equal size)")
        if activation_checkpointing not in ("none", "full"):
            raise ConfigError("model.activation_checkpointing", activation_checkpointing,
                              "use none, or full to recompute every block's activations in backward")
        self.n_heads = n_heads
        self.recompute_blocks = activation_checkpointing == "full"
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_heads, hidden_dim) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            # Activation checkpointing keeps only each block's input and recomputes the rest in
            # backward (its TP collectives included, in the same order on every rank).
            h = checkpoint(layer, h, use_reentrant=False) if self.recompute_blocks and torch.is_grad_enabled() else layer(h)
        return self.output(self.norm(h))

    def tp_sharded_counts(self) -> Dict[str, int]:
        """Counts a TP plan splits whole across ranks (checked by framework.config.validate)."""
        return {"model.n_heads": self.n_heads}

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, as PaLM (appendix B) counts them: 6 per matmul weight
        (forward 2, backward 4) plus 12 * layers * dim * seq for attention scores and values
        over the full sequence. The embedding lookup is not a matmul and is left out."""
        matmul_params = sum(p.numel() for name, p in self.named_parameters()
                            if p.dim() == 2 and not name.startswith("tok_embeddings"))
        dim = self.tok_embeddings.embedding_dim
        return 6 * matmul_params + 12 * len(self.layers) * dim * seq_len


class NextTokenLoss(nn.Module):
    """Cross entropy of logits (batch, seq, vocab) against targets (batch, seq); targets of -100
    (instruction data's prompt and padding) are ignored. `reduction="sum"` is how the Trainer
    averages masked data over the whole global batch's counted tokens."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1), reduction=reduction)

