"""A decoder-only transformer LM laid out for Megatron-style TP (names as in torchtitan).

tok_embeddings -> N x [attention_norm -> attention(wq, wk, wv, wo) -> ffn_norm ->
feed_forward(w1, w2, w3: SwiGLU)] -> norm -> output. Attention rotates by the
positions of the full sequence inside the block (from a cos / sin table per position the model
makes before its blocks run), so the plans can shard the residual stream on the sequence
(sequence parallel) without any position bookkeeping.

Under TP, wq/wk/wv are colwise: each rank holds n_heads / TP whole heads, which is why the
reshapes below infer the head count (-1) from the local tensor instead of reading n_heads.
"""
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from framework.models.protocol import ModelProtocol
from framework.config.errors import ConfigError
from framework.models.documents import AttentionLayout, attend, attention_layout, gather_keys
from framework.models.initialization import init_transformer
from framework.models.moe import (MoE, count_step_load, load_balance_loss, loads_uncounted, moe_blocks,
                                  routing_metrics, update_expert_biases)


def rotary_frequencies(head_dim: int, theta: float, scaling: Optional[Dict[str, Any]] = None,
                       device: Any = "cpu") -> torch.Tensor:
    """The angle per position of each channel pair (head_dim / 2 of them), in fp32; `scaling`
    as Llama 3's rope_scaling (rope_type llama3): long wavelengths slowed by `factor`, short ones
    kept, the band between blended (as transformers computes it)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if not scaling:
        return freqs
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / freqs
    scaled = torch.where(wavelength > context / low, freqs / factor, freqs)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(medium, blended, scaled)


def rotation(freqs: torch.Tensor, start: int, length: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles of positions start .. start + length - 1, each (length, head_dim/2)."""
    positions = torch.arange(start, start + length, device=freqs.device, dtype=torch.float32)
    angles = torch.outer(positions, freqs)
    return angles.cos(), angles.sin()


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, halves: bool = False) -> torch.Tensor:
    """Rotate pairs of channels of x (batch, seq, heads, head_dim) by the angles whose cos and sin
    (seq, head_dim/2), or per sequence (batch, seq, head_dim/2), are given. Pairs are (2i, 2i+1),
    or with `halves` (i, i + head_dim/2), Hugging Face's layout, whose checkpoints' q/k weights
    are ordered for it."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # over the heads (and, if not per sequence, the batch)
    if halves:
        first, second = x.float().chunk(2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).type_as(x)
    even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


@dataclass
class Rope:
    """How queries and keys are rotated: the frequencies' definition and the pair layout, and a
    table of cos / sin per position that the model's (eager) forward makes before its blocks run.
    A compiled block reads its rows; computing them inside it instead, inductor fuses them into
    the rotation's elementwise kernel and recomputes a sin and a cos per element (batch x heads
    times over): 6.8% of a compiled 1x2 step's CPU on lm_small (bench/README.md). Under pipeline
    parallelism the schedule's caller makes it from the step's tokens on every stage's rank
    (framework.parallel.pipeline); positions beyond the table are computed in place."""
    theta: float = 10000.0
    scaling: Optional[Dict[str, Any]] = None
    halves: bool = False
    table: Optional[Tuple[torch.Tensor, torch.Tensor]] = field(default=None, repr=False, compare=False)

    def freqs(self, head_dim: int, device: Any) -> torch.Tensor:
        return rotary_frequencies(head_dim, self.theta, self.scaling, device)

    def _covers(self, positions: int, device: torch.device) -> bool:
        return self.table is not None and len(self.table[0]) >= positions and self.table[0].device == device

    def prepare(self, head_dim: int, positions: int, device: torch.device) -> None:
        """The table for at least `positions` positions on `device` (grown by doubling: decoding
        adds one position at a time)."""
        if not self._covers(positions, device):
            self.table = rotation(self.freqs(head_dim, device), 0, 1 << max(0, positions - 1).bit_length())

    def cos_sin(self, head_dim: int, start: int, length: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._covers(start + length, device):
            return self.table[0][start:start + length], self.table[1][start:start + length]
        return rotation(self.freqs(head_dim, device), start, length)


@torch.fx.wrap  # a call, not traced into: framework.parallel.plan's symbolic trace of the model has no shapes
def _prepare_rotation(rope: Rope, head_dim: int, tokens: torch.Tensor) -> None:
    rope.prepare(head_dim, tokens.shape[1], tokens.device)


class Attention(nn.Module):
    """Multi-head attention with grouped-query heads (n_kv_heads <= n_heads; each key/value head
    serves n_heads / n_kv_heads query heads), optional q/k/v bias (Qwen2) and per-head RMSNorm
    of queries and keys before the rotation (Qwen3)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, rope: "Rope",
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool = False, norm_eps: Optional[float] = None):
        super().__init__()
        self.head_dim, self.rope = head_dim, rope
        self.context_parallel = None  # framework.parallel.context_parallel: whose keys and values join ours
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=qkv_bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=o_bias)
        if qk_norm:
            self.q_norm = nn.RMSNorm(head_dim, eps=norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=norm_eps)

    def forward(self, x: torch.Tensor, cache=None,
                layout: Optional[AttentionLayout] = None) -> torch.Tensor:
        """`layout`: document-masked attention (and, under context parallelism, keys and values
        from every CP rank, framework.parallel.context_parallel); None: causal over the window."""
        batch, seq = x.shape[0], x.shape[1]
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rope.cos_sin(self.head_dim, 0, seq, x.device) if layout is None else (layout.cos, layout.sin)
        q, k = (rotary(t, cos, sin, self.rope.halves) for t in (q, k))
        mask = None if layout is None else layout.mask
        if cache is not None:  # decoding: the cache made the layout (framework.models.decode.StaticCache.layout)
            k, v = cache.extend(k, v)
        elif layout is not None:
            k, v = gather_keys(self, k), gather_keys(self, v)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
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
    """Attention, then the feed-forward: SwiGLU, or with `moe` (framework.models.moe.MoE's
    arguments) a mixture of experts."""

    def __init__(self, dim: int, hidden_dim: int, norm_eps: Optional[float], moe: Optional[Dict[str, Any]] = None,
                 **attention: Any):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.attention = Attention(dim, norm_eps=norm_eps, **attention)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        if moe:
            moe = dict(moe)
            shared = moe.pop("shared_hidden_dim", None)
            self.feed_forward = MoE(dim, **moe, shared_expert=FeedForward(dim, shared) if shared else None)
        else:
            self.feed_forward = FeedForward(dim, hidden_dim)

    def forward(self, x: torch.Tensor, cache=None,
                layout: Optional[AttentionLayout] = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cache=cache, layout=layout)
        return x + self.feed_forward(self.ffn_norm(x))


