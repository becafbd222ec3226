"""`trainer.compile: blocks`: torch.compile of each of the model's repeated blocks
(ModelProtocol.compile_units: the Transformer's `layers`, as torchtitan compiles them), after TP
and before FSDP2 wraps them.

Per block, not the whole model: the blocks are one graph compiled once and reused, and DTensor's
per-op dispatch, most of a small TP step on CPU, is traced away inside each. Only each block's
`forward` is compiled, so its hooks (FSDP2's, and the one below) stay eager and parameter names
(checkpoints, exports, plans) keep no `_orig_mod.` prefix: a checkpoint saved compiled resumes
eager and back.
"""
from typing import List, Tuple

import torch
from torch import nn

from framework.config.errors import ConfigError
from framework.models.protocol import offered
from framework.parallel.dtensors import is_async_collective, local_tensor


def compiled_blocks(model: nn.Module) -> List[Tuple[nn.Module, bool]]:
    """The model's repeated blocks (this rank's under pipeline parallelism), each with whether it
    traces whole, or a config error naming what compile needs."""
    blocks = offered(model).compile_units()
    if not blocks:
        raise ConfigError("trainer.compile", "blocks", f"{type(model).__name__} declares no repeated blocks to compile "
                          "(ModelProtocol.compile_units); use trainer.compile=none")
    return blocks


def _wait_for_inputs(module: nn.Module, args: tuple) -> tuple:
    """Inputs whose collective is still in flight (TP's async redistribute of the embedding's
    output) as plain results: torch 2.13's compiled backward otherwise hands the redistribute a
    plain gradient where it expects a DTensor. A copy, only for such inputs."""
    def waited(value):
        return value.clone() if is_async_collective(local_tensor(value)) else value

    return tuple(waited(a) if isinstance(a, torch.Tensor) else a for a in args)


def apply_compile(model: nn.Module, mode: str) -> None:
    # torch.compile traces at the first call: a model still on meta here (a Hugging Face model's,
    # given storage in the weights stage) compiles as any other.
    if mode == "none":
        return
    blocks = compiled_blocks(model)
    for block, whole in blocks:
        block.register_forward_pre_hook(_wait_for_inputs)
        block.forward = torch.compile(block.forward, fullgraph=whole)
    # one graph for all blocks, recompiled at most for a changed shape (evaluation's batch, say)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(blocks))
