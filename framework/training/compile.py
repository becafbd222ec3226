"""`trainer.compile: blocks`: torch.compile of each of the model's repeated blocks (its `layers`,
as torchtitan compiles them), after TP and before FSDP2 wraps them.

Per block, not the whole model: the blocks are one graph compiled once and reused, and DTensor's
per-op dispatch, most of a small TP step on CPU, is traced away inside each. Only each block's
`forward` is compiled, so its hooks (FSDP2's, and the one below) stay eager and parameter names
(checkpoints, exports, plans) keep no `_orig_mod.` prefix: a checkpoint saved compiled resumes
eager and back.
"""
from typing import List

import torch
from torch import nn

from framework.config.errors import ConfigError
from framework.models.moe import moe_blocks


def compiled_blocks(model: nn.Module) -> List[nn.Module]:
    """The model's repeated blocks (a ModuleDict of this rank's ones under pipeline parallelism),
    or a config error naming what compile needs."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleList, nn.ModuleDict)) or len(layers) == 0:
        raise ConfigError("trainer.compile", "blocks", f"{type(model).__name__} has no `layers` ModuleList of "
                          "repeated blocks to compile; use trainer.compile=none")
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


def _wait_for_inputs(module: nn.Module, args: tuple) -> tuple:
    """Inputs whose collective is still in flight (TP's async redistribute of the embedding's
    output) as plain results: torch 2.13's compiled backward otherwise hands the redistribute a
    plain gradient where it expects a DTensor. A copy, only for such inputs. (Imported here:
    validation imports this module, and the launcher must not load DTensor.)"""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    def waited(value):
        local = value._local_tensor if isinstance(value, DTensor) else value
        return value.clone() if isinstance(local, AsyncCollectiveTensor) else value

    return tuple(waited(a) if isinstance(a, torch.Tensor) else a for a in args)


def apply_compile(model: nn.Module, mode: str) -> None:
    # torch.compile traces at the first call: a model still on meta here (a Hugging Face model's,
    # given storage in the weights stage) compiles as any other.
    if mode == "none":
        return
    blocks = compiled_blocks(model)
    for block in blocks:
        block.register_forward_pre_hook(_wait_for_inputs)
        # A mixture of experts routes a data-dependent number of tokens to each expert: its
        # block compiles in pieces around that (graph breaks), a dense block as one graph.
        block.forward = torch.compile(block.forward, fullgraph=not moe_blocks(block))
    # one graph for all blocks, recompiled at most for a changed shape (evaluation's batch, say)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(blocks))
