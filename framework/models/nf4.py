"""QLoRA's base (Dettmers et al. 2023, as torchtune builds it): each LoRA-adapted layer's frozen
weight stored as torchao's 4-bit NormalFloat tensor, about 0.28x of its bf16 bytes. The layer's
nn.Linear computes with it unchanged (NF4Tensor dequantizes to bf16 inside F.linear); its
adapters, and every other parameter, stay as they were.

The weight is quantized from its bf16 rounding in blocks of `block_size` values, each block's
scale quantized again in blocks of `scaler_block_size` (QLoRA's double quantization), so a
weight must hold a multiple of block_size x scaler_block_size values. FSDP2 shards NF4 weights
(torchao implements its all-gather); tensor parallelism cannot (torchao 0.18 has no
aten.split(NF4Tensor, dim=1), which a rowwise layer needs), and is refused.
"""
import logging
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from framework.config.errors import ConfigError
from framework.config.checked import Checked
from framework.models.adapter_names import adapter_layers, targets_of


@contextmanager
def torchao_quietly() -> Iterator[None]:
    """Around an import that loads torchao (ours for NF4; transformers' quantizers, which lm-eval's
    Hugging Face backend imports): without its CUDA build torchao logs "Failed to load
    ..._C_mxfp8 / _C_cutlass_90a" and torch a pytree deprecation line per enum it registers, none
    of which concerns a run that uses no torchao kernel."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _nf4() -> Callable:
    """torchao's to_nf4, imported where NF4 is used and quietly."""
    with torchao_quietly():
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    return to_nf4


def nf4_of_adapted(model: nn.Module, block_size: int, scaler_block_size: int
                   ) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """(parameter name, value) -> what to store: an adapted layer's weight as NF4, quantized from
    its bf16 rounding; any other value as it is."""
    to_nf4, adapted = _nf4(), {f"{name}.weight" for name, _ in adapter_layers(model)}

    def convert(name: str, value: torch.Tensor) -> torch.Tensor:
        return to_nf4(value.detach().to(torch.bfloat16), block_size, scaler_block_size) if name in adapted else value
    return convert


@torch.no_grad()
def quantize_base(model: nn.Module, block_size: int, scaler_block_size: int) -> None:
    """Every adapted layer's weight as NF4 (frozen, as it was)."""
    convert = nf4_of_adapted(model, block_size, scaler_block_size)
    for name, layer in adapter_layers(model):
        layer.weight = nn.Parameter(convert(f"{name}.weight", layer.weight), requires_grad=False)


def is_nf4(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "NF4Tensor"


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the values an NF4 weight computes with (its bf16 values, in fp32); any
    other tensor as it is."""
    return tensor.get_original_weight().float() if is_nf4(tensor) else tensor


def check_qlora(c: Checked) -> None:
    """Before launch (adapter=qlora): torchao is installed, every adapted weight splits into whole
    quantization blocks, and nothing NF4 weights cannot do is asked of them."""
    cfg, model, tp_size = c.cfg, c.model, c.roles.tp_size
    adapter = cfg.adapter
    if adapter.kind != "qlora":
        return
    try:
        _nf4()
    except ImportError:
        raise ConfigError("adapter", "qlora", "needs torchao (pip install 'framework[qlora]')") from None
    blocks = adapter.block_size * adapter.scaler_block_size
    for name, layer in targets_of(model, list(adapter.targets)):
        if layer.weight.numel() % blocks:
            raise ConfigError("adapter.scaler_block_size", adapter.scaler_block_size,
                              f"{name}.weight holds {layer.weight.numel()} values, not a multiple of adapter.block_size "
                              f"x adapter.scaler_block_size = {blocks}; choose block sizes that divide it")
    if tp_size > 1:
        raise ConfigError("adapter", "qlora", "NF4 weights do not shard under tensor parallelism (torchao has no "
                                              "aten.split(NF4Tensor, dim=1)); give the ranks to dp, fsdp or pp")
    if cfg.checkpoint.init_from:
        raise ConfigError("checkpoint.init_from", cfg.checkpoint.init_from,
                          "adapter=qlora quantizes a Hugging Face model or the seed's; export the checkpoint "
                          "(framework.export CKPT OUT --format hf) and give model=hf model.path=OUT")