def _sparse_layers(moe: Dict[str, Any], n_layers: int):
    """The blocks that are mixtures of experts (model.moe.layers, popped from `moe`: null for all)
    and the load-balancing loss's coefficient (popped too), checked."""
    layers = moe.pop("layers", None)
    if moe and layers is not None and not layers:
        raise ConfigError("model.moe.layers", list(layers), "names no block, so the model would be dense; name "
                                                            "some blocks, null for all, or model.moe=null")
    sparse = set(range(n_layers) if layers is None else layers) if moe else set()
    if not sparse <= set(range(n_layers)):
        raise ConfigError("model.moe.layers", layers, f"name blocks 0 to {n_layers - 1} (model.n_layers={n_layers}), "
                                                      f"or null for all")
    aux_loss_coef = moe.pop("aux_loss_coef", 0.0)
    if aux_loss_coef < 0:
        raise ConfigError("model.moe.aux_loss_coef", aux_loss_coef, "must be >= 0 (0: the load-balancing loss "
                                                                    "reported, not trained)")
    return sparse, aux_loss_coef


class Transformer(ModelProtocol, nn.Module):
    """The defaults are the framework's own LMs; framework.models.hf sets the rest from a
    Hugging Face config.json (Llama, Mistral, Qwen2, Qwen3, and their mixtures of experts).

    `moe`: the blocks' feed-forward is a mixture of experts (framework.models.moe.MoE's arguments
    n_experts, top_k, hidden_dim, norm_topk_prob, shared_hidden_dim, shared_gate, plus `layers`:
    which blocks, null for all, `aux_loss_coef` and `bias_update_rate`); the model then reports
    the `load_balance` term, weighted by aux_loss_coef unless objective.aux_coefficients.load_balance
    is given."""

    def __init__(self, vocab_size: int = 256, dim: int = 64, n_layers: int = 2, n_heads: int = 4,
                 hidden_dim: int = 128, activation_checkpointing: str = "none", n_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, norm_eps: Optional[float] = None, rope_theta: float = 10000.0,
                 rope_scaling: Optional[Dict[str, Any]] = None, rope_halves: bool = False, qkv_bias: bool = False,
                 o_bias: bool = False, qk_norm: bool = False, tie_word_embeddings: bool = False,
                 moe: Optional[Dict[str, Any]] = None):
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if head_dim is None and dim % n_heads:
            raise ConfigError("model.dim", dim, f"must be a multiple of model.n_heads={n_heads} (heads of equal size)")
        if n_heads % n_kv_heads:
            raise ConfigError("model.n_kv_heads", n_kv_heads, f"must divide model.n_heads={n_heads} (each key/value "
                                                              f"head serves the same number of query heads)")
        if activation_checkpointing not in ("none", "full"):
            raise ConfigError("model.activation_checkpointing", activation_checkpointing,
                              "use none, or full to recompute every block's activations in backward")
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.recompute_blocks = activation_checkpointing == "full"
        self.head_dim = head_dim = head_dim or dim // n_heads
        self.rope = rope = Rope(rope_theta, rope_scaling, rope_halves)  # one for all blocks: they share its table
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        moe = dict(moe or {})
        sparse, aux_loss_coef = _sparse_layers(moe, n_layers)
        self.layers = nn.ModuleList(
            TransformerBlock(dim, hidden_dim, norm_eps, moe=moe if i in sparse else None, n_heads=n_heads,
                             n_kv_heads=n_kv_heads, head_dim=head_dim, rope=rope, qkv_bias=qkv_bias, o_bias=o_bias,
                             qk_norm=qk_norm)
            for i in range(n_layers))
        self.sparse_layers = sorted(sparse)
        if sparse:
            self.auxiliary_losses: Dict[str, torch.Tensor] = {}  # framework.training.objectives reads it
            self.aux_coefficients = {"load_balance": aux_loss_coef}  # (objective.aux_coefficients wins)
            self.token_group = None  # the ranks holding other tokens, whose routing pools with ours
        self.norm = nn.RMSNorm(dim, eps=norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.tie_word_embeddings = tie_word_embeddings
        self.tie_weights()
        self.context_parallel = None  # framework.parallel.context_parallel: the CP ranks sharing each sequence
        self.dim, self.n_layers = dim, n_layers
        self.matmul_params = self._count_matmul_params()
        if not self.output.weight.is_meta:  # (on meta: drawn once sharded, framework.models.lifecycle.allocate)
            self.init_weights(torch.initial_seed())

    def _count_matmul_params(self) -> int:
        """The parameters a token multiplies by (its FLOPs): the 2-D ones but the embedding's."""
        count = sum(p.numel() for name, p in self.named_parameters()
                    if p.dim() == 2 and not name.startswith("tok_embeddings"))
        if self.tie_word_embeddings:  # the shared output projection is a matmul too (named once, as the embedding)
            count += self.output.weight.numel()
        for block in moe_blocks(self):  # a token runs top_k of the stacked experts' matmuls
            count += block.top_k * sum(w[0].numel() for w in block.experts.local_weights())
        return count

    def init_weights(self, seed: int) -> None:
        """The declared starting weights (framework.models.initialization), the same on every layout."""
        init_transformer(self, seed)

    supports_context_parallel = True
    declares_init = True

    def output_layer(self) -> nn.Module:
        return self.output

    def input_embeddings(self) -> nn.Module:
        return self.tok_embeddings

    def use_context_parallel(self, cp: Any) -> None:
        """The model (which makes the attention masks) and every attention take `cp`'s chunks."""
        for module in [self, *(m for m in self.modules() if isinstance(m, Attention))]:
            module.context_parallel = cp

    def tie_weights(self) -> None:
        """With tie_word_embeddings the output projection is the embedding matrix itself (again
        after TP replaced both with shards of the same layout)."""
        if self.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def run_blocks(self, blocks: Iterable[nn.Module], h: torch.Tensor,
                   layout: Optional[AttentionLayout] = None) -> torch.Tensor:
        """h through `blocks` in order (a pipeline stage runs its own run of them). Activation
        checkpointing keeps only each block's input and recomputes the rest in backward (its TP
        collectives included, in the same order on every rank). In training, the MoE blocks'
        routing of this forward adds to their load (once, outside any recompute)."""
        blocks = list(blocks)
        for block in blocks:
            if self.recompute_blocks and torch.is_grad_enabled():
                h = checkpoint(block, h, layout=layout, use_reentrant=False)
            else:
                h = block(h, layout=layout)
        if self.sparse_layers and torch.is_grad_enabled():
            count_step_load([block.feed_forward for block in blocks if isinstance(block.feed_forward, MoE)])
        return h

    def attention_layout(self, positions: Optional[torch.Tensor], hidden: torch.Tensor) -> Optional[AttentionLayout]:
        """The blocks' AttentionLayout for tokens at `positions` (each token's place in its own
        document; None: one causal window, the rotation table's path), `hidden` their input."""
        return None if positions is None else attention_layout(self.rope.freqs(self.head_dim, positions.device),
                                                               positions, hidden, self.context_parallel)

    def prepare_rotation(self, tokens: torch.Tensor) -> None:
        """The rotation table for these tokens' positions, before the blocks run."""
        _prepare_rotation(self.rope, self.head_dim, tokens)

    def forward(self, tokens: torch.Tensor, cache: Optional[list] = None,
                positions: Optional[torch.Tensor] = None, skip_output: bool = False) -> torch.Tensor:
        """`positions` (batch, seq): each token's place in its document, for packed windows of
        several documents (framework.models.documents); None: one causal window. `skip_output`:
        the final norm's hidden states, for the loss that owns the output layer (output_layer) to
        score (at the positions it counts, by chunks: framework.training.objectives.head) or the
        decoder to project at each row's last position."""
        self.prepare_rotation(tokens)
        h = self.tok_embeddings(tokens)
        if cache is None:
            h = self.run_blocks(self.layers, h, self.attention_layout(positions, h))
        else:  # decoding (framework.models.decode): each block extends its layer's cache, whose layout it is
            layout = cache[0].layout(self.rope, self.head_dim, tokens, h)
            for layer, layer_cache in zip(self.layers, cache):
                h = layer(h, layer_cache, layout)
        if self.sparse_layers and torch.is_grad_enabled():  # training: evaluation and decoding need no term
            self.auxiliary_losses = {"load_balance": load_balance_loss(moe_blocks(self), self.token_group)}
        h = self.norm(h)
        return h if skip_output else self.output(h)

    def logged_metrics(self) -> Dict[str, float]:
        """What TensorBoard shows of the model at a logging step (every rank calls it): the experts'
        load and bias per MoE layer this rank holds, by its index in the model (a pipeline stage
        holds some; framework.models.moe.routing_metrics); none for a dense model."""
        if not self.sparse_layers:
            return {}
        held = {int(index): layer.feed_forward for index, layer in self.layers.named_children()
                if isinstance(layer.feed_forward, MoE)}
        return routing_metrics(held, self.token_group)

    def held_blocks(self) -> List[nn.Module]:
        """The blocks this rank holds: all, or on a pipeline rank its stages' (a ModuleDict)."""
        return list(self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers)

    def fsdp_units(self) -> List[nn.Module]:
        """Each block (as torchtitan shards them); the root holds the embedding, norm and output."""
        return self.held_blocks()

    def compile_units(self) -> List[Tuple[nn.Module, bool]]:
        """Each block; a mixture of experts routes a data-dependent number of tokens to each expert,
        so its block compiles in pieces around that (graph breaks), a dense block as one graph."""
        return [(block, not moe_blocks(block)) for block in self.held_blocks()]

    def expert_modules(self) -> List[nn.Module]:
        return [block.experts for block in moe_blocks(self)]

    def use_expert_parallel(self, token_group: Any, dispatch: Optional[Callable]) -> None:
        self.token_group = token_group
        if dispatch is not None:
            for block in moe_blocks(self):
                block.dispatch = dispatch

    def optimizer_step_hook(self) -> Optional[Callable[[], None]]:
        """The expert biases moved by the step's global load; none without biased experts."""
        biased = [block for block in moe_blocks(self) if block.bias_update_rate is not None]
        return (lambda: update_expert_biases(biased, self.token_group)) if biased else None

    def uncounted_forwards(self) -> ContextManager[None]:
        return loads_uncounted(moe_blocks(self))

    def tp_sharded_counts(self) -> Dict[str, int]:
        """Counts a TP plan splits whole across ranks (checked by framework.validate)."""
        return {"model.n_heads": self.n_heads, "model.n_kv_heads": self.n_kv_heads}

    def tp_plan_must_cover(self) -> Dict[str, str]:
        """Modules a TP plan must name, and why (checked by framework.validate)."""
        if not any(hasattr(layer.attention, "q_norm") for layer in self.modules() if isinstance(layer, TransformerBlock)):
            return {}
        why = ("the per-head q/k norms see only a rank's own heads under TP, so each rank's weight gradient is "
               "partial; plan=qk_norm_tp_sp makes them replicated DTensors whose gradients TP sums")
        return {f"{name}.attention.{norm}": why for name, block in self.named_modules() if isinstance(block, TransformerBlock)
                for norm in ("q_norm", "k_norm")}

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, as PaLM (appendix B) counts them: 6 per matmul weight
        (forward 2, backward 4) plus 12 * layers * dim * seq for attention scores and values
        over the full sequence. The embedding lookup is not a matmul and is left out. The whole
        model's, counted at construction (a pipeline stage keeps only its own modules)."""
        return 6 * self.matmul_params + 12 * self.n_layers * self.dim * seq_len
