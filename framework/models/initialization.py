"""The framework's own Transformer's starting weights, declared once (torchtitan's llama3 and
deepseek_v3 `param_init`): every matrix truncated normal of std 0.02, those that write into
the residual stream (wo, w2, w3) and the router scaled by the depth of their block, the
embedding of std 1, norms one, biases zero. The output projection: truncated normal cut at 3
std, of std 0.5 * dim**-0.5 where torchtitan draws dim**-0.5. The final norm makes every
hidden state of rms 1, so logits start with the std of that draw times sqrt(dim), and the first
loss at about ln V + std**2 / 2: torchtitan's logit std of 1 starts at ln V + 0.5 (measured
9.56 for ln V = 9.01 at dim 2048), ours of 0.5 at ln V + 0.13.

Tied, the embedding is the output projection and keeps its draw (torchtitan skips the
embedding's init when tied): drawn N(0, 1) it made logits of std ~sqrt(dim), a first loss of
1,868 for a Llama-3.2-1B shape (ln V = 11.76). The model is built whole and seeded on every rank before any
parallel stage (framework.models.lifecycle), so every mesh and plan starts from these weights.
"""
import torch
from torch import nn

BASE_STD = 0.02
LOGIT_STD = 0.5  # the logits' std at the start (see above)
# A block's matrices drawn with the depth-scaled std (named by the last part of their name).
DEPTH_SCALED = ("wo", "w2", "w3", "gate")


def depth_scaled_std(layer: int) -> float:
    """torchtitan's depth_scaled_std: block `layer`'s (0-based) writers into the residual stream
    get smaller weights the deeper they are, so the stream's variance grows slowly with depth."""
    return BASE_STD / (2 * (layer + 1)) ** 0.5


def _kind(name: str) -> str:
    """The module a parameter belongs to: `feed_forward.experts.w2` -> w2, `attention.wo.weight` -> wo."""
    parts = name.split(".")
    return parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]


@torch.no_grad()
def init_block(block: nn.Module, layer: int) -> None:
    """Block `layer`'s parameters: attention, SwiGLU or mixture of experts (stacked experts,
    router, shared expert and its gate) alike, by name."""
    for name, param in block.named_parameters():
        kind = _kind(name)
        if name.endswith("bias"):
            nn.init.zeros_(param)
        elif kind.endswith("norm"):
            nn.init.ones_(param)
        else:
            nn.init.trunc_normal_(param, std=depth_scaled_std(layer) if kind in DEPTH_SCALED else BASE_STD)


@torch.no_grad()
def init_transformer(model: nn.Module) -> None:
    """Every parameter of a framework.models.Transformer (its blocks in `model.layers`)."""
    for layer, block in enumerate(model.layers):
        init_block(block, layer)
    nn.init.ones_(model.norm.weight)
    std = LOGIT_STD * model.dim ** -0.5
    nn.init.trunc_normal_(model.output.weight, std=std, a=-3 * std, b=3 * std)
    if not model.tie_word_embeddings:  # (tied, it is the output projection just drawn)
        nn.init.normal_(model.tok_embeddings.weight, std=1.0)
