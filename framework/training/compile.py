"""`trainer.compile: blocks`: torch.compile of each of the model's repeated blocks (its `layers`,
as torchtitan compiles them), after TP and before FSDP2 wraps them.

Per block, not the whole model: the blocks are one graph compiled once and reused, and DTensor's
per-op dispatch, most of a small TP step on CPU, is traced away inside each. `nn.Module.compile`
compiles in place, so parameter names (checkpoints, exports, plans) keep no `_orig_mod.` prefix,
and a checkpoint saved compiled resumes eager and back.
"""
import torch
from torch import nn

from framework.config.errors import ConfigError


def compiled_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks, or a config error naming what compile needs."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ConfigError("trainer.compile", "blocks", f"{type(model).__name__} has no `layers` ModuleList of "
                          "repeated blocks to compile; use trainer.compile=none")
    return layers


def apply_compile(model: nn.Module, mode: str) -> None:
    # The dry run's model is on meta: compiling changes none of the shapes, bytes or collectives it reports.
    if mode == "none" or any(p.is_meta for p in model.parameters()):
        return
    for block in compiled_blocks(model):
        block.compile()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(model.layers))
